//! Cross-process helpers for the local shared-memory scheduler
//! (`dask_shm.local`): map a spill-format file written by another process,
//! find where a buffer lives in memory, and tell whether the pages of a private
//! file mapping still hold the file's bytes.
//!
//! Writing goes through `FileStore::put` (each process has its own store on the
//! shared directory); these functions only read.

use std::ffi::c_int;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use memmap2::{MmapMut, MmapOptions};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::SpillFileError;
use crate::format::{self, FormatError, Layout};
use crate::py_buffers::{export_bytes, MappedFile};

enum MapError {
    Io(io::Error),
    Format(FormatError),
}

/// Map `path` copy-on-write and validate its spill-format header.
fn map_path(path: &Path) -> Result<(MmapMut, Layout), MapError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(MapError::Io)?;
    let size = file.metadata().map_err(MapError::Io)?.len();
    if size < 16 {
        return Err(MapError::Format(FormatError::TooShort { size }));
    }
    // SAFETY: the mapping is private. Files of the local scheduler are
    // published whole, never truncated or rewritten, only unlinked (a mapping
    // outlives the unlink), and live in a 0700 directory of this user.
    let map = unsafe { MmapOptions::new().map_copy(&file) }.map_err(MapError::Io)?;
    let layout = format::parse_layout(&map, size).map_err(MapError::Format)?;
    Ok((map, layout))
}

/// A mapping, its base address and the `(offset, length)` of each frame.
type MappedFrames = (Py<MappedFile>, usize, Vec<(u64, u64)>);

/// Map a spill-format file written by any process, copy-on-write.
///
/// Returns `(mapping, base address, [(offset, length) of each frame])`.
/// Raises FileNotFoundError/OSError if the file cannot be opened and
/// `SpillFileError` if it is truncated, corrupted or not a spill file.
#[pyfunction]
pub fn map_frames(py: Python<'_>, path: PathBuf) -> PyResult<MappedFrames> {
    let (map, layout) = py.detach(|| map_path(&path)).map_err(|e| match e {
        MapError::Io(io) => PyErr::from(io),
        MapError::Format(f) => {
            SpillFileError::new_err(format!("spill file {} is unreadable: {f}", path.display()))
        }
    })?;
    let base = map.as_ptr() as usize;
    let mapped = Py::new(
        py,
        MappedFile::new(map, path.to_string_lossy().into_owned()),
    )?;
    Ok((mapped, base, layout.frames))
}

/// `(address, length)` of the bytes exported by a buffer object. Never copies:
/// raises BufferError if `obj` cannot export one contiguous buffer.
#[pyfunction]
pub fn buffer_address(obj: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let mut view = std::mem::MaybeUninit::<ffi::Py_buffer>::uninit();
    // SAFETY: PyObject_GetBuffer fills `view` on success (return 0); the view
    // is released right after reading two fields.
    unsafe {
        let rc: c_int = ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_SIMPLE);
        if rc != 0 {
            return Err(PyErr::take(obj.py())
                .unwrap_or_else(|| PyBufferError::new_err("object does not export a buffer")));
        }
        let mut view = view.assume_init();
        let out = (view.buf as usize, view.len as usize);
        ffi::PyBuffer_Release(&mut view);
        Ok(out)
    }
}

/// A byte range of a [`MappedFile`], exported through the buffer protocol
/// (writable: the mapping is private) and weakly referenceable, so the owner
/// of the file can learn when the last consumer of the range is gone. Any
/// object built on it (a numpy array, a memoryview, a pyarrow buffer) keeps it,
/// and through it the mapping, alive.
#[pyclass(module = "dask_shm._core", frozen, weakref)]
pub struct MappedRange {
    mapping: Py<MappedFile>,
    addr: usize,
    len: usize,
}

