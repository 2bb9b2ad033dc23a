//! Python face of the file-system rules in `fs` that Python needs too.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::errors::io_error_at;
use dask_shm_core::fs::{self, Fingerprint};

/// Whether `path` lies on a RAM-backed file system (tmpfs, ramfs or
/// hugetlbfs, by `statfs` magic number): dask-shm's one rule for "this is
/// shared memory". False if `path` cannot be examined (missing, no access)
/// and off Linux; never raises for such paths.
#[pyfunction]
pub fn is_ram_backed(py: Python<'_>, path: PathBuf) -> bool {
    py.detach(|| fs::is_ram_backed(&path))
}

/// Run `f` with the GIL held if `keep_gil`, else released. Hold it for a
/// short call on a RAM-backed file system: a thread that releases the GIL
/// while another runs Python waits up to the switch interval (5 ms) to take
/// it back, far longer than a tmpfs metadata operation takes.
pub(crate) fn run<T: pyo3::marker::Ungil>(
    py: Python<'_>,
    keep_gil: bool,
    f: impl FnOnce() -> T + pyo3::marker::Ungil,
) -> T {
    if keep_gil {
        f()
    } else {
        py.detach(f)
    }
}

fn fields(f: Fingerprint) -> (u64, i64, u64) {
    (f.size, f.mtime_ns, f.inode)
}

/// Make the file at `path` read-only (0400) without following a symlink and
/// return its fingerprint `(size, mtime_ns, inode)`, with the GIL held if
/// `keep_gil`. Raises OSError naming `path` (ELOOP for a symlink).
#[pyfunction]
pub fn seal_file(py: Python<'_>, path: PathBuf, keep_gil: bool) -> PyResult<(u64, i64, u64)> {
    run(py, keep_gil, || fs::seal(&path))
        .map(fields)
        .map_err(|e| io_error_at(e, &path))
}

/// `(size, mtime_ns, inode)` of whatever is at `path` (`lstat`), with the GIL
/// held if `keep_gil`. Raises OSError naming `path` (FileNotFoundError if
/// nothing is there).
#[pyfunction]
pub fn file_fingerprint(
    py: Python<'_>,
    path: PathBuf,
    keep_gil: bool,
) -> PyResult<(u64, i64, u64)> {
    run(py, keep_gil, || fs::fingerprint(&path))
        .map(fields)
        .map_err(|e| io_error_at(e, &path))
}

/// Delete the file at `path`, with the GIL held if `keep_gil`; False if
/// nothing was there. Raises OSError naming `path` for any other failure.
#[pyfunction]
pub fn unlink_file(py: Python<'_>, path: PathBuf, keep_gil: bool) -> PyResult<bool> {
    match run(py, keep_gil, || std::fs::remove_file(&path)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_error_at(e, &path)),
    }
}
