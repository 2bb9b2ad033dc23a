//! Python face of `local_transport` for the local shared-memory scheduler
//! (`dask_shm.local`): `map_frames`, `buffer_address`, `MappedRange` and
//! `pages_unmodified`.

use std::ffi::c_int;
use std::path::PathBuf;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::buffers::{export_bytes, MappedFile};
use crate::errors::to_pyerr_at;
use dask_shm_core::local_transport::{map_published, pages_unmodified};
use dask_shm_core::store::StoreError;

/// A mapping, its base address and the `(offset, length)` of each frame.
type MappedFrames = (Py<MappedFile>, usize, Vec<(u64, u64)>);

/// Map a spill-format file written by any process, copy-on-write.
///
/// Returns `(mapping, base address, [(offset, length) of each frame])`.
/// Raises FileNotFoundError/OSError if the file cannot be opened and
/// `SpillFileError` if it is truncated, corrupted or not a spill file.
#[pyfunction]
pub fn map_frames(py: Python<'_>, path: PathBuf) -> PyResult<MappedFrames> {
    let (map, layout) = py.detach(|| map_published(&path)).map_err(|e| match e {
        // The OSError subclass of the errno, as PyO3 converts io::Error.
        StoreError::Io(io) => PyErr::from(io),
        // SpillFileError("spill file <path> is unreadable: <why>").
        other => to_pyerr_at(other, &path),
    })?;
    let base = map.as_ptr() as usize;
    let mapped = Py::new(
        py,
        MappedFile::new(map, path.to_string_lossy().into_owned(), false),
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

/// Python face of [`pages_unmodified`]. The range must lie inside a private
/// file mapping that is alive (e.g. a `MappedFile` the caller holds); raises
/// OSError if `/proc/self/pagemap` cannot be read.
#[pyfunction(name = "pages_unmodified")]
pub fn py_pages_unmodified(py: Python<'_>, addr: usize, len: usize) -> PyResult<bool> {
    Ok(py.detach(|| pages_unmodified(addr, len))?)
}
