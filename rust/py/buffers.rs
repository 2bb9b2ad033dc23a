//! Borrowing raw bytes out of Python buffer objects, and exporting a memory
//! mapping as a Python buffer.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::mem::ManuallyDrop;
use std::os::unix::fs::MetadataExt;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use dask_shm_core::strided::c_order_runs;
use dask_shm_core::unlinker;
use memmap2::MmapMut;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// A contiguous byte view of a Python object, held for as long as this value
/// lives. Released on drop, which must happen with the GIL held (it always
/// does: these values live on the stack of a `#[pymethods]` function).
pub struct HeldBuffer {
    view: ffi::Py_buffer,
    /// Keeps a converted object (e.g. `bytes(x)` of a non-contiguous view) alive.
    _owner: Option<Py<PyAny>>,
}

impl HeldBuffer {
    /// The bytes of `bytes(obj)`, held with the copy; `first` (why `obj`
    /// gave no contiguous buffer) if it cannot be copied either.
    fn copied(obj: &Bound<'_, PyAny>, first: PyErr) -> PyResult<HeldBuffer> {
        let copied = match obj.py().get_type::<pyo3::types::PyBytes>().call1((obj,)) {
            Ok(c) => c,
            Err(_) => return Err(first),
        };
        let mut held = Self::simple(&copied)?;
        held._owner = Some(copied.unbind());
        Ok(held)
    }

    fn simple(obj: &Bound<'_, PyAny>) -> PyResult<HeldBuffer> {
        let mut view = std::mem::MaybeUninit::<ffi::Py_buffer>::uninit();
        // SAFETY: PyObject_GetBuffer fills `view` on success (return 0).
        let rc =
            unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_SIMPLE) };
        if rc != 0 {
            return Err(PyErr::take(obj.py())
                .unwrap_or_else(|| PyBufferError::new_err("object does not export a buffer")));
        }
        Ok(HeldBuffer {
            // SAFETY: initialised by the successful call above.
            view: unsafe { view.assume_init() },
            _owner: None,
        })
    }

    /// Address and length, to hand to code running without the GIL.
    pub fn raw(&self) -> (usize, usize) {
        (self.view.buf as usize, self.view.len as usize)
    }
}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        // SAFETY: the view was obtained by PyObject_GetBuffer and is released once.
        unsafe { ffi::PyBuffer_Release(&mut self.view) }
    }
}

/// Runs of a strided buffer shorter than this are copied together rather
/// than written as pieces of their own (a vectored write of many tiny pieces
/// costs more than the copy it saves).
const MIN_PIECE: usize = 4096;
/// At most this many pieces per frame; a buffer of more runs is copied.
const MAX_PIECES: usize = 1 << 16;

/// The bytes of a Python buffer object in C order, borrowed as the
/// contiguous pieces they are made of, for as long as this value lives: one
/// piece for a contiguous buffer; for a strided one whose rows are
/// contiguous (numpy's `a[1:, 1:]`) one piece per run
/// (`strided::c_order_runs`), with no copy. Any other buffer is copied once
/// with `bytes(obj)`.
pub struct HeldPieces {
    /// Keeps the borrowed view (and any copy) alive for `pieces`.
    _held: HeldBuffer,
    pieces: Vec<(usize, usize)>,
}

impl HeldPieces {
    pub fn get(obj: &Bound<'_, PyAny>) -> PyResult<HeldPieces> {
        let held = match HeldBuffer::simple(obj) {
            Ok(held) => held,
            Err(first) => match Self::strided(obj) {
                Some(gathered) => return Ok(gathered),
                None => HeldBuffer::copied(obj, first)?,
            },
        };
        let pieces = vec![held.raw()];
        Ok(HeldPieces {
            _held: held,
            pieces,
        })
    }

