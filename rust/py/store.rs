//! Python face of `store::FileStore`: `dask_shm._core.FileStore`.
//!
//! Every method that touches the file system releases the GIL while it does,
//! except short ones on a RAM-backed store (see `FileStore::keeps_gil`).

use std::sync::Arc;

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList, PyMemoryView};

use crate::buffers::{
    release_entry, release_store, slices_from_raw, EntryOfStore, HeldPieces, MappedFile,
};
use crate::errors::{directory_error, io_error_at, peer_err, to_pyerr_at};
use crate::fs::run;
use dask_shm_core::peer::{open_peer_file, PeerFile};
use dask_shm_core::store::{FileStore as Store, PutOutcome};

/// Most bytes an operation on a RAM-backed store moves with the GIL held.
///
/// Releasing the GIL is not free: a thread that released it waits to take it
/// back until the thread that took it lets go, which a thread running Python
/// does only when asked, after the interpreter's switch interval (5 ms). A
/// worker's event loop that releases it for a 30 us mmap while a task runs
/// Python then waits milliseconds for it (measured: a median of 105 us and a
/// 90th percentile of 5.4 ms per `read_mapped` of a 72 KiB file, against 39
/// and 42 us with no other thread). On a tmpfs, metadata operations (open,
/// link, mmap) and copies of up to this many bytes take tens of microseconds
/// and never wait for a device, so they keep the GIL; larger copies, and
/// everything on a disk that may stall, release it.
const KEEP_GIL_MAX_BYTES: u64 = 256 * 1024;

fn open_peer(
    py: Python<'_>,
    keep_gil: bool,
    root: &std::path::Path,
    path: &std::path::Path,
    size: u64,
) -> PyResult<PeerFile> {
    run(py, keep_gil, || open_peer_file(root, path, size)).map_err(peer_err)
}

/// Validate a peer's spill file (see `FileStore.adopt`) and copy it into a
/// private bytearray; returns one memoryview per frame. For when linking is
/// impossible (link limit, permissions): the bytes still never cross a socket.
#[pyfunction]
pub fn read_peer_file<'py>(
    py: Python<'py>,
    root: std::path::PathBuf,
    path: std::path::PathBuf,
    size: u64,
) -> PyResult<Bound<'py, PyList>> {
    let peer = open_peer(py, false, &root, &path, size)?;
    let mut result = Ok(());
    let buf = PyByteArray::new_with(py, size as usize, |bytes| {
        result = py.detach(|| peer.read_all_into(bytes));
        Ok(())
    })?;
    result?;
    frame_views(py, buf.as_any(), &peer.layout.frames)
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
    pub(crate) inner: Arc<Store>,
}

impl FileStore {
    /// Whether an operation of this store that copies `bytes` bytes (0: only
    /// metadata) runs with the GIL held: on a RAM-backed store, up to
    /// `KEEP_GIL_MAX_BYTES`.
    fn keeps_gil(&self, bytes: u64) -> bool {
        self.inner.is_ram_backed() && bytes <= KEEP_GIL_MAX_BYTES
    }

    /// This store's identity among the live stores, for `buffers`' record
    /// of which entries hold mapped files.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        release_store(self.id());
    }
}

