//! Python face of [`dask_shm_core::born`]: the process-wide arena, numpy's data
//! memory handler (`PyDataMem_Handler`, numpy >= 1.22) that serves large
//! array allocations from it, and the look-ups the spill store uses.
//!
//! The handler callbacks are `extern "C"`, never touch Python and never
//! unwind. Allocations the arena refuses go to the handler that was current
//! when ours was first built (numpy's default one, normally), so small arrays
//! and fallbacks behave exactly as without us.

use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffers::{track_block, untrack_block, EntryOfStore};
use crate::store::FileStore;
use dask_shm_core::born::{default_cache, Arena, Realloc, Settings, DEFAULT_CACHE_DECAY};

/// The arena every born-shared allocation of this process comes from.
pub static ARENA: Arena = Arena::new();

type MallocFn = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
type CallocFn = unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void;
type ReallocFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize);

/// numpy's `PyDataMemAllocator` (ndarraytypes.h, version 1).
#[repr(C)]
#[derive(Clone, Copy)]
struct Allocator {
    ctx: *mut c_void,
    malloc: Option<MallocFn>,
    calloc: Option<CallocFn>,
    realloc: Option<ReallocFn>,
    free: Option<FreeFn>,
}

/// numpy's `PyDataMem_Handler`.
#[repr(C)]
struct Handler {
    name: [c_char; 127],
    version: u8,
    allocator: Allocator,
}

/// The allocator we fall back to, copied from the handler that was current
/// when ours was built (its capsule is kept alive forever).
struct Inner(Allocator);
// SAFETY: numpy's allocators are thread-safe C functions; ctx is theirs.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

struct Ours(&'static Handler);
// SAFETY: the handler is immutable after construction.
unsafe impl Send for Ours {}
unsafe impl Sync for Ours {}

static INNER: OnceLock<Inner> = OnceLock::new();
static HANDLER: OnceLock<Ours> = OnceLock::new();

/// Name numpy reports for our handler (`get_handler_name()`).
pub const HANDLER_NAME: &CStr = c"dask_shm_born_shared";
const CAPSULE_NAME: &CStr = c"mem_handler";

fn inner() -> &'static Allocator {
    &INNER.get().expect("handler built before use").0
}