    fn strided(obj: &Bound<'_, PyAny>) -> Option<HeldPieces> {
        let mut view = std::mem::MaybeUninit::<ffi::Py_buffer>::uninit();
        // SAFETY: PyObject_GetBuffer fills `view` on success (return 0).
        let rc =
            unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_STRIDES) };
        if rc != 0 {
            drop(PyErr::take(obj.py()));
            return None;
        }
        let held = HeldBuffer {
            // SAFETY: initialised by the successful call above.
            view: unsafe { view.assume_init() },
            _owner: None,
        };
        let view = &held.view;
        let ndim = usize::try_from(view.ndim).ok()?;
        if view.shape.is_null() || view.strides.is_null() || !view.suboffsets.is_null() {
            return None;
        }
        // SAFETY: with PyBUF_STRIDES, shape and strides hold ndim entries each.
        let (shape, strides) = unsafe {
            (
                std::slice::from_raw_parts(view.shape, ndim),
                std::slice::from_raw_parts(view.strides, ndim),
            )
        };
        let shape: Vec<usize> = shape
            .iter()
            .map(|&n| usize::try_from(n).ok())
            .collect::<Option<_>>()?;
        let itemsize = usize::try_from(view.itemsize).ok()?;
        let runs = c_order_runs(itemsize, &shape, strides, MIN_PIECE, MAX_PIECES)?;
        let base = view.buf as isize;
        let pieces = runs
            .into_iter()
            .map(|(offset, len)| ((base + offset) as usize, len))
            .collect();
        Some(HeldPieces {
            _held: held,
            pieces,
        })
    }

    /// Address and length of each piece, to hand to code running without the GIL.
    pub fn raw(&self) -> &[(usize, usize)] {
        &self.pieces
    }
}

/// Rebuild byte slices from addresses taken by [`HeldBuffer::raw`].
///
/// # Safety
/// Every (address, length) pair must come from a `HeldBuffer` that is still
/// alive for the lifetime `'a`.
pub unsafe fn slices_from_raw<'a>(raw: &[(usize, usize)]) -> Vec<&'a [u8]> {
    raw.iter()
        .map(|&(addr, len)| {
            if len == 0 {
                &[][..]
            } else {
                std::slice::from_raw_parts(addr as *const u8, len)
            }
        })
        .collect()
}

/// Fill `view` as a writable, 1-dimensional, contiguous byte buffer of `len`
/// bytes at `buf`, owned by `owner` (which the view keeps alive).
///
/// # Safety
/// `view` must be a valid, non-null `Py_buffer` to fill, and `buf..buf+len`
/// must stay valid and writable for as long as `owner` is alive.
pub unsafe fn export_bytes(
    view: *mut ffi::Py_buffer,
    owner: Bound<'_, PyAny>,
    buf: *mut std::ffi::c_void,
    len: usize,
    flags: c_int,
) {
    (*view).obj = owner.into_ptr();
    (*view).buf = buf;
    (*view).len = len as ffi::Py_ssize_t;
    (*view).readonly = 0;
    (*view).itemsize = 1;
    (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
        c"B".as_ptr() as *mut _
    } else {
        ptr::null_mut()
    };
    (*view).ndim = 1;
    (*view).shape = if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
        &mut (*view).len
    } else {
        ptr::null_mut()
    };
    (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
        &mut (*view).itemsize
    } else {
        ptr::null_mut()
    };
    (*view).suboffsets = ptr::null_mut();
    (*view).internal = ptr::null_mut();
}

/// A private, writable memory mapping of a spill file, exported through the
/// buffer protocol. Writes go to private copy-on-write pages and never reach
/// the file, so a task that modifies an array deserialized from it cannot
/// change what anyone else reads. Weak-referenceable: a receiver follows
/// the life of the mapping when the value over it cannot be followed (a dict
/// or tuple of arrays).
#[pyclass(module = "dask_shm._core", frozen, weakref)]
pub struct MappedFile {
    /// Taken out only by `drop`.
    map: ManuallyDrop<MmapMut>,
    /// Unmap on `unlinker`'s thread when large (see `drop`): for mappings of
    /// a store that never reuses its files (shared mode's tiers); a store
    /// that recycles needs the mapping gone before it may reuse the file.
    unmap_off_thread: bool,
    path: String,
    /// `(device, inode)` of the file when it was mapped, if it could be seen.
    file_id: Option<FileId>,
    /// The file is on a RAM-backed file system.
    ram: bool,
    /// Lives as long as the mapping: what `watch_mappings` holds weakly.
    _token: Arc<()>,
}

