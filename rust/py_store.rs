//! Python face of `store::FileStore`: `dask_shm._core.FileStore`.
//!
//! Every method that touches the file system releases the GIL while it does.

use std::sync::Arc;

use pyo3::exceptions::{PyKeyError, PyOSError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList, PyMemoryView};

use crate::py_buffers::{slices_from_raw, HeldBuffer, MappedFile};
use crate::store::{FileStore as Store, PutOutcome, StoreError};

pyo3::create_exception!(
    _core,
    SpillFileError,
    PyOSError,
    "A spill file exists but cannot be read back: truncated, corrupted or not ours."
);

fn to_pyerr(e: StoreError) -> PyErr {
    match e {
        StoreError::Missing(name) => PyKeyError::new_err(name),
        StoreError::Corrupt { .. } => SpillFileError::new_err(e.to_string()),
        StoreError::Io(io) => io.into(),
    }
}

/// Slice a buffer-exporting object into one memoryview per frame.
fn frame_views<'py>(
    py: Python<'py>,
    owner: &Bound<'py, PyAny>,
    frames: &[(u64, u64)],
) -> PyResult<Bound<'py, PyList>> {
    let whole = PyMemoryView::from(owner)?;
    let views = frames
        .iter()
        .map(|&(off, len)| {
            let slice = pyo3::types::PySlice::new(py, off as isize, (off + len) as isize, 1);
            whole.get_item(slice)
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, views)
}

/// A directory of spill files with their accounting. Thread-safe.
#[pyclass(module = "dask_shm._core", frozen)]
pub struct FileStore {
    inner: Arc<Store>,
}

#[pymethods]
impl FileStore {
    /// Open (creating it with mode 0700 if needed) the spill directory.
    #[new]
    fn new(py: Python<'_>, directory: std::path::PathBuf) -> PyResult<FileStore> {
        let inner = py.detach(|| Store::open(directory))?;
        Ok(FileStore {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn directory(&self) -> std::path::PathBuf {
        self.inner.directory().to_path_buf()
    }

    /// Write `frames` into a new file `{stem}#{n}`; account `memory` bytes in
    /// memory and the file size on disk. Returns `(name, disk_bytes)`, or None
    /// without writing anything when that would take the store past `max_disk`.
    #[pyo3(signature = (stem, frames, memory, max_disk=None))]
    fn put(
        &self,
        py: Python<'_>,
        stem: &str,
        frames: &Bound<'_, PyAny>,
        memory: u64,
        max_disk: Option<u64>,
    ) -> PyResult<Option<(String, u64)>> {
        let held = frames
            .try_iter()?
            .map(|f| HeldBuffer::get(&f?))
            .collect::<PyResult<Vec<_>>>()?;
        let raw: Vec<(usize, usize)> = held.iter().map(HeldBuffer::raw).collect();
        let store = Arc::clone(&self.inner);
        let outcome = py.detach(move || {
            // SAFETY: `held` outlives this closure (it is dropped after detach returns).
            let slices = unsafe { slices_from_raw(&raw) };
            store.put(stem, &slices, memory, max_disk)
        })?;
        drop(held);
        Ok(match outcome {
            PutOutcome::Stored { name, disk } => Some((name, disk)),
            PutOutcome::OverCapacity => None,
        })
    }

    /// Read a file back as one memoryview per frame, copied into a private
    /// bytearray (nothing stays open afterwards).
    fn read<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyList>> {
        let store = Arc::clone(&self.inner);
        let (mut file, size) = py.detach(|| store.open_entry(name)).map_err(to_pyerr)?;
        let mut layout = None;
        let buf = PyByteArray::new_with(py, size as usize, |bytes| {
            let result = py.detach(|| store.read_into(name, &mut file, bytes));
            layout = Some(result.map_err(to_pyerr)?);
            Ok(())
        })?;
        let layout = layout.expect("set by new_with on success");
        frame_views(py, buf.as_any(), &layout.frames)
    }

    /// Map a file copy-on-write and return one writable memoryview per frame,
    /// all backed by the mapping (no copy). Frames are 64-byte aligned.
    fn read_mapped<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyList>> {
        let store = Arc::clone(&self.inner);
        let (map, layout) = py.detach(|| store.map(name)).map_err(to_pyerr)?;
        let path = self.inner.path_of(name).to_string_lossy().into_owned();
        let mapped = Bound::new(py, MappedFile::new(map, path))?;
        frame_views(py, mapped.as_any(), &layout.frames)
    }

    /// Forget an entry and delete its file (a file already gone is fine).
    /// Returns `(memory, disk)` that were accounted, or None if unknown.
    fn delete(&self, py: Python<'_>, name: &str) -> PyResult<Option<(u64, u64)>> {
        let store = Arc::clone(&self.inner);
        let sizes = py.detach(|| store.remove(name))?;
        Ok(sizes.map(|s| (s.memory, s.disk)))
    }

    /// `(memory, disk)` accounted for one entry; KeyError if unknown.
    fn sizes(&self, name: &str) -> PyResult<(u64, u64)> {
        self.inner
            .sizes(name)
            .map(|s| (s.memory, s.disk))
            .ok_or_else(|| PyKeyError::new_err(name.to_owned()))
    }

    /// `(memory, disk)` summed over all entries.
    fn total(&self) -> (u64, u64) {
        let t = self.inner.total();
        (t.memory, t.disk)
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.inner.path_of(name)
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __contains__(&self, name: &str) -> bool {
        self.inner.sizes(name).is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "<FileStore {} ({} files)>",
            self.inner.directory().display(),
            self.inner.len()
        )
    }
}