unsafe extern "C" fn born_malloc(_ctx: *mut c_void, size: usize) -> *mut c_void {
    if let Some(addr) = ARENA.alloc(size) {
        return addr as *mut c_void;
    }
    let a = inner();
    match a.malloc {
        Some(f) => f(a.ctx, size),
        None => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn born_calloc(_ctx: *mut c_void, nelem: usize, elsize: usize) -> *mut c_void {
    // A fresh tmpfs file reads as zeros; a cached block is cleared.
    if let Some(size) = nelem.checked_mul(elsize) {
        if let Some(addr) = ARENA.alloc_zeroed(size) {
            return addr as *mut c_void;
        }
    }
    let a = inner();
    match a.calloc {
        Some(f) => f(a.ctx, nelem, elsize),
        None => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn born_realloc(_ctx: *mut c_void, ptr: *mut c_void, size: usize) -> *mut c_void {
    let a = inner();
    match ARENA.realloc(ptr as usize, size) {
        Realloc::Moved(to) => to as *mut c_void,
        Realloc::NotOurs => match a.realloc {
            Some(f) => f(a.ctx, ptr, size),
            None => std::ptr::null_mut(),
        },
        Realloc::CopyOut { copy } => {
            let to = match ARENA.alloc(size) {
                Some(addr) => addr as *mut c_void,
                None => match a.malloc {
                    Some(f) => f(a.ctx, size),
                    None => std::ptr::null_mut(),
                },
            };
            if to.is_null() {
                return to; // realloc failure leaves the old block intact
            }
            std::ptr::copy_nonoverlapping(ptr as *const u8, to as *mut u8, copy);
            ARENA.free(ptr as usize);
            to
        }
    }
}

unsafe extern "C" fn born_free(_ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    if ptr.is_null() || ARENA.free(ptr as usize) {
        return;
    }
    let a = inner();
    if let Some(f) = a.free {
        f(a.ctx, ptr, size);
    }
}

/// numpy's C-API table (`_ARRAY_API`), from the multiarray module.
fn array_api(py: Python<'_>) -> PyResult<*const *const c_void> {
    let module = py
        .import("numpy._core._multiarray_umath")
        .or_else(|_| py.import("numpy.core.multiarray"))?;
    let capsule = module.getattr("_ARRAY_API")?;
    // SAFETY: numpy publishes the table as an unnamed capsule.
    let table = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) };
    if table.is_null() {
        return Err(PyErr::take(py)
            .unwrap_or_else(|| PyRuntimeError::new_err("numpy's _ARRAY_API is empty")));
    }
    Ok(table as *const *const c_void)
}

// Slots of PyDataMem_SetHandler / PyDataMem_GetHandler in numpy's C-API table
// (numpy_api.py: 304 and 305, since numpy 1.22).
const SET_HANDLER: usize = 304;
const GET_HANDLER: usize = 305;

fn current_handler(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let table = array_api(py)?;
    // SAFETY: slot 305 is `PyObject *PyDataMem_GetHandler(void)` (new reference).
    let obj = unsafe {
        let get: unsafe extern "C" fn() -> *mut ffi::PyObject =
            std::mem::transmute(*table.add(GET_HANDLER));
        Bound::from_owned_ptr_or_err(py, get())?
    };
    // SAFETY: checking a capsule's name has no preconditions.
    if unsafe { ffi::PyCapsule_IsValid(obj.as_ptr(), CAPSULE_NAME.as_ptr()) } != 1 {
        return Err(PyRuntimeError::new_err(
            "numpy's PyDataMem_GetHandler did not return a mem_handler capsule \
             (numpy older than 1.22?)",
        ));
    }
    Ok(obj)
}

fn our_handler(py: Python<'_>) -> PyResult<&'static Handler> {
    if let Some(h) = HANDLER.get() {
        return Ok(h.0);
    }
    let current = current_handler(py)?;
    // SAFETY: a valid mem_handler capsule points to a PyDataMem_Handler.
    let found = unsafe {
        ffi::PyCapsule_GetPointer(current.as_ptr(), CAPSULE_NAME.as_ptr()) as *const Handler
    };
    if found.is_null() {
        return Err(PyErr::take(py).unwrap_or_else(|| PyRuntimeError::new_err("empty handler")));
    }
    // SAFETY: as above; copied while the capsule is alive, then kept alive.
    let (version, allocator, name) = unsafe {
        (
            (*found).version,
            (*found).allocator,
            CStr::from_ptr((*found).name.as_ptr()),
        )
    };
    if name == HANDLER_NAME {
        return Err(PyRuntimeError::new_err(
            "the born-shared handler is current but was not built here",
        ));
    }
    if version != 1 {
        return Err(PyRuntimeError::new_err(format!(
            "unsupported numpy memory handler version {version}"
        )));
    }
    // Keep the fallback handler's capsule (and its ctx) alive for ever.
    std::mem::forget(current.unbind());
    let _ = INNER.set(Inner(allocator));
    let mut name = [0 as c_char; 127];
    for (dst, &src) in name.iter_mut().zip(HANDLER_NAME.to_bytes()) {
        *dst = src as c_char;
    }
    let handler: &'static Handler = Box::leak(Box::new(Handler {
        name,
        version: 1,
        allocator: Allocator {
            ctx: std::ptr::null_mut(),
            malloc: Some(born_malloc),
            calloc: Some(born_calloc),
            realloc: Some(born_realloc),
            free: Some(born_free),
        },
    }));
    Ok(HANDLER.get_or_init(|| Ours(handler)).0)
}