/// `(device, inode)` of a file.
type FileId = (u64, u64);

/// Number of `MappedFile`s alive in this process (each is one kernel mapping,
/// counted against vm.max_map_count).
static LIVE_MAPPINGS: AtomicUsize = AtomicUsize::new(0);

/// What this process maps of spill files, and which of those files a store
/// of this process still holds: `/proc/self/maps` for the spill files, in
/// O(1) instead of O(mappings), and the split of their pages that a memory
/// monitor needs (`mapping_memory`).
static MAPPINGS: Mutex<Option<Mappings>> = Mutex::new(None);

#[derive(Default)]
struct Mappings {
    files: HashMap<FileId, FileMappings>,
    /// `(store id, entry name)` -> the file a mapping made through that
    /// entry mapped: the entries known to hold a mapped file.
    entries: HashMap<(usize, String), FileId>,
    /// Bytes of every live mapping of a RAM-backed file, until it is
    /// unmapped (whole pages): what may show as the process's `RssShmem`.
    mapped: usize,
    /// Over the files no store entry of this process holds: the longest live
    /// mapping of each (whole pages). Those files stay in RAM only because
    /// this process maps them, and nobody's share counts them.
    kept: usize,
    /// Start -> (file, length) of the born-shared blocks whose files were
    /// given to a store (`track_block`): the arena's mappings, counted here
    /// like a `MappedFile` until the arena unmaps them.
    blocks: HashMap<usize, (Option<FileId>, usize)>,
}

#[derive(Default)]
struct FileMappings {
    /// `(start, length)` of each live mapping of the file.
    ranges: Vec<(usize, usize)>,
    /// Store entries of this process that hold the file.
    holders: usize,
    /// The file is on a RAM-backed file system (else its pages are page
    /// cache, which the kernel may drop: never kept).
    ram: bool,
}

impl FileMappings {
    /// What the file adds to `Mappings::kept`.
    fn kept(&self) -> usize {
        if self.holders > 0 || !self.ram {
            return 0;
        }
        self.ranges
            .iter()
            .map(|&(_, len)| whole_pages(len))
            .max()
            .unwrap_or(0)
    }
}

fn whole_pages(len: usize) -> usize {
    let page = dask_shm_core::fs::page_size();
    len.div_ceil(page) * page
}

impl Mappings {
    /// Apply `change` to the record of file `id`, keeping `kept` current
    /// and dropping a record left empty.
    fn change(&mut self, id: FileId, change: impl FnOnce(&mut FileMappings)) {
        let file = self.files.entry(id).or_default();
        let before = file.kept();
        change(file);
        let after = file.kept();
        self.kept = self.kept - before + after;
        if file.ranges.is_empty() && file.holders == 0 {
            self.files.remove(&id);
        }
    }

    /// Entry `key` holds file `id` (from now, if it did not already).
    fn hold(&mut self, key: (usize, String), id: FileId) {
        match self.entries.insert(key, id) {
            Some(old) if old == id => {}
            old => {
                self.change(id, |f| f.holders += 1);
                if let Some(old) = old {
                    self.change(old, |f| f.holders -= 1);
                }
            }
        }
    }

    fn release(&mut self, key: &(usize, String)) {
        if let Some(id) = self.entries.remove(key) {
            self.change(id, |f| f.holders -= 1);
        }
    }
}

fn mappings() -> MutexGuard<'static, Option<Mappings>> {
    // Each update is a few operations on the maps; poisoning cannot leave them torn.
    MAPPINGS.lock().unwrap_or_else(|p| p.into_inner())
}

fn with_mappings<T>(f: impl FnOnce(&mut Mappings) -> T) -> T {
    f(mappings().get_or_insert_with(Mappings::default))
}

thread_local! {
    /// While `watch_mappings` runs a call on this thread: the tokens of the
    /// mappings made meanwhile on this thread.
    static WATCHED: RefCell<Option<Vec<Weak<()>>>> = const { RefCell::new(None) };
}

/// Which store entry a mapping is made through, for `MappedFile::of_entry`:
/// the store's identity (its address while it lives), the entry's name, and
/// a check, run under the mappings' lock, that the entry still exists.
pub struct EntryOfStore<'a> {
    pub store: usize,
    pub name: &'a str,
    pub exists: &'a dyn Fn() -> bool,
}