#[pymethods]
impl FileStore {
    /// Open (creating it with mode 0700 if needed) the spill directory.
    /// `recycle_bytes` > 0 keeps up to that many bytes of removed entries'
    /// files for reuse by later puts; only for stores whose files are never
    /// mapped (`read_mapped`) by anyone.
    #[new]
    #[pyo3(signature = (directory, recycle_bytes=0, defer_deletes=false))]
    fn new(
        py: Python<'_>,
        directory: std::path::PathBuf,
        recycle_bytes: u64,
        defer_deletes: bool,
    ) -> PyResult<FileStore> {
        if defer_deletes && recycle_bytes > 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "a store that defers deletes cannot recycle files",
            ));
        }
        let inner = py
            .detach(|| {
                if defer_deletes {
                    Store::open_deferring_deletes(&directory)
                } else {
                    Store::open_recycling(&directory, recycle_bytes)
                }
            })
            .map_err(|e| directory_error(e, &directory))?;
        Ok(FileStore {
            inner: Arc::new(inner),
        })
    }

    /// `(files, bytes)` held for reuse (not entries).
    #[getter]
    fn pooled(&self) -> (usize, u64) {
        self.inner.pooled()
    }

    #[getter]
    fn directory(&self) -> std::ffi::OsString {
        self.inner.directory().as_os_str().to_owned()
    }

    /// Write `frames` into a new file `{stem}#{n}`; account `memory` bytes in
    /// memory and the file size on disk. Returns `(name, disk_bytes)`, or None
    /// without writing anything when that would take the store past `max_disk`.
    /// A frame may be any buffer: a strided one (a numpy view) is stored as
    /// its C-order bytes, written from its rows where they are contiguous.
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
            .map(|f| HeldPieces::get(&f?))
            .collect::<PyResult<Vec<_>>>()?;
        let raw: Vec<Vec<(usize, usize)>> = held.iter().map(|h| h.raw().to_vec()).collect();
        let bytes = raw.iter().flatten().map(|&(_, len)| len as u64).sum();
        let store = Arc::clone(&self.inner);
        let outcome = run(py, self.keeps_gil(bytes), move || {
            // SAFETY: `held` outlives this closure (it is dropped after `run` returns).
            let pieces: Vec<Vec<&[u8]>> =
                raw.iter().map(|r| unsafe { slices_from_raw(r) }).collect();
            let frames: Vec<&[&[u8]]> = pieces.iter().map(|p| &p[..]).collect();
            store.put_gathered(stem, &frames, memory, max_disk)
        })
        .map_err(|e| io_error_at(e, self.inner.directory()))?;
        drop(held);
        Ok(match outcome {
            PutOutcome::Stored { name, disk } => Some((name, disk)),
            PutOutcome::OverCapacity => None,
        })
    }

    /// Take the file `name` of this directory (an entry of this store or a
    /// file another process wrote here) into the reuse pool, or delete it if
    /// the pool cannot keep it; True if pooled. The caller guarantees nobody
    /// maps or reads it any more. Raises OSError for an invalid name or a
    /// failed deletion.
    fn give_for_reuse(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        let store = Arc::clone(&self.inner);
        let pooled = py.detach(move || store.give_for_reuse(name));
        if self.inner.sizes(name).is_none() {
            release_entry(self.id(), name);
        }
        pooled.map_err(|e| io_error_at(e, self.inner.directory()))
    }

    /// Read a file back as one memoryview per frame, copied into a private
    /// bytearray (nothing stays open afterwards).
    fn read<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyList>> {
        let store = Arc::clone(&self.inner);
        let path = store.path_of(name);
        let mut reader = run(py, self.keeps_gil(0), || store.open_entry(name))
            .map_err(|e| to_pyerr_at(e, &path))?;
        let keep_gil = self.keeps_gil(reader.size);
        let mut layout = None;
        let buf = PyByteArray::new_with(py, reader.size as usize, |bytes| {
            let result = run(py, keep_gil, || {
                store.read_into(name, &mut reader.file, bytes)
            });
            layout = Some(result.map_err(|e| to_pyerr_at(e, &path))?);
            Ok(())
        })?;
        let layout = layout.expect("set by new_with on success");
        frame_views(py, buf.as_any(), &layout.frames)
    }

    /// Map a file copy-on-write and return one writable memoryview per frame,
    /// all backed by the mapping (no copy). Large frames are 64-byte aligned
    /// (see `format::ALIGN_MIN_LEN`).
    fn read_mapped<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyList>> {
        let store = Arc::clone(&self.inner);
        let path = store.path_of(name);
        let (map, layout) =
            run(py, self.keeps_gil(0), || store.map(name)).map_err(|e| to_pyerr_at(e, &path))?;
        let path = path.to_string_lossy().into_owned();
        let exists = || store.sizes(name).is_some();
        let entry = EntryOfStore {
            store: self.id(),
            name,
            exists: &exists,
        };
        let ram = store.is_ram_backed();
        let mapped = MappedFile::of_entry(map, path, ram, store.defers_deletes(), Some(entry));
        let mapped = Bound::new(py, mapped)?;
        frame_views(py, mapped.as_any(), &layout.frames)
    }

    /// Validate a spill file handed over by a peer and hard-link it into this
    /// store as `{stem}#{n}`, accounted as shared (its disk size is split
    /// among its links). Returns `(name, disk_bytes)`.
    ///
    /// Raises ForgedHandleError (a ValueError) if `path` is not inside
    /// `root` once resolved, is a symlink, is not a regular file owned by this
    /// user, is not `size` bytes or is not a valid spill file; OSError if the
    /// link itself fails (EXDEV, EMLINK, EPERM, ...).
    fn adopt(
        &self,
        py: Python<'_>,
        root: std::path::PathBuf,
        path: std::path::PathBuf,
        size: u64,
        stem: &str,
        memory: u64,
    ) -> PyResult<(String, u64)> {
        let keep_gil = self.keeps_gil(0);
        let peer = open_peer(py, keep_gil, &root, &path, size)?;
        let store = Arc::clone(&self.inner);
        run(py, keep_gil, || store.adopt(&peer, stem, memory))
            .map_err(|e| io_error_at(e, self.inner.directory()))
    }

    /// Hard-link an entry's file into `directory` under a fresh name and
    /// return that path; the entry is then accounted as shared.
    fn link_out(
        &self,
        py: Python<'_>,
        name: &str,
        directory: std::path::PathBuf,
    ) -> PyResult<std::ffi::OsString> {
        let store = Arc::clone(&self.inner);
        run(py, self.keeps_gil(0), || store.link_out(name, &directory))
            .map(std::path::PathBuf::into_os_string)
            .map_err(|e| to_pyerr_at(e, &directory))
    }

    /// Change the memory size accounted for an entry. KeyError if unknown.
    fn set_memory(&self, name: &str, memory: u64) -> PyResult<()> {
        if self.inner.set_memory(name, memory) {
            Ok(())
        } else {
            Err(PyKeyError::new_err(name.to_owned()))
        }
    }

    /// Number of hard links of an entry's file.
    fn link_count(&self, name: &str) -> PyResult<u64> {
        self.inner
            .link_count(name)
            .map_err(|e| to_pyerr_at(e, &self.inner.path_of(name)))
    }

    /// Stop accounting the entry `name`, leaving its file in place (another
    /// process now decides when it is deleted or reused); False if unknown.
    fn forget(&self, name: &str) -> bool {
        let forgot = self.inner.forget(name);
        release_entry(self.id(), name);
        forgot
    }

    /// Forget an entry and delete its file (a file already gone is fine).
    /// Returns `(memory, disk)` that were accounted, or None if unknown.
    fn delete(&self, py: Python<'_>, name: &str) -> PyResult<Option<(u64, u64)>> {
        let store = Arc::clone(&self.inner);
        // A paced delete does at most ~10 ms of I/O in a burst, then none:
        // keeping the GIL spares a batch of deletes one wait for it each. An
        // unlink frees the file's pages: short for a small file on a tmpfs.
        let Some(taken) = store.take_entry(name) else {
            return Ok(None);
        };
        release_entry(self.id(), name);
        let keep_gil = store.defers_deletes() || self.keeps_gil(taken.sizes.disk);
        run(py, keep_gil, || store.delete_taken(&taken))
            .map_err(|e| io_error_at(e, &self.inner.path_of(name)))?;
        Ok(Some((taken.sizes.memory, taken.sizes.disk)))
    }

    /// `(memory, disk)` accounted for one entry; KeyError if unknown.
    fn sizes(&self, name: &str) -> PyResult<(u64, u64)> {
        self.inner
            .sizes(name)
            .map(|s| (s.memory, s.disk))
            .ok_or_else(|| PyKeyError::new_err(name.to_owned()))
    }

    /// Correct the link counts of shared entries (one lstat each, the GIL
    /// released); returns how many changed.
    fn refresh_links(&self, py: Python<'_>) -> usize {
        let store = Arc::clone(&self.inner);
        py.detach(|| store.refresh_links())
    }

    /// `refresh_links`, returning `(name, links now)` of each entry whose
    /// count changed.
    fn refresh_links_changed(&self, py: Python<'_>) -> Vec<(String, u64)> {
        let store = Arc::clone(&self.inner);
        py.detach(|| store.refresh_links_changed())
    }

    /// Number of shared entries (what `refresh_links` stats).
    fn shared_len(&self) -> usize {
        self.inner.shared_len()
    }

    /// `(memory, disk)` summed over all entries, the disk size of a shared
    /// file divided by its last known link count. O(1).
    fn total(&self) -> (u64, u64) {
        let t = self.inner.total();
        (t.memory, t.disk)
    }

    fn path(&self, name: &str) -> std::ffi::OsString {
        self.inner.path_of(name).into_os_string()
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

/// Wait until every file that stores opened with `defer_deletes` were asked
/// to delete before this call is gone (the GIL released meanwhile).
#[pyfunction]
pub fn flush_deletes(py: Python<'_>) {
    py.detach(dask_shm_core::unlinker::flush);
}
