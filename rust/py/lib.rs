//! `dask_shm._core`: the PyO3 bindings of dask-shm over the pure Rust core
//! (`dask_shm_core`, in `rust/core`). Each module here converts Python objects
//! to the core's types and back; `errors` is the one mapping of the core's
//! errors to Python exceptions. This file only declares the Python module.

mod amm;
mod amm_task;
mod amm_tracker;
mod born;
mod buffers;
mod errors;
mod fs;
mod local_transport;
mod publish;
mod set_order;
mod slots;
mod store;
mod tier;

use pyo3::prelude::*;

#[pymodule]
mod _core {
    use pyo3::prelude::*;

    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");
    #[pymodule_export]
    const FRAME_ALIGNMENT: u64 = dask_shm_core::format::ALIGN;
    #[pymodule_export]
    const FRAME_ALIGN_MIN_LEN: u64 = dask_shm_core::format::ALIGN_MIN_LEN;
    #[pymodule_export]
    const BORN_CACHE_DECAY: f64 = dask_shm_core::born::DEFAULT_CACHE_DECAY.as_secs_f64();
    #[pymodule_export]
    const AMM_MAX_COUNTED_WAITERS: usize = dask_shm_core::amm::MAX_COUNTED_WAITERS;

    #[pymodule_export]
    use super::amm::{replicas_to_keep, AmmRun};
    #[pymodule_export]
    use super::amm_tracker::{ReplicaHook, ReplicaTracker, TrackerHub};
    #[pymodule_export]
    use super::born::{
        born_block, born_configure, born_disown, born_handler, born_header_size,
        born_release_cache, born_release_expired, born_seal, born_stats, set_numpy_handler,
    };
    #[pymodule_export]
    use super::buffers::{
        live_mappings, mapped_ranges, mapping_memory, watch_mappings, written_in_place, MappedFile,
    };
    #[pymodule_export]
    use super::errors::{ForgedHandleError, SpillFileError};
    #[pymodule_export]
    use super::fs::{file_fingerprint, is_ram_backed, seal_file, unlink_file};
    #[pymodule_export]
    use super::local_transport::{buffer_address, map_frames, py_pages_unmodified, MappedRange};
    #[pymodule_export]
    use super::publish::SharePublishing;
    #[pymodule_export]
    use super::store::{flush_deletes, read_peer_file, FileStore};
    #[pymodule_export]
    use super::tier::{move_entry, TierBudget};

    /// `AMM_REJECTIONS` is a dict built at import (code -> stock's message).
    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("AMM_REJECTIONS", super::amm::rejections(m.py())?)
    }
}