/// The entry `name` of store `store` no longer exists (deleted, forgotten,
/// moved to another store): a file mapped through it no longer counts as
/// held by it.
pub fn release_entry(store: usize, name: &str) {
    if let Some(m) = mappings().as_mut() {
        m.release(&(store, name.to_owned()));
    }
}

/// Store `store` is gone: none of its entries holds a file any more.
pub fn release_store(store: usize) {
    if let Some(m) = mappings().as_mut() {
        let keys: Vec<_> = m.entries.keys().filter(|k| k.0 == store).cloned().collect();
        for key in keys {
            m.release(&key);
        }
    }
}

/// The born-shared block mapped at `start` (`len` bytes) maps the file at
/// `path`, which `entry` now holds: counted as a mapping of it (`mapped`,
/// and `kept` once no entry holds it) until `untrack_block(start)`.
pub fn track_block(start: usize, len: usize, path: &std::path::Path, entry: EntryOfStore<'_>) {
    let file_id = std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()));
    with_mappings(|m| {
        if let Some((old_id, old_len)) = m.blocks.remove(&start) {
            forget_range(m, old_id, (start, old_len), true);
        }
        m.mapped += whole_pages(len);
        m.blocks.insert(start, (file_id, len));
        let Some(id) = file_id else { return };
        if (entry.exists)() {
            m.hold((entry.store, entry.name.to_owned()), id);
        }
        m.change(id, |f| {
            f.ram = true;
            f.ranges.push((start, len));
        });
    });
}

/// The block mapped at `start` is unmapped (a no-op for an untracked one).
pub fn untrack_block(start: usize) {
    if let Some(m) = mappings().as_mut() {
        if let Some((id, len)) = m.blocks.remove(&start) {
            forget_range(m, id, (start, len), true);
        }
    }
}

/// Take one live mapping `range` of file `id` (if known; of a RAM-backed
/// file if `ram`) out of the counts.
fn forget_range(m: &mut Mappings, id: Option<FileId>, range: (usize, usize), ram: bool) {
    if ram {
        m.mapped -= whole_pages(range.1);
    }
    if let Some(id) = id {
        // One of them: a new mapping of the file may already have been made
        // at the same address, between the unmap and now.
        m.change(id, |f| {
            if let Some(i) = f.ranges.iter().position(|&r| r == range) {
                f.ranges.swap_remove(i);
            }
        });
    }
}

impl MappedFile {
    /// Wrap a mapping of the file at `path` (just opened and mapped: its
    /// device and inode are read from that path now). With
    /// `unmap_off_thread`, a mapping of `unlinker::DEFER_FROM` bytes or more
    /// is unmapped on the unlinking thread once it dies.
    pub fn new(map: MmapMut, path: String, unmap_off_thread: bool) -> MappedFile {
        let ram = dask_shm_core::fs::is_ram_backed(std::path::Path::new(&path));
        Self::of_entry(map, path, ram, unmap_off_thread, None)
    }