/// Configure the process-wide arena: blocks of at least ``threshold`` bytes
/// go to files in ``directory`` (an existing 0700 directory on a tmpfs), up to
/// ``budget`` mapped bytes and ``max_blocks`` mappings, keeping up to
/// ``cache`` bytes of freed blocks for reuse (None: a quarter of the budget,
/// at most 256 MiB) until unused for ``cache_decay`` seconds (None:
/// ``BORN_CACHE_DECAY``);
/// ``directory=None`` turns new born-shared allocations off (live ones stay
/// valid) and releases the cache.
#[pyfunction]
#[pyo3(signature = (directory, threshold, budget, max_blocks, reserve=true, cache=None, cache_decay=None))]
#[allow(clippy::too_many_arguments)]
pub fn born_configure(
    py: Python<'_>,
    directory: Option<PathBuf>,
    threshold: usize,
    budget: usize,
    max_blocks: usize,
    reserve: bool,
    cache: Option<usize>,
    cache_decay: Option<f64>,
) -> PyResult<()> {
    let cache_decay = match cache_decay {
        None => DEFAULT_CACHE_DECAY,
        Some(s) => Duration::try_from_secs_f64(s)
            .map_err(|_| PyValueError::new_err(format!("cache_decay must be >= 0 s, got {s}")))?,
    };
    if let Some(d) = &directory {
        if !d.is_dir() {
            return Err(PyValueError::new_err(format!(
                "born-shared directory {} does not exist",
                d.display()
            )));
        }
    }
    let settings = Settings {
        directory,
        threshold,
        budget,
        max_blocks,
        reserve,
        cache: cache.unwrap_or_else(|| default_cache(budget)),
        cache_decay,
    };
    // Evicting cached blocks unmaps and unlinks files: no GIL needed.
    py.detach(|| ARENA.configure(&settings));
    Ok(())
}

/// Unmap and unlink every cached (freed, kept for reuse) block; returns the
/// bytes released.
#[pyfunction]
pub fn born_release_cache(py: Python<'_>) -> usize {
    py.detach(|| ARENA.release_cache())
}

/// Unmap and unlink the cached blocks that waited unused longer than the
/// cache's decay; returns the bytes released.
#[pyfunction]
pub fn born_release_expired(py: Python<'_>) -> usize {
    py.detach(|| ARENA.release_expired())
}

/// A ``mem_handler`` capsule for numpy's data-memory API that serves large
/// allocations from the arena and everything else from the handler current
/// at the first call (normally numpy's default).
#[pyfunction]
pub fn born_handler(py: Python<'_>) -> PyResult<Py<PyAny>> {
    let handler = our_handler(py)?;
    // SAFETY: the handler is leaked ('static); the capsule has no destructor.
    unsafe {
        let cap = ffi::PyCapsule_New(
            handler as *const Handler as *mut c_void,
            CAPSULE_NAME.as_ptr(),
            None,
        );
        Ok(Bound::from_owned_ptr_or_err(py, cap)?.unbind())
    }
}

/// ``PyDataMem_SetHandler``: make ``handler`` numpy's allocation policy in the
/// current context (``None``: numpy's default) and return the previous one.
#[pyfunction]
#[pyo3(signature = (handler))]
pub fn set_numpy_handler(py: Python<'_>, handler: Option<Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
    let arg = match &handler {
        Some(h) => {
            // SAFETY: checking a capsule's name has no preconditions.
            if unsafe { ffi::PyCapsule_IsValid(h.as_ptr(), CAPSULE_NAME.as_ptr()) } != 1 {
                return Err(PyValueError::new_err("not a mem_handler capsule"));
            }
            h.as_ptr()
        }
        None => std::ptr::null_mut(),
    };
    current_handler(py)?; // checks numpy has the API
    let table = array_api(py)?;
    // SAFETY: slot 304 is `PyObject *PyDataMem_SetHandler(PyObject *)`,
    // returning the previous handler (new reference) or NULL with an error.
    unsafe {
        let set: unsafe extern "C" fn(*mut ffi::PyObject) -> *mut ffi::PyObject =
            std::mem::transmute(*table.add(SET_HANDLER));
        Ok(Bound::from_owned_ptr_or_err(py, set(arg))?.unbind())
    }
}

/// The born-shared block holding ``address``: ``(path, start, length,
/// sealed, owned)``, or None if the address is not in one. ``owned`` is
/// false once the file was handed over (:func:`born_disown`).
#[pyfunction]
pub fn born_block(address: usize) -> Option<(String, usize, usize, bool, bool)> {
    ARENA.lookup(address).map(|b| {
        (
            b.path.to_string_lossy().into_owned(),
            b.start,
            b.len,
            b.sealed,
            b.owned,
        )
    })
}