#[pymethods]
impl MappedRange {
    /// `length` bytes of `mapping` starting at `offset`; ValueError if the
    /// range does not lie inside the mapping.
    #[new]
    fn new(mapping: &Bound<'_, MappedFile>, offset: usize, length: usize) -> PyResult<Self> {
        let (base, size) = buffer_address(mapping.as_any())?;
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "range {offset}+{length} is outside a mapping of {size} bytes"
            )));
        }
        Ok(MappedRange {
            mapping: mapping.clone().unbind(),
            addr: base + offset,
            len: length,
        })
    }

    #[getter]
    fn mapping(&self, py: Python<'_>) -> Py<MappedFile> {
        self.mapping.clone_ref(py)
    }

    /// Address of the first byte.
    #[getter]
    fn address(&self) -> usize {
        self.addr
    }

    fn __len__(&self) -> usize {
        self.len
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("View is null"));
        }
        let this = slf.get();
        // The range lies in a private mapping kept alive by `mapping`, which
        // this frozen object holds for as long as any view (holding a
        // reference to it) exists.
        let ptr = this.addr as *mut std::ffi::c_void;
        export_bytes(view, slf.clone().into_any(), ptr, this.len, flags);
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

/// True if no page of `[addr, addr + len)` in this process has been written
/// since it was mapped from a file, judged from `/proc/self/pagemap`: a page
/// of a private file mapping is either not yet faulted in, or present and
/// backed by the file's page cache; a written page is an anonymous copy
/// (present without the file bit, or swapped out).
pub fn pages_unmodified(addr: usize, len: usize) -> io::Result<bool> {
    if len == 0 {
        return Ok(true);
    }
    let page = page_size();
    let first = addr / page;
    let last = (addr + len - 1) / page;
    let mut entries = vec![0u8; (last - first + 1) * 8];
    let pagemap = File::open("/proc/self/pagemap")?;
    pagemap.read_exact_at(&mut entries, (first * 8) as u64)?;
    Ok(entries.chunks_exact(8).all(|chunk| {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let entry = u64::from_le_bytes(word);
        let written = entry & PM_SWAPPED != 0 || (entry & PM_PRESENT != 0 && entry & PM_FILE == 0);
        !written
    }))
}

/// Python face of [`pages_unmodified`]. The range must lie inside a private
/// file mapping that is alive (e.g. a `MappedFile` the caller holds); raises
/// OSError if `/proc/self/pagemap` cannot be read.
#[pyfunction(name = "pages_unmodified")]
pub fn py_pages_unmodified(py: Python<'_>, addr: usize, len: usize) -> PyResult<bool> {
    Ok(py.detach(|| pages_unmodified(addr, len))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{FileStore, PutOutcome};

    #[test]
    fn written_pages_are_detected() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let data = vec![5u8; 5 * page_size()];
        let name = match store.put("p", &[&data], 1, None).unwrap() {
            PutOutcome::Stored { name, .. } => name,
            PutOutcome::OverCapacity => unreachable!(),
        };
        let (mut map, layout) = map_path(&store.path_of(&name)).ok().unwrap();
        let (off, len) = layout.frames[0];
        let base = map.as_ptr() as usize + off as usize;
        assert!(pages_unmodified(base, len as usize).unwrap());
        // Reading faults pages in from the file; they still count as unmodified.
        let sum: u64 = map[off as usize..].iter().map(|&b| b as u64).sum();
        assert_eq!(sum, 5 * len);
        assert!(pages_unmodified(base, len as usize).unwrap());
        map[off as usize + 3 * page_size()] = 9;
        assert!(!pages_unmodified(base, len as usize).unwrap());
        assert!(pages_unmodified(base, page_size()).unwrap());
    }

    #[test]
    fn garbage_files_are_rejected() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("junk");
        std::fs::write(&path, b"definitely not a spill file").unwrap();
        assert!(matches!(
            map_path(&path),
            Err(MapError::Format(FormatError::BadMagic))
        ));
        assert!(matches!(
            map_path(&tmp.path().join("missing")),
            Err(MapError::Io(_))
        ));
    }
}
