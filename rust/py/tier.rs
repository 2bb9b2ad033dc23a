//! Python face of `tier`: `dask_shm._core.move_entry` and `TierBudget`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use crate::buffers::release_entry;
use crate::errors::to_pyerr_at;
use crate::store::FileStore;
use dask_shm_core::tier::{self, TierBudget as Budget};

/// Move entry `name` of `src` into `dst` (copy in the kernel, account, then
/// remove the source), with the GIL released. Returns `(name in dst, disk
/// bytes)`. Raises KeyError for an unknown name, OSError (ENOSPC, ...) or
/// SpillFileError on failure, leaving `src` unchanged.
#[pyfunction]
pub fn move_entry(
    py: Python<'_>,
    src: &FileStore,
    name: &str,
    dst: &FileStore,
) -> PyResult<(String, u64)> {
    let (s, d) = (Arc::clone(&src.inner), Arc::clone(&dst.inner));
    let moved = py.detach(|| tier::move_entry(&s, name, &d));
    // A mapping of the old file keeps it in RAM once `src` lets it go (which
    // a move can do and still fail: an unlink that failed after the copy).
    if s.sizes(name).is_none() {
        release_entry(src.id(), name);
    }
    moved.map_err(|e| to_pyerr_at(e, &d.path_of(name)))
}

/// Byte budget of tier 2 in least-recently-used order (see `dask_shm_core::tier`).
#[pyclass(module = "dask_shm._core", frozen)]
pub struct TierBudget {
    inner: Mutex<Budget>,
}

impl TierBudget {
    fn lock(&self) -> std::sync::MutexGuard<'_, Budget> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl TierBudget {
    #[new]
    fn new(limit: u64) -> Self {
        TierBudget {
            inner: Mutex::new(Budget::new(limit)),
        }
    }

    #[getter]
    fn limit(&self) -> u64 {
        self.lock().limit()
    }

    #[setter]
    fn set_limit(&self, limit: u64) {
        self.lock().set_limit(limit)
    }

    #[getter]
    fn used(&self) -> u64 {
        self.lock().used()
    }

    fn add(&self, name: &str, size: u64) {
        self.lock().add(name, size)
    }

    fn remove(&self, name: &str) -> bool {
        self.lock().remove(name)
    }

    fn touch(&self, name: &str) {
        self.lock().touch(name)
    }

    fn pin(&self, name: &str) {
        self.lock().pin(name)
    }

    fn unpin(&self, name: &str) {
        self.lock().unpin(name)
    }

    fn is_pinned(&self, name: &str) -> bool {
        self.lock().is_pinned(name)
    }

    fn set_deferred(&self, name: &str, deferred: bool) {
        self.lock().set_deferred(name, deferred)
    }

    fn is_deferred(&self, name: &str) -> bool {
        self.lock().is_deferred(name)
    }

    /// `(victims, fits)`: least recently used unpinned entries to move out,
    /// oldest first (deferred ones after the others), and whether
    /// `incoming` bytes then fit.
    fn plan(&self, incoming: u64) -> (Vec<String>, bool) {
        let plan = self.lock().plan(incoming);
        (plan.victims, plan.fits)
    }

    fn __len__(&self) -> usize {
        self.lock().len()
    }

    fn __repr__(&self) -> String {
        let b = self.lock();
        format!(
            "<TierBudget {} of {} bytes, {} files>",
            b.used(),
            b.limit(),
            b.len()
        )
    }
}