/// Seal the block that starts at ``address`` and is exactly ``length`` bytes:
/// write ``header`` (at most one page) in front of its bytes in its file and
/// make the owner's mapping private copy-on-write, so the file never changes
/// again. Returns the file's path. Raises ``LookupError`` if no block is
/// exactly there, ``FileExistsError`` if it was sealed with another header,
/// ``ValueError`` if the header is too long, ``OSError`` otherwise.
#[pyfunction]
pub fn born_seal(py: Python<'_>, address: usize, length: usize, header: &[u8]) -> PyResult<String> {
    let header = header.to_vec();
    py.detach(|| ARENA.seal(address, length, &header))
        .map(|p| p.to_string_lossy().into_owned())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound if e.raw_os_error().is_none() => {
                pyo3::exceptions::PyLookupError::new_err(format!(
                    "no born-shared block of {length} bytes at {address:#x}"
                ))
            }
            std::io::ErrorKind::InvalidInput if e.raw_os_error().is_none() => {
                PyValueError::new_err("header longer than born_header_size()")
            }
            std::io::ErrorKind::AlreadyExists if e.raw_os_error().is_none() => {
                pyo3::exceptions::PyFileExistsError::new_err(
                    "born-shared block already sealed with another header",
                )
            }
            _ => PyOSError::new_err(e.to_string()),
        })
}

/// Give the sealed block starting at ``address`` over to the file at
/// ``new_path`` (a link the caller made, e.g. in a spill store): the
/// block's own name is unlinked, look-ups report ``new_path`` and freeing the
/// array only unmaps it. Raises ``LookupError`` if no sealed block starts there.
///
/// With ``store`` and ``entry`` (the store's entry that ``new_path`` is),
/// the block counts as a mapping of that entry's file in
/// ``mapping_memory()`` until the array is freed: once the entry is gone
/// while the array lives, the file is one only this mapping keeps.
#[pyfunction]
#[pyo3(signature = (address, new_path, store=None, entry=None))]
pub fn born_disown(
    address: usize,
    new_path: PathBuf,
    store: Option<&FileStore>,
    entry: Option<&str>,
) -> PyResult<()> {
    ARENA.disown(address, &new_path).map_err(|_| {
        pyo3::exceptions::PyLookupError::new_err(format!(
            "no sealed born-shared block at {address:#x}"
        ))
    })?;
    if let (Some(store), Some(name), Some(block)) = (store, entry, ARENA.lookup(address)) {
        ARENA.on_disowned_unmap(untrack_block);
        let exists = || store.inner.sizes(name).is_some();
        let entry = EntryOfStore {
            store: store.id(),
            name,
            exists: &exists,
        };
        track_block(block.start, block.map_len, &new_path, entry);
    }
    Ok(())
}

/// Bytes in front of a block's data in its file (the room for a header).
#[pyfunction]
pub fn born_header_size() -> usize {
    ARENA.header_size()
}

/// Arena counters: blocks, bytes, owned_bytes, cached_blocks, cached_bytes,
/// allocated, reused, freed, evicted, sealed, refused_budget, refused_blocks,
/// refused_error, threshold, directory.
#[pyfunction]
pub fn born_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = ARENA.stats();
    let d = PyDict::new(py);
    d.set_item("blocks", s.blocks)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("owned_bytes", s.owned_bytes)?;
    d.set_item("cached_blocks", s.cached_blocks)?;
    d.set_item("cached_bytes", s.cached_bytes)?;
    d.set_item("allocated", s.allocated)?;
    d.set_item("reused", s.reused)?;
    d.set_item("freed", s.freed)?;
    d.set_item("evicted", s.evicted)?;
    d.set_item("sealed", s.sealed)?;
    d.set_item("refused_budget", s.refused_budget)?;
    d.set_item("refused_blocks", s.refused_blocks)?;
    d.set_item("refused_error", s.refused_error)?;
    let threshold = ARENA.threshold();
    d.set_item(
        "threshold",
        if threshold == usize::MAX {
            None
        } else {
            Some(threshold)
        },
    )?;
    d.set_item(
        "directory",
        ARENA.directory().map(|p| p.to_string_lossy().into_owned()),
    )?;
    Ok(d)
}
