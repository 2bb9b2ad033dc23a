//! `SharePublishing`: a worker's figures for its nanny published by the core's
//! `publish::Publisher` thread, from counters kept in Rust: its RAM stores'
//! totals, this process's mappings of shared files (`buffers`) and the born
//! arena (`born`). No GIL is taken to publish.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use dask_shm_core::publish::{Figures, Publisher};
use dask_shm_core::store::FileStore as Store;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::born::ARENA;
use crate::buffers::mapping_memory;
use crate::store::FileStore;

/// This process's figures as `dask_shm.shared.monitor._published_pages`
/// and `TieredFiles.ram_bytes` give them: the stores' shares (the disk size
/// of a file over its link count), mapped and kept bytes, with the born
/// arena's own blocks in both.
/// The pages are read before the share, as `SharePublisher.publish` reads
/// them: a mapping made meanwhile then shows in neither.
fn figures(stores: &[Weak<Store>]) -> Figures {
    let (mapped, kept) = mapping_memory();
    let arena = {
        let stats = ARENA.stats();
        (stats.owned_bytes + stats.cached_bytes) as u64
    };
    let share = stores
        .iter()
        .filter_map(Weak::upgrade)
        .map(|store| store.total().disk)
        .sum();
    Figures {
        share,
        mapped: mapped as u64 + arena,
        kept: kept as u64 + arena,
    }
}

/// Publishes, every `interval` seconds until `stop()`, the share of
/// `stores` and this process's mapping figures at `path`, in the line
/// `<share> <namespace or -> <mapped> <kept> <stamp>`. Holds the stores
/// weakly: a store gone counts 0.
#[pyclass(module = "dask_shm._core", frozen)]
pub struct SharePublishing {
    publisher: Mutex<Option<Publisher>>,
}

#[pymethods]
impl SharePublishing {
    #[new]
    #[pyo3(signature = (path, stores, namespace, interval))]
    fn new(
        path: PathBuf,
        stores: Vec<PyRef<'_, FileStore>>,
        namespace: Option<u64>,
        interval: f64,
    ) -> PyResult<SharePublishing> {
        if !(interval.is_finite() && interval > 0.0) {
            return Err(PyValueError::new_err(format!(
                "interval must be a positive number of seconds, not {interval}"
            )));
        }
        let stores: Vec<Weak<Store>> = stores.iter().map(|s| Arc::downgrade(&s.inner)).collect();
        let publisher = Publisher::start(
            path,
            namespace,
            Duration::from_secs_f64(interval),
            Box::new(move || figures(&stores)),
        )?;
        Ok(SharePublishing {
            publisher: Mutex::new(Some(publisher)),
        })
    }

    /// The figures the thread publishes, now: `(share, mapped, kept)`.
    #[staticmethod]
    fn figures_of(stores: Vec<PyRef<'_, FileStore>>) -> (u64, u64, u64) {
        let stores: Vec<Weak<Store>> = stores.iter().map(|s| Arc::downgrade(&s.inner)).collect();
        let f = figures(&stores);
        (f.share, f.mapped, f.kept)
    }

    /// Whether the thread still publishes.
    fn running(&self) -> bool {
        self.publisher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// End the thread (waiting for a write in progress); idempotent.
    fn stop(&self, py: Python<'_>) {
        let publisher = self
            .publisher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        py.detach(move || drop(publisher));
    }
}
