//! The Python exceptions of `dask_shm._core` and the mapping of the Rust
//! cores' errors (`StoreError`, `PeerError`, `io::Error`) to them, used by
//! every PyO3 face.
//!
//! Stock spills through `os` and `open`, whose errors are the OSError subclass of
//! their errno (FileNotFoundError, NotADirectoryError, PermissionError, ...) and
//! name the path: `[Errno 20] Not a directory: '/x/spill'`. Ours raise the same,
//! built as `OSError(errno, strerror, path)`, which Python turns into the subclass.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use pyo3::exceptions::{PyKeyError, PyOSError, PyValueError};
use pyo3::prelude::*;

use dask_shm_core::peer::PeerError;
use dask_shm_core::store::StoreError;

pyo3::create_exception!(
    _core,
    SpillFileError,
    PyOSError,
    "A spill file exists but cannot be read back: truncated, corrupted or not ours."
);

pyo3::create_exception!(
    _core,
    ForgedHandleError,
    PyValueError,
    "A shared-memory handle from a peer names a file we must not accept."
);

/// A refused peer handle as ForgedHandleError; an I/O error as its OSError.
pub(crate) fn peer_err(e: PeerError) -> PyErr {
    match e {
        PeerError::Forged(_) => ForgedHandleError::new_err(e.to_string()),
        PeerError::Io(io) => io.into(),
    }
}

/// The C library's message for `errno`, as Python's `os.strerror` gives it.
pub(crate) fn strerror(errno: i32) -> String {
    let text = io::Error::from_raw_os_error(errno).to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_owned(),
        None => text,
    }
}

/// `OSError(errno, message, path)`: the subclass of `errno`, naming `path`.
pub(crate) fn os_error_with(errno: i32, message: String, path: &Path) -> PyErr {
    PyOSError::new_err((errno, message, path.to_string_lossy().into_owned()))
}

/// `OSError(errno, strerror(errno), path)`.
pub(crate) fn os_error(errno: i32, path: &Path) -> PyErr {
    os_error_with(errno, strerror(errno), path)
}

/// An I/O error about `path`: with its errno, the matching OSError subclass
/// naming `path`; errors without an errno keep their kind and message.
pub(crate) fn io_error_at(e: io::Error, path: &Path) -> PyErr {
    match e.raw_os_error() {
        Some(errno) => os_error(errno, path),
        None => e.into(),
    }
}

/// Why the spill directory `dir` could not be opened, as stock reports it
/// (`os.makedirs`): NotADirectoryError when it, or a directory above it, is
/// not a directory, naming `dir` or the first directory that cannot be created. Ours also refuses a symbolic link (OSError
/// ELOOP) and another user's directory (PermissionError).
pub(crate) fn directory_error(e: io::Error, dir: &Path) -> PyErr {
    match fs::symlink_metadata(dir) {
        Ok(meta) if meta.file_type().is_symlink() => os_error_with(
            libc::ELOOP,
            "spill directory is a symbolic link, not a plain directory (not followed)".to_owned(),
            dir,
        ),
        Ok(meta) if !meta.is_dir() => os_error(libc::ENOTDIR, dir),
        Ok(meta) if e.raw_os_error().is_none() && e.kind() == io::ErrorKind::PermissionDenied => {
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            let message = format!(
                "spill directory belongs to uid {}, not to this user (uid {me})",
                meta.uid()
            );
            os_error_with(libc::EACCES, message, dir)
        }
        Err(_) => match dir.ancestors().skip(1).find(|a| a.is_file()) {
            // Like os.makedirs: the first directory it fails to create, the one
            // right under the file.
            Some(file) => {
                let first = dir.ancestors().find(|a| a.parent() == Some(file));
                os_error(libc::ENOTDIR, first.unwrap_or(dir))
            }
            None => io_error_at(e, dir),
        },
        _ => io_error_at(e, dir),
    }
}

/// A store error about `path` as the Python exception stock would raise.
pub(crate) fn to_pyerr_at(e: StoreError, path: &Path) -> PyErr {
    match e {
        StoreError::Missing(name) => PyKeyError::new_err(name),
        StoreError::Corrupt { .. } => SpillFileError::new_err(e.to_string()),
        StoreError::Io(io) => io_error_at(io, path),
    }
}

#[cfg(test)]
mod tests {
    use super::strerror;

    #[test]
    fn strerror_is_the_c_message_without_rusts_suffix() {
        assert_eq!(strerror(libc::ENOTDIR), "Not a directory");
        assert_eq!(strerror(libc::ENOENT), "No such file or directory");
    }
}