    /// As `new`, for a mapping made through a store's entry, of a file on a
    /// RAM-backed file system if `ram`: its file counts as held (by `entry`)
    /// until `release_entry` or `release_store` says otherwise, unless the
    /// entry is already gone.
    pub fn of_entry(
        map: MmapMut,
        path: String,
        ram: bool,
        unmap_off_thread: bool,
        entry: Option<EntryOfStore<'_>>,
    ) -> MappedFile {
        LIVE_MAPPINGS.fetch_add(1, Ordering::Relaxed);
        let file_id = std::fs::symlink_metadata(&path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        let range = (map.as_ptr() as usize, map.len());
        with_mappings(|m| {
            if ram {
                m.mapped += whole_pages(range.1);
            }
            let Some(id) = file_id else { return };
            // Held before the range is added: never counted as kept meanwhile.
            if let Some(entry) = entry {
                if (entry.exists)() {
                    m.hold((entry.store, entry.name.to_owned()), id);
                }
            }
            m.change(id, |f| {
                f.ram = ram;
                f.ranges.push(range);
            });
        });
        let token = Arc::new(());
        WATCHED.with_borrow_mut(|watched| {
            if let Some(watched) = watched {
                watched.push(Arc::downgrade(&token));
            }
        });
        MappedFile {
            map: ManuallyDrop::new(map),
            unmap_off_thread,
            path,
            file_id,
            ram,
            _token: token,
        }
    }
}

/// A mapping on its way out: unmapped first, then taken out of `MAPPINGS`,
/// so that its pages never count as nobody's while they are still mapped.
struct Unmapping {
    map: Option<MmapMut>,
    file_id: Option<FileId>,
    ram: bool,
}

impl Drop for Unmapping {
    fn drop(&mut self) {
        let Some(map) = self.map.take() else { return };
        let range = (map.as_ptr() as usize, map.len());
        drop(map);
        if let Some(m) = mappings().as_mut() {
            forget_range(m, self.file_id, range, self.ram);
        }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        LIVE_MAPPINGS.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: `map` is taken once, here, and never used again.
        let map = unsafe { ManuallyDrop::take(&mut self.map) };
        let large = map.len() as u64 >= unlinker::DEFER_FROM;
        let unmapping = Unmapping {
            map: Some(map),
            file_id: self.file_id,
            ram: self.ram,
        };
        if self.unmap_off_thread && large {
            // Unmapping costs milliseconds, in the thread that drops the last
            // reference (often a worker's event loop, with the GIL held).
            unlinker::release_later(Box::new(unmapping));
        }
    }
}

/// `(mapped, kept)` bytes of this process's live spill-file mappings
/// (`MappedFile`s, whole pages) of files on RAM-backed file systems:
/// `mapped` of all of them, `kept` of the files that no store entry of this
/// process holds any more (counted once per file), which stay in RAM
/// because these mappings keep them.
#[pyfunction]
pub fn mapping_memory() -> (usize, usize) {
    mappings().as_ref().map_or((0, 0), |m| (m.mapped, m.kept))
}

/// `(start, end)` addresses of this process's live spill-file mappings
/// (`MappedFile`s) of the file `(device, inode)`, whole pages as the kernel
/// maps them; O(its mappings).
#[pyfunction]
pub fn mapped_ranges(device: u64, inode: u64) -> Vec<(usize, usize)> {
    mappings()
        .as_ref()
        .and_then(|m| m.files.get(&(device, inode)))
        .map(|file| {
            // The kernel maps whole pages: the last partial page is mapped too.
            file.ranges
                .iter()
                .map(|&(s, l)| (s, s + whole_pages(l)))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether any page of this process's spill-file mappings of the file at
/// `path` was written by this process (`/proc/self/pagemap`, see
/// `local_transport::pages_unmodified`): True too when that cannot be told,
/// False when the file is not mapped at all. The GIL is held throughout if
/// `keep_gil` (see `fs::run`).
#[pyfunction]
pub fn written_in_place(py: Python<'_>, path: std::path::PathBuf, keep_gil: bool) -> bool {
    crate::fs::run(py, keep_gil, || {
        let Ok(meta) = std::fs::metadata(&path) else {
            return true;
        };
        mapped_ranges(meta.dev(), meta.ino())
            .into_iter()
            .any(|(start, end)| {
                !matches!(
                    dask_shm_core::local_transport::pages_unmodified(start, end - start),
                    Ok(true)
                )
            })
    })
}

/// Number of spill-file mappings alive in this process.
#[pyfunction]
pub fn live_mappings() -> usize {
    LIVE_MAPPINGS.load(Ordering::Relaxed)
}

/// Call `read()` and return `(its value, kept)`: `kept` tells whether a
/// mapping that `read` made on this thread is still alive once it returned,
/// i.e. whether the value (or anything else) holds it. Mappings made or
/// dropped meanwhile by other threads, or by anything `read` frees (a garbage
/// collection), do not change the answer.
#[pyfunction]
pub fn watch_mappings<'py>(read: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, bool)> {
    let outer = WATCHED.replace(Some(Vec::new()));
    let result = read.call0();
    let made = WATCHED.replace(outer).unwrap_or_default();
    // Nested in another watched call: these mappings were made during it too.
    WATCHED.with_borrow_mut(|watched| {
        if let Some(watched) = watched {
            watched.extend(made.iter().cloned());
        }
    });
    let kept = made.iter().any(|token| token.strong_count() > 0);
    Ok((result?, kept))
}

#[pymethods]
impl MappedFile {
    fn __len__(&self) -> usize {
        self.map.len()
    }

    /// Path of the file this mapping was made from (it may since have been unlinked).
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    fn __repr__(&self) -> String {
        format!("<MappedFile {} ({} bytes)>", self.path, self.map.len())
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
        // The mapping is MAP_PRIVATE: exporting it writable is safe and lets
        // numpy deserialize without a defensive copy. The frozen pyclass never
        // moves or drops `map` while a view (which holds a reference) exists.
        let ptr = this.map.as_ptr() as *mut std::ffi::c_void;
        export_bytes(view, slf.clone().into_any(), ptr, this.map.len(), flags);
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use memmap2::MmapOptions;

    #[test]
    fn mapped_ranges_follow_live_mappings() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, vec![7u8; 3 * 4096 - 100]).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let id = (meta.dev(), meta.ino());
        let map = || {
            let file = std::fs::File::open(&path).unwrap();
            unsafe { MmapOptions::new().map_copy(&file).unwrap() }
        };
        let path_str = path.to_string_lossy().into_owned();
        let a = MappedFile::new(map(), path_str.clone(), false);
        let b = MappedFile::new(map(), path_str, false);
        let start = |m: &MappedFile| m.map.as_ptr() as usize;
        let mut ranges = mapped_ranges(id.0, id.1);
        ranges.sort();
        let mut want = vec![
            (start(&a), start(&a) + 3 * 4096),
            (start(&b), start(&b) + 3 * 4096),
        ];
        want.sort();
        assert_eq!(ranges, want);
        drop(a);
        assert_eq!(mapped_ranges(id.0, id.1).len(), 1);
        drop(b);
        assert!(mapped_ranges(id.0, id.1).is_empty());
        // Another file nobody maps. Not `id.1 + 1`: tests run in parallel and
        // another test's mapped file may well hold the next inode.
        let other = tmp.path().join("g");
        std::fs::write(&other, [7u8; 10]).unwrap();
        let other = std::fs::metadata(&other).unwrap();
        assert!(mapped_ranges(other.dev(), other.ino()).is_empty());
    }

    #[test]
    fn a_file_counts_as_kept_once_no_entry_holds_it() {
        // Store ids no real store has: other tests' mappings stay apart.
        const STORE: usize = usize::MAX - 7;
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, vec![7u8; 2 * 4096 + 1]).unwrap();
        let path_str = path.to_string_lossy().into_owned();
        let map = || {
            let file = std::fs::File::open(&path).unwrap();
            unsafe { MmapOptions::new().map_copy(&file).unwrap() }
        };
        let through = |exists: bool| {
            let yes = move || exists;
            let entry = EntryOfStore {
                store: STORE,
                name: "k#1",
                exists: &yes,
            };
            MappedFile::of_entry(map(), path_str.clone(), true, false, Some(entry))
        };
        let meta = std::fs::metadata(&path).unwrap();
        let id = (meta.dev(), meta.ino());
        let kept_of_file = || {
            mappings()
                .as_ref()
                .unwrap()
                .files
                .get(&id)
                .map(|f| f.kept())
        };
        let a = through(true);
        let b = through(true);
        assert_eq!(kept_of_file(), Some(0));
        release_entry(STORE, "k#1");
        // Once for the file, in whole pages, however many mappings it has.
        assert_eq!(kept_of_file(), Some(3 * 4096));
        drop(a);
        assert_eq!(kept_of_file(), Some(3 * 4096));
        drop(b);
        assert_eq!(kept_of_file(), None);
        // An entry already gone when the mapping is made holds nothing.
        let c = through(false);
        assert_eq!(kept_of_file(), Some(3 * 4096));
        drop(c);
        // A store that goes releases its entries.
        let d = through(true);
        release_store(STORE);
        assert_eq!(kept_of_file(), Some(3 * 4096));
        drop(d);
        assert_eq!(kept_of_file(), None);
    }
}
