//! `dask_shm._core`: the Rust half of dask-shm. This file only wires the
//! Python module; each concern lives in its own module.

mod amm;
pub mod born;
mod born_py;
mod errors;
pub mod format;
pub mod fs;
pub mod ledger;
mod local_transport;
pub mod peer;
mod py_amm;
mod py_amm_tracker;
mod py_buffers;
mod py_fs;
mod py_local_transport;
mod py_set_order;
mod py_slots;
mod py_store;
mod py_tier;
mod recycle;
pub mod store;
pub mod tier;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FRAME_ALIGNMENT", format::ALIGN)?;
    m.add("FRAME_ALIGN_MIN_LEN", format::ALIGN_MIN_LEN)?;
    m.add_class::<py_store::FileStore>()?;
    m.add_class::<py_buffers::MappedFile>()?;
    m.add_class::<py_amm::AmmRun>()?;
    m.add_class::<py_amm_tracker::ReplicaTracker>()?;
    m.add_class::<py_amm_tracker::TrackerHub>()?;
    m.add_class::<py_amm_tracker::ReplicaHook>()?;
    m.add("AMM_REJECTIONS", py_amm::rejections(m.py())?)?;
    m.add("AMM_MAX_COUNTED_WAITERS", amm::MAX_COUNTED_WAITERS)?;
    m.add_function(wrap_pyfunction!(py_amm::replicas_to_keep, m)?)?;
    m.add_class::<py_tier::TierBudget>()?;
    m.add_function(wrap_pyfunction!(py_tier::move_entry, m)?)?;
    m.add_class::<py_local_transport::MappedRange>()?;
    m.add_function(wrap_pyfunction!(py_local_transport::map_frames, m)?)?;
    m.add_function(wrap_pyfunction!(py_local_transport::buffer_address, m)?)?;
    m.add_function(wrap_pyfunction!(
        py_local_transport::py_pages_unmodified,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(py_store::read_peer_file, m)?)?;
    m.add_function(wrap_pyfunction!(py_buffers::live_mappings, m)?)?;
    m.add_function(wrap_pyfunction!(py_buffers::mapped_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(py_fs::is_ram_backed, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_configure, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_handler, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::set_numpy_handler, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_block, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_seal, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_disown, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_header_size, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_stats, m)?)?;
    m.add_function(wrap_pyfunction!(born_py::born_release_cache, m)?)?;
    m.add(
        "ForgedHandleError",
        m.py().get_type::<errors::ForgedHandleError>(),
    )?;
    m.add(
        "SpillFileError",
        m.py().get_type::<errors::SpillFileError>(),
    )?;
    Ok(())
}
