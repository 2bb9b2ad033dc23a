//! Python face of the file-system rules in `fs` that Python needs too.

use std::path::PathBuf;

use pyo3::prelude::*;

use dask_shm_core::fs;

/// Whether `path` lies on a RAM-backed file system (tmpfs, ramfs or
/// hugetlbfs, by `statfs` magic number): dask-shm's one rule for "this is
/// shared memory". False if `path` cannot be examined (missing, no access)
/// and off Linux; never raises for such paths.
#[pyfunction]
pub fn is_ram_backed(py: Python<'_>, path: PathBuf) -> bool {
    py.detach(|| fs::is_ram_backed(&path))
}
