//! Arrays born shared: large allocations served from mappings of files on a
//! tmpfs, so that the bytes of a freshly computed array already live in a
//! file that a same-host peer can hard-link and that spilling need not copy.
//!
//! One [`Arena`] hands out *blocks*. A block of `len` bytes is a file
//! `<directory>/<n>` created `0600` with `O_EXCL|O_NOFOLLOW`, sized
//! `header + len` bytes, whose bytes from offset `header` (one page) are
//! mapped `MAP_SHARED` read-write; the address of that mapping is what the
//! allocator returns. The first page of the file is left for a spill-file
//! header (see `dask_shm.shared.born`), so a block can become a complete
//! spill file by writing that header only.
//!
//! Lifecycle:
//! - [`Arena::alloc`] refuses (returns `None`, the caller uses ordinary
//!   memory) below the threshold, over the byte budget, over the block
//!   budget (each block is one kernel mapping, counted against
//!   `vm.max_map_count`), or when any system call fails (e.g. tmpfs full).
//! - [`Arena::free`] unmaps and unlinks the block's own name. A file that
//!   something else linked meanwhile (a spill store, a peer) lives on.
//! - Except that a freed block nobody else can see (never sealed, never
//!   disowned, its file linked only by the arena) is kept, mapping and file
//!   intact, in a bounded *free cache*, the way a malloc arena keeps freed
//!   chunks: the next [`Arena::alloc`] of a length within a factor of two
//!   ([`FIT_FACTOR`]) takes it back, its file and mapping shrunk or grown
//!   to fit, so a steady workload creates no files, allocates no tmpfs
//!   pages and takes no page faults for the pages in common (on a 4 KiB-page
//!   tmpfs, faulting fresh pages in costs ~3x what anonymous memory does,
//!   and unlinking frees them all again). Cached blocks still count against
//!   the byte and block budgets (and in [`Stats`]); they are evicted
//!   (unmapped and unlinked), oldest first, beyond the cache's cap, beyond
//!   the bytes of the live blocks (all but the newest: once a graph's
//!   arrays are released, nothing is left for the cache to serve), when a
//!   fresh or grown allocation needs their budget, once they waited unused
//!   for the cache's decay (1 s by default: a length nobody asks for again
//!   does not hold its pages until the cap pushes it out), when the
//!   settings shrink or change directory, and on stop.
//! - [`Arena::seal`] writes the header and replaces the block's mapping in
//!   place by a `MAP_PRIVATE` mapping of the same file at the same address:
//!   later writes by the owner are copy-on-write and never reach the file,
//!   which is immutable from then on.
//!
//! Nothing here touches Python: the numpy allocator callbacks
//! (the binding's `born` module) call these methods without the GIL.
//!
//! A child process forked from the arena's owner inherits its state and its
//! `MAP_SHARED` mappings, whose pages are still the parent's: in the child
//! the arena serves nothing, never caches, reuses, seals, hands over or
//! unlinks (freeing only unmaps the child's view), until the child
//! configures it, which first disowns everything inherited.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// The system page size (the offset of a block's bytes inside its file).
pub use crate::fs::page_size;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// One live block.
#[derive(Debug, Clone)]
struct Block {
    path: PathBuf,
    /// Bytes asked for (the file holds `header + len` bytes).
    len: usize,
    /// Length of the mapping (`len` rounded up to pages).
    map_len: usize,
    /// The header written by [`Arena::seal`]; `Some` once sealed.
    sealed: Option<Vec<u8>>,
    /// False once [`Arena::disown`] gave the file to someone else: `free`
    /// then leaves it alone.
    owned: bool,
}

/// A freed block kept for reuse: its file (still only the arena's, sized
/// `header + len`) and its writable shared mapping are intact.
#[derive(Debug)]
struct Cached {
    addr: usize,
    path: PathBuf,
    len: usize,
    map_len: usize,
    /// When it was freed.
    since: Instant,
}

/// How far a cached block's mapping length may be from an allocation's for
/// the block to serve it, shrunk or grown (the pages in common are reused;
/// a shrunk block's tail is released). Within a factor of two, shrinking
/// releases at most half of the block's pages, which a later allocation of
/// the block's own length would have reused, and growing reuses at least
/// half of the pages the allocation needs.
pub const FIT_FACTOR: usize = 2;

/// The largest free cache [`default_cache`] allows.
pub const DEFAULT_CACHE_MAX: usize = 256 << 20;

/// How long a freed block waits in the free cache for an allocation of its
/// length by default. A steady workload asks for the same lengths again
/// within milliseconds; a length nobody asks for again would otherwise hold
/// its pages until the cap or the budget pushed it out (as a malloc arena's
/// decay returns unused dirty pages, e.g. jemalloc's `dirty_decay_ms`).
pub const DEFAULT_CACHE_DECAY: Duration = Duration::from_secs(1);

/// Default cap of the free cache for a byte budget: a quarter of the budget,
/// at most [`DEFAULT_CACHE_MAX`].
pub fn default_cache(budget: usize) -> usize {
    (budget / 4).min(DEFAULT_CACHE_MAX)
}

/// What [`Arena::lookup`] tells about a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    pub path: PathBuf,
    pub start: usize,
    pub len: usize,
    /// Bytes mapped (`len` in whole pages).
    pub map_len: usize,
    pub sealed: bool,
    pub owned: bool,
}

/// Counters, for tests, metrics and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub blocks: usize,
    pub bytes: usize,
    /// Mapped bytes of blocks whose file is still only the arena's.
    pub owned_bytes: usize,
    pub allocated: u64,
    pub freed: u64,
    pub sealed: u64,
    pub refused_budget: u64,
    pub refused_blocks: u64,
    pub refused_error: u64,
    /// Freed blocks kept for reuse, and their mapped bytes (also the
    /// arena's own memory: they count against the budgets).
    pub cached_blocks: usize,
    pub cached_bytes: usize,
    /// Allocations served by a cached block (included in `allocated`).
    pub reused: u64,
    /// Cached blocks unmapped and unlinked.
    pub evicted: u64,
}

#[derive(Debug)]
struct State {
    directory: Option<PathBuf>,
    blocks: BTreeMap<usize, Block>,
    /// Mapped bytes of the blocks whose file is still ours, cached blocks
    /// and reservations in progress: what the byte budget limits.
    bytes: usize,
    /// Blocks, cached blocks and reservations in progress.
    count: usize,
    /// Mapped bytes of the live blocks (owned or not): the arrays in use.
    live_bytes: usize,
    /// The free cache, oldest first (keyed by a sequence number).
    cache: BTreeMap<u64, Cached>,
    /// `(map_len, seq)` of every cached block: finds the newest of a length.
    cache_index: BTreeSet<(usize, u64)>,
    cache_bytes: usize,
    cache_seq: u64,
}

impl State {
    /// Take the cached block that best fits a mapping of `map_len` bytes:
    /// the newest of that length, else the newest of the shortest longer
    /// length (to be shrunk), else the newest of the longest shorter one (to
    /// be grown), within [`FIT_FACTOR`] of `map_len` either way. Its bytes
    /// and mapping stay counted: they pass to the new block, whose
    /// reservation the caller adjusts.
    fn take_cached(&mut self, map_len: usize) -> Option<Cached> {
        let fit = |index: &BTreeSet<(usize, u64)>| {
            if let Some(&exact) = index.range((map_len, 0)..=(map_len, u64::MAX)).next_back() {
                return Some(exact);
            }
            if let Some(&(longer, _)) = index.range((map_len, u64::MAX)..).next() {
                if longer <= map_len.saturating_mul(FIT_FACTOR) {
                    return index
                        .range((longer, 0)..=(longer, u64::MAX))
                        .next_back()
                        .copied();
                }
            }
            index
                .range(..(map_len, 0))
                .next_back()
                .filter(|&&(shorter, _)| shorter.saturating_mul(FIT_FACTOR) >= map_len)
                .copied()
        };
        let (len, seq) = fit(&self.cache_index)?;
        self.cache_index.remove(&(len, seq));
        let c = self.cache.remove(&seq).expect("indexed");
        self.cache_bytes -= c.map_len;
        Some(c)
    }

    fn put_cached(&mut self, c: Cached) {
        let seq = self.cache_seq;
        self.cache_seq += 1;
        self.cache_bytes += c.map_len;
        self.cache_index.insert((c.map_len, seq));
        self.cache.insert(seq, c);
    }

    /// Move the oldest cached blocks to `out` while the cache holds more
    /// bytes than the live blocks, keeping at least the newest one (for a
    /// chain that frees one array and makes the next). Without this bound,
    /// live plus cached bytes only ever grow to the largest set of arrays
    /// the process had at once, and stay there: with several worker
    /// processes on a host, all of them hold their largest set at the same
    /// time, which their peaks alone never did (8 workers: 1.16-1.27x
    /// stock's host peak on climatic_mean). Once a graph's arrays are
    /// released, the cache goes down to one block.
    fn trim_to_live(&mut self, out: &mut Vec<Cached>) {
        while self.cache.len() > 1 && self.cache_bytes > self.live_bytes && self.evict_oldest(out) {
        }
    }

    /// Move the cached blocks freed `decay` or longer before `now` to `out`,
    /// as [`State::evict_oldest`] does.
    fn evict_expired(&mut self, now: Instant, decay: Duration, out: &mut Vec<Cached>) {
        while self
            .cache
            .first_key_value()
            .is_some_and(|(_, c)| now.saturating_duration_since(c.since) >= decay)
        {
            self.evict_oldest(out);
        }
    }

    /// Move the oldest cached block to `out` (to be destroyed once the lock
    /// is released), releasing its budget. False if the cache is empty.
    fn evict_oldest(&mut self, out: &mut Vec<Cached>) -> bool {
        let Some((seq, c)) = self.cache.pop_first() else {
            return false;
        };
        self.cache_index.remove(&(c.map_len, seq));
        self.cache_bytes -= c.map_len;
        self.bytes -= c.map_len;
        self.count -= 1;
        out.push(c);
        true
    }
}

/// Allocation settings; see [`Arena::configure`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Directory for new blocks (0700, on a tmpfs); `None` disables the arena.
    pub directory: Option<PathBuf>,
    /// Smallest allocation served from a file, in bytes.
    pub threshold: usize,
    /// Most bytes in blocks whose file is still the arena's (not disowned);
    /// beyond, allocations use ordinary memory.
    pub budget: usize,
    /// Most blocks (mappings) at any time.
    pub max_blocks: usize,
    /// Reserve a block's pages with `fallocate` when it is made, so that a full
    /// tmpfs refuses the allocation instead of killing the process with
    /// SIGBUS on a later page fault.
    pub reserve: bool,
    /// Most bytes of freed blocks kept for reuse (0: none); see
    /// [`default_cache`].
    pub cache: usize,
    /// How long a freed block is kept unused before it is released; see
    /// [`DEFAULT_CACHE_DECAY`].
    pub cache_decay: Duration,
}

/// A thread-safe allocator of file-backed blocks. `const`-constructible so
/// that the process-wide instance can be a plain `static`.
#[derive(Debug)]
pub struct Arena {
    state: Mutex<State>,
    /// Blocks alive: lets `free` of a pointer that cannot be ours skip the lock.
    live: AtomicUsize,
    threshold: AtomicUsize,
    budget: AtomicUsize,
    max_blocks: AtomicUsize,
    reserve: AtomicBool,
    cache_cap: AtomicUsize,
    /// `Settings::cache_decay` in nanoseconds.
    cache_decay_ns: AtomicU64,
    /// The process the state belongs to (0 before the first `configure`): a
    /// child forked since inherits the state and the shared mappings, but
    /// the blocks and files are the parent's.
    pid: AtomicI32,
    next_id: AtomicU64,
    allocated: AtomicU64,
    freed: AtomicU64,
    sealed: AtomicU64,
    refused_budget: AtomicU64,
    refused_blocks: AtomicU64,
    refused_error: AtomicU64,
    reused: AtomicU64,
    evicted: AtomicU64,
    /// Told the address of a disowned block once it is unmapped.
    on_disowned_unmap: OnceLock<fn(usize)>,
}

impl Drop for Arena {
    /// Cached blocks go with the arena (live ones belong to their users).
    fn drop(&mut self) {
        self.release_cache();
    }
}

impl Default for Arena {
    fn default() -> Self {
        Self::new()
    }
}

/// Result of [`Arena::realloc`].
#[derive(Debug, PartialEq, Eq)]
pub enum Realloc {
    /// The pointer is not one of our blocks: the caller reallocates it.
    NotOurs,
    /// The block now lives at this address (possibly the same).
    Moved(usize),
    /// The block must leave the arena (below the threshold, over budget, or
    /// sealed): the caller allocates `new_len` bytes elsewhere, copies
    /// `copy` bytes from the old address, then calls [`Arena::free`] on it.
    CopyOut { copy: usize },
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput.into())
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An open file descriptor closed on drop.
struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn open(path: &Path, flags: libc::c_int) -> io::Result<Fd> {
    let c = cpath(path)?;
    // SAFETY: `c` is a valid NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Fd(fd))
}

fn unlink(path: &Path) {
    if let Ok(c) = cpath(path) {
        // SAFETY: valid path; a failure (already gone) is of no consequence.
        unsafe { libc::unlink(c.as_ptr()) };
    }
}

/// Size the file to `header + len` and, if asked, make tmpfs allocate the
/// pages of `[header + from, header + len)` now.
fn size_file(fd: &Fd, header: usize, from: usize, len: usize, reserve: bool) -> io::Result<()> {
    // SAFETY: plain system calls on a descriptor we own.
    check(unsafe { libc::ftruncate(fd.0, (header + len) as libc::off_t) })?;
    if reserve && len > from {
        let rc = unsafe {
            libc::fallocate(
                fd.0,
                0,
                (header + from) as libc::off_t,
                (len - from) as libc::off_t,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            // A file system without fallocate: go on unreserved.
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(e);
            }
        }
    }
    Ok(())
}

impl Arena {
    pub const fn new() -> Arena {
        Arena {
            state: Mutex::new(State {
                directory: None,
                blocks: BTreeMap::new(),
                bytes: 0,
                count: 0,
                live_bytes: 0,
                cache: BTreeMap::new(),
                cache_index: BTreeSet::new(),
                cache_bytes: 0,
                cache_seq: 0,
            }),
            live: AtomicUsize::new(0),
            threshold: AtomicUsize::new(usize::MAX),
            budget: AtomicUsize::new(0),
            max_blocks: AtomicUsize::new(0),
            reserve: AtomicBool::new(true),
            cache_cap: AtomicUsize::new(0),
            cache_decay_ns: AtomicU64::new(0),
            pid: AtomicI32::new(0),
            next_id: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            sealed: AtomicU64::new(0),
            refused_budget: AtomicU64::new(0),
            refused_blocks: AtomicU64::new(0),
            refused_error: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            on_disowned_unmap: OnceLock::new(),
        }
    }

    /// Bytes in front of a block's data inside its file (one page).
    pub fn header_size(&self) -> usize {
        page_size()
    }

    /// Apply new settings. Live blocks keep their files; new blocks go to the
    /// new directory. `directory: None` stops serving new blocks. The free
    /// cache is emptied when the directory changes (or the arena stops) and
    /// trimmed to the new cap and budget otherwise.
    pub fn configure(&self, settings: &Settings) {
        let mut evicted = Vec::new();
        let mut inherited = Vec::new();
        let mut st = lock(&self.state);
        if self.forked() {
            // The parent's blocks and files: unmap our view of the cached ones
            // and let the live ones go without unlinking their files.
            while st.evict_oldest(&mut inherited) {}
            let owned: usize = st
                .blocks
                .values()
                .filter(|b| b.owned)
                .map(|b| b.map_len)
                .sum();
            st.bytes -= owned;
            st.blocks.values_mut().for_each(|b| b.owned = false);
        }
        // SAFETY: getpid has no preconditions.
        self.pid.store(unsafe { libc::getpid() }, Ordering::Relaxed);
        if st.directory != settings.directory {
            while st.evict_oldest(&mut evicted) {}
        }
        while (st.cache_bytes > settings.cache || st.bytes > settings.budget)
            && st.evict_oldest(&mut evicted)
        {}
        self.cache_cap.store(settings.cache, Ordering::Relaxed);
        self.cache_decay_ns.store(
            u64::try_from(settings.cache_decay.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        st.directory = settings.directory.clone();
        self.threshold.store(
            if settings.directory.is_some() {
                settings.threshold.max(1)
            } else {
                usize::MAX
            },
            Ordering::Relaxed,
        );
        self.budget.store(settings.budget, Ordering::Relaxed);
        self.max_blocks
            .store(settings.max_blocks, Ordering::Relaxed);
        self.reserve.store(settings.reserve, Ordering::Relaxed);
        drop(st);
        for c in inherited {
            // SAFETY: our view of a parent's cached block; its file is theirs.
            unsafe { libc::munmap(c.addr as *mut libc::c_void, c.map_len) };
        }
        self.destroy(evicted);
    }

    /// True in a child forked since the arena was configured.
    fn forked(&self) -> bool {
        let pid = self.pid.load(Ordering::Relaxed);
        // SAFETY: getpid has no preconditions.
        pid != 0 && pid != unsafe { libc::getpid() }
    }

    fn cache_decay(&self) -> Duration {
        Duration::from_nanos(self.cache_decay_ns.load(Ordering::Relaxed))
    }

    /// Unmap and unlink the cached blocks that waited longer than the
    /// decay; returns the bytes released. Allocations and frees do this on
    /// their own; an owner calls it now and then so that an idle process
    /// releases them too.
    pub fn release_expired(&self) -> usize {
        let mut evicted = Vec::new();
        {
            let mut st = lock(&self.state);
            st.evict_expired(Instant::now(), self.cache_decay(), &mut evicted);
        }
        let released = evicted.iter().map(|c| c.map_len).sum();
        self.destroy(evicted);
        released
    }

    /// Unmap and unlink every cached block; returns the bytes released.
    pub fn release_cache(&self) -> usize {
        let mut evicted = Vec::new();
        {
            let mut st = lock(&self.state);
            while st.evict_oldest(&mut evicted) {}
        }
        let released = evicted.iter().map(|c| c.map_len).sum();
        self.destroy(evicted);
        released
    }

    /// Unmap and unlink cached blocks already taken out of the state (in a
    /// forked child, only unmap: the files are the parent's).
    fn destroy(&self, evicted: Vec<Cached>) {
        if evicted.is_empty() {
            return;
        }
        let forked = self.forked();
        for c in evicted {
            // SAFETY: a cached mapping is ours alone: no array refers to it.
            unsafe { libc::munmap(c.addr as *mut libc::c_void, c.map_len) };
            if !forked {
                unlink(&c.path);
                self.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Smallest size served from a file (`usize::MAX` when disabled).
    pub fn threshold(&self) -> usize {
        self.threshold.load(Ordering::Relaxed)
    }

    /// A block of `len` bytes, or `None` when it must come from ordinary
    /// memory: below the threshold, over a budget, or a system call failed
    /// (counted in [`Stats`]; the reason is not an error). Its bytes are
    /// unspecified (like `malloc`'s) when it is a cached block taken back;
    /// see [`Arena::alloc_zeroed`].
    pub fn alloc(&self, len: usize) -> Option<usize> {
        self.alloc_with(len, false)
    }

    /// [`Arena::alloc`] whose bytes are all zero (`calloc`): a fresh file
    /// reads as zeros, a cached block is cleared (writing already-mapped
    /// pages costs far less than faulting fresh tmpfs pages in).
    pub fn alloc_zeroed(&self, len: usize) -> Option<usize> {
        self.alloc_with(len, true)
    }

    fn alloc_with(&self, len: usize, zero: bool) -> Option<usize> {
        if len < self.threshold() || len == 0 || self.forked() {
            return None;
        }
        let page = page_size();
        let map_len = round_up(len, page);
        loop {
            let mut evicted = Vec::new();
            let taken = {
                let mut st = lock(&self.state);
                let directory = st.directory.clone()?;
                let taken = st.take_cached(map_len);
                st.evict_expired(Instant::now(), self.cache_decay(), &mut evicted);
                match taken {
                    Some(c) => {
                        // Its reservation passes to the new length; cached
                        // blocks give way to one that grows.
                        st.bytes -= c.map_len;
                        let budget = self.budget.load(Ordering::Relaxed);
                        while st.bytes.saturating_add(map_len) > budget
                            && st.evict_oldest(&mut evicted)
                        {}
                        if st.bytes.saturating_add(map_len) > budget {
                            st.count -= 1;
                            evicted.push(c);
                            self.refused_budget.fetch_add(1, Ordering::Relaxed);
                            drop(st);
                            self.destroy(evicted);
                            return None;
                        }
                        st.bytes += map_len;
                        Ok(c)
                    }
                    None => {
                        // Cached blocks too far from this length give way to
                        // a fresh one.
                        let max_blocks = self.max_blocks.load(Ordering::Relaxed);
                        let budget = self.budget.load(Ordering::Relaxed);
                        while (st.count >= max_blocks || st.bytes.saturating_add(map_len) > budget)
                            && st.evict_oldest(&mut evicted)
                        {}
                        if st.count >= max_blocks {
                            self.refused_blocks.fetch_add(1, Ordering::Relaxed);
                            drop(st);
                            self.destroy(evicted);
                            return None;
                        }
                        if st.bytes.saturating_add(map_len) > budget {
                            self.refused_budget.fetch_add(1, Ordering::Relaxed);
                            drop(st);
                            self.destroy(evicted);
                            return None;
                        }
                        st.bytes += map_len;
                        st.count += 1;
                        Err(directory)
                    }
                }
            };
            self.destroy(evicted);
            let (addr, path) = match taken {
                Ok(c) => match self.reuse(&c, len, map_len, zero) {
                    Ok(addr) => {
                        self.reused.fetch_add(1, Ordering::Relaxed);
                        (addr, c.path)
                    }
                    Err(_) => {
                        // E.g. the file vanished: drop it and look again (its
                        // mapping is still `c`'s, its reservation `map_len`).
                        {
                            let mut st = lock(&self.state);
                            st.bytes -= map_len;
                            st.count -= 1;
                        }
                        self.destroy(vec![c]);
                        continue;
                    }
                },
                Err(directory) => {
                    // File creation and mapping run outside the lock: they
                    // take tens of microseconds and other threads allocate
                    // meanwhile.
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let path = directory.join(id.to_string());
                    match self.make(&path, len, map_len, page) {
                        Ok(addr) => (addr, path),
                        Err(_) => {
                            let mut st = lock(&self.state);
                            st.bytes -= map_len;
                            st.count -= 1;
                            self.refused_error.fetch_add(1, Ordering::Relaxed);
                            return None;
                        }
                    }
                }
            };
            let mut st = lock(&self.state);
            st.live_bytes += map_len;
            st.blocks.insert(
                addr,
                Block {
                    path,
                    len,
                    map_len,
                    sealed: None,
                    owned: true,
                },
            );
            self.live.fetch_add(1, Ordering::Release);
            self.allocated.fetch_add(1, Ordering::Relaxed);
            return Some(addr);
        }
    }

    /// Make the cached block `c` a block of `len` bytes mapped on
    /// `map_len` bytes, and return its address. The file must be exactly
    /// `header + len` bytes (the spill-file layout): within the mapping's
    /// last page that is a plain `ftruncate`; for another mapping length the
    /// file is resized and the mapping shrunk in place or grown (moving if
    /// the kernel must), keeping the pages the two lengths share. Errors if
    /// the file is no longer the arena's alone (linked, resized or removed
    /// behind its back while cached): it is then not reused, and its
    /// mapping is still `c`'s (every step that can fail comes before the
    /// mapping changes).
    fn reuse(&self, c: &Cached, len: usize, map_len: usize, zero: bool) -> io::Result<usize> {
        let m = std::fs::symlink_metadata(&c.path)?;
        if !m.file_type().is_file() || m.nlink() != 1 || m.len() as usize != page_size() + c.len {
            return Err(io::ErrorKind::InvalidData.into());
        }
        let mut addr = c.addr;
        if c.len != len {
            let fd = open(&c.path, libc::O_RDWR)?;
            // A cached mapping is touched by nobody, so the file may shrink
            // before it; a grown file gets its new pages reserved.
            size_file(
                &fd,
                page_size(),
                c.len.min(len),
                len,
                len > c.len && self.reserve.load(Ordering::Relaxed),
            )?;
            if map_len != c.map_len {
                // SAFETY: resizing our own cached mapping, which no array
                // refers to; a shrink stays in place.
                let to = unsafe {
                    libc::mremap(
                        c.addr as *mut libc::c_void,
                        c.map_len,
                        map_len,
                        libc::MREMAP_MAYMOVE,
                    )
                };
                if to == libc::MAP_FAILED {
                    return Err(io::Error::last_os_error());
                }
                addr = to as usize;
            }
        }
        if zero {
            // Bytes past the old mapping come from the grown file: zero.
            // SAFETY: the mapping is ours alone and at least `len` long.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len.min(c.map_len)) };
        }
        Ok(addr)
    }

    fn make(&self, path: &Path, len: usize, map_len: usize, page: usize) -> io::Result<usize> {
        let fd = open(path, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)?;
        let mapped =
            size_file(&fd, page, 0, len, self.reserve.load(Ordering::Relaxed)).and_then(|()| {
                // SAFETY: a fresh shared mapping of a file we own; nothing else
                // refers to the address range yet.
                let addr = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        map_len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        fd.0,
                        page as libc::off_t,
                    )
                };
                if addr == libc::MAP_FAILED {
                    return Err(io::Error::last_os_error());
                }
                // Huge pages where the tmpfs offers them on request
                // (`huge=advise`); 4 KiB faults cost ~10x more. Best effort.
                // SAFETY: advice on our own fresh mapping.
                unsafe { libc::madvise(addr, map_len, libc::MADV_HUGEPAGE) };
                Ok(addr as usize)
            });
        if mapped.is_err() {
            unlink(path);
        }
        mapped
    }

    /// Give the block at `addr` back: keep it in the free cache when nobody
    /// else can see its file (see the module docs), else unmap it and
    /// unlink its own name. Returns false (and does nothing) if `addr` is
    /// not the start of a live block.
    pub fn free(&self, addr: usize) -> bool {
        if self.live.load(Ordering::Acquire) == 0 {
            return false;
        }
        let block = {
            let mut st = lock(&self.state);
            let Some(block) = st.blocks.remove(&addr) else {
                return false;
            };
            st.live_bytes -= block.map_len;
            self.live.fetch_sub(1, Ordering::Release);
            // Its budget (bytes and count) stays taken until it is cached or
            // gone.
            block
        };
        self.freed.fetch_add(1, Ordering::Relaxed);
        let cap = self.cache_cap.load(Ordering::Relaxed);
        let forked = self.forked();
        let mut evicted = Vec::new();
        let kept = !forked
            && block.owned
            && block.sealed.is_none()
            && block.map_len <= cap
            && self.sole_link(&block)
            && {
                let mut st = lock(&self.state);
                let here = st.directory.is_some() && block.path.parent() == st.directory.as_deref();
                if here {
                    let now = Instant::now();
                    st.put_cached(Cached {
                        addr,
                        path: block.path.clone(),
                        len: block.len,
                        map_len: block.map_len,
                        since: now,
                    });
                    let cap = self.cache_cap.load(Ordering::Relaxed);
                    while st.cache_bytes > cap && st.evict_oldest(&mut evicted) {}
                    st.trim_to_live(&mut evicted);
                    st.evict_expired(now, self.cache_decay(), &mut evicted);
                }
                here
            };
        self.destroy(evicted);
        if kept {
            return true;
        }
        let mut evicted = Vec::new();
        {
            let mut st = lock(&self.state);
            if block.owned {
                st.bytes -= block.map_len;
            }
            st.count -= 1;
            st.trim_to_live(&mut evicted);
        }
        self.destroy(evicted);
        // SAFETY: the range is our mapping, and the caller gave up the block.
        unsafe { libc::munmap(addr as *mut libc::c_void, block.map_len) };
        if block.owned && !forked {
            unlink(&block.path);
        }
        if !block.owned {
            if let Some(hook) = self.on_disowned_unmap.get() {
                hook(addr);
            }
        }
        true
    }

    /// Have `hook` told the address of every disowned block once `free`
    /// unmapped it (whoever tracks the mappings of the files it was given
    /// to); the first hook set stays.
    pub fn on_disowned_unmap(&self, hook: fn(usize)) {
        let _ = self.on_disowned_unmap.set(hook);
    }

    /// True when the block's file is still exactly as the arena made it and
    /// linked by the arena alone: nothing else can see a later reuse.
    fn sole_link(&self, block: &Block) -> bool {
        match std::fs::symlink_metadata(&block.path) {
            Ok(m) => {
                m.file_type().is_file()
                    && m.nlink() == 1
                    && m.len() as usize == page_size() + block.len
            }
            Err(_) => false,
        }
    }

    /// Resize the block at `addr` to `new_len` bytes; see [`Realloc`]. A block
    /// that stays in the arena keeps its file (grown or shrunk, new bytes
    /// zero) and is remapped, moving only if the kernel must.
    pub fn realloc(&self, addr: usize, new_len: usize) -> Realloc {
        if self.live.load(Ordering::Acquire) == 0 {
            return Realloc::NotOurs;
        }
        let mut evicted = Vec::new();
        let done = self.realloc_locked(addr, new_len, &mut evicted);
        self.destroy(evicted);
        done
    }

    fn realloc_locked(&self, addr: usize, new_len: usize, evicted: &mut Vec<Cached>) -> Realloc {
        let page = page_size();
        let new_map = round_up(new_len.max(1), page);
        let mut st = lock(&self.state);
        let Some(block) = st.blocks.get(&addr) else {
            return Realloc::NotOurs;
        };
        let copy = block.len.min(new_len);
        let grow = new_map.saturating_sub(block.map_len);
        if block.sealed.is_some() || new_len < self.threshold() || self.forked() {
            return Realloc::CopyOut { copy };
        }
        let budget = self.budget.load(Ordering::Relaxed);
        // Cached blocks give way to a growing one.
        while st.bytes.saturating_add(grow) > budget && st.evict_oldest(evicted) {}
        if st.bytes.saturating_add(grow) > budget {
            return Realloc::CopyOut { copy };
        }
        let block = st.blocks.remove(&addr).expect("looked up above");
        // The lock is held through the remap: this block is out of the map,
        // and a concurrent `alloc` must not be granted the bytes we grow by.
        let moved = (|| -> io::Result<usize> {
            let fd = open(&block.path, libc::O_RDWR)?;
            if new_len > block.len {
                size_file(
                    &fd,
                    page,
                    block.len,
                    new_len,
                    self.reserve.load(Ordering::Relaxed),
                )?;
            }
            // SAFETY: remapping our own mapping; the caller gave it up.
            let to = unsafe {
                libc::mremap(
                    addr as *mut libc::c_void,
                    block.map_len,
                    new_map,
                    libc::MREMAP_MAYMOVE,
                )
            };
            if to == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            if new_len < block.len {
                // Shrink the file after the mapping so no page we map is cut.
                size_file(&fd, page, 0, new_len, false)?;
            }
            Ok(to as usize)
        })();
        match moved {
            Ok(to) => {
                st.bytes = st.bytes + new_map - block.map_len;
                st.live_bytes = st.live_bytes + new_map - block.map_len;
                st.blocks.insert(
                    to,
                    Block {
                        len: new_len,
                        map_len: new_map,
                        ..block
                    },
                );
                // Fewer bytes in use: the cache may hold no more (as on free).
                st.trim_to_live(evicted);
                Realloc::Moved(to)
            }
            Err(_) => {
                st.blocks.insert(addr, block);
                Realloc::CopyOut { copy }
            }
        }
    }

    /// The block containing `addr`, if any.
    pub fn lookup(&self, addr: usize) -> Option<BlockInfo> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let st = lock(&self.state);
        let (&start, block) = st.blocks.range(..=addr).next_back()?;
        if addr >= start + block.len.max(1) {
            return None;
        }
        Some(BlockInfo {
            path: block.path.clone(),
            start,
            len: block.len,
            map_len: block.map_len,
            sealed: block.sealed.is_some(),
            owned: block.owned,
        })
    }

    /// Hand the sealed block at `addr`'s file over: its own name is unlinked
    /// (the caller linked the file elsewhere, e.g. into a spill store, as
    /// `new_path`), later look-ups report `new_path`, and `free` only unmaps.
    /// Errors: `NotFound` if no sealed block starts at `addr` (or in a
    /// forked child).
    pub fn disown(&self, addr: usize, new_path: &Path) -> io::Result<()> {
        if self.forked() {
            return Err(io::ErrorKind::NotFound.into());
        }
        let mut st = lock(&self.state);
        let block = match st.blocks.get_mut(&addr) {
            Some(b) if b.sealed.is_some() => b,
            _ => return Err(io::ErrorKind::NotFound.into()),
        };
        if block.owned {
            unlink(&block.path);
            let freed = block.map_len;
            block.path = new_path.to_path_buf();
            block.owned = false;
            // Its bytes are the new holder's to account (and budget) now.
            st.bytes -= freed;
        } else {
            block.path = new_path.to_path_buf();
        }
        Ok(())
    }

    /// Make the block at `addr` (exactly `len` bytes) a complete, immutable
    /// file: write `header` (at most [`Arena::header_size`] bytes) at the
    /// start of the file, then replace the writable shared mapping by a
    /// private copy-on-write mapping of the same file at the same address.
    /// Sealing again with the same header is a no-op; returns the file path.
    ///
    /// Errors: `NotFound` if `addr`/`len` is not exactly a live block (or in
    /// a forked child),
    /// `InvalidInput` if the header is too long, `AlreadyExists` if the block
    /// was sealed with another header (its file may already be shared), or
    /// the system call's error (the block is then unchanged and still
    /// usable; if the remap itself fails the range keeps its old mapping
    /// unless the kernel dropped it, which it does only for lack of memory).
    pub fn seal(&self, addr: usize, len: usize, header: &[u8]) -> io::Result<PathBuf> {
        let page = page_size();
        if header.len() > page {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        if self.forked() {
            return Err(io::ErrorKind::NotFound.into());
        }
        let mut st = lock(&self.state);
        let block = match st.blocks.get_mut(&addr) {
            Some(b) if b.len == len => b,
            _ => return Err(io::ErrorKind::NotFound.into()),
        };
        if let Some(done) = &block.sealed {
            return if done.as_slice() == header {
                Ok(block.path.clone())
            } else {
                Err(io::ErrorKind::AlreadyExists.into())
            };
        }
        let fd = open(&block.path, libc::O_RDWR)?;
        let mut padded = header.to_vec();
        padded.resize(page, 0);
        // SAFETY: writing our buffer to our descriptor.
        let n = unsafe { libc::pwrite(fd.0, padded.as_ptr().cast(), page, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != page {
            return Err(io::ErrorKind::WriteZero.into());
        }
        // MAP_FIXED replaces the shared mapping atomically: a thread reading
        // the array meanwhile sees the same bytes either way (the shared
        // mapping's writes are in the file the private one reads).
        // SAFETY: the range is exactly our block's mapping.
        let to = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                block.map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                fd.0,
                page as libc::off_t,
            )
        };
        if to == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        block.sealed = Some(header.to_vec());
        self.sealed.fetch_add(1, Ordering::Relaxed);
        Ok(block.path.clone())
    }

    pub fn stats(&self) -> Stats {
        let st = lock(&self.state);
        Stats {
            blocks: st.blocks.len(),
            bytes: st.live_bytes,
            owned_bytes: st
                .blocks
                .values()
                .filter(|b| b.owned)
                .map(|b| b.map_len)
                .sum(),
            allocated: self.allocated.load(Ordering::Relaxed),
            freed: self.freed.load(Ordering::Relaxed),
            sealed: self.sealed.load(Ordering::Relaxed),
            refused_budget: self.refused_budget.load(Ordering::Relaxed),
            refused_blocks: self.refused_blocks.load(Ordering::Relaxed),
            refused_error: self.refused_error.load(Ordering::Relaxed),
            cached_blocks: st.cache.len(),
            cached_bytes: st.cache_bytes,
            reused: self.reused.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }

    /// Directory new blocks go to, if enabled.
    pub fn directory(&self) -> Option<PathBuf> {
        lock(&self.state).directory.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn tmpfs_dir() -> tempfile::TempDir {
        let base = Path::new("/dev/shm");
        if base.is_dir() {
            tempfile::tempdir_in(base).unwrap()
        } else {
            tempfile::tempdir().unwrap()
        }
    }

    fn arena(dir: &Path, threshold: usize, budget: usize, max_blocks: usize) -> Arena {
        let a = Arena::new();
        a.configure(&Settings {
            directory: Some(dir.to_path_buf()),
            threshold,
            budget,
            max_blocks,
            reserve: true,
            cache: 0,
            cache_decay: Duration::from_secs(3600),
        });
        a
    }

    fn cached_arena(dir: &Path, threshold: usize, budget: usize, cache: usize) -> Arena {
        decaying_arena(dir, threshold, budget, cache, Duration::from_secs(3600))
    }

    fn decaying_arena(
        dir: &Path,
        threshold: usize,
        budget: usize,
        cache: usize,
        cache_decay: Duration,
    ) -> Arena {
        let a = Arena::new();
        a.configure(&Settings {
            directory: Some(dir.to_path_buf()),
            threshold,
            budget,
            max_blocks: 1000,
            reserve: true,
            cache,
            cache_decay,
        });
        a
    }

    /// (bytes, count) the budgets see.
    fn reserved(a: &Arena) -> (usize, usize) {
        let st = lock(&a.state);
        (st.bytes, st.count)
    }

    fn entries(dir: &Path) -> usize {
        fs::read_dir(dir).unwrap().count()
    }

    unsafe fn bytes<'a>(addr: usize, len: usize) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(addr as *mut u8, len)
    }

    #[test]
    fn below_threshold_and_disabled_refuse() {
        let d = tmpfs_dir();
        let a = arena(d.path(), 1 << 20, 1 << 30, 100);
        assert_eq!(a.alloc((1 << 20) - 1), None);
        assert_eq!(a.alloc(0), None);
        let off = Arena::new();
        assert_eq!(off.alloc(1 << 30), None);
        assert_eq!(a.stats().blocks, 0);
    }

    #[test]
    fn alloc_maps_a_private_zeroed_file_and_free_unlinks_it() {
        let d = tmpfs_dir();
        let a = arena(d.path(), 4096, 1 << 30, 100);
        let len = 3 * 4096 + 17;
        let addr = a.alloc(len).unwrap();
        let info = a.lookup(addr + 5).unwrap();
        assert_eq!((info.start, info.len, info.sealed), (addr, len, false));
        let meta = fs::symlink_metadata(&info.path).unwrap();
        assert_eq!(meta.len() as usize, a.header_size() + len);
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let data = unsafe { bytes(addr, len) };
        assert!(data.iter().all(|&b| b == 0));
        data[len - 1] = 7;
        // The write went to the file (MAP_SHARED).
        let on_disk = fs::read(&info.path).unwrap();
        assert_eq!(on_disk[a.header_size() + len - 1], 7);
        assert!(a.lookup(addr + len).is_none());
        assert!(a.free(addr));
        assert!(!info.path.exists());
        assert!(!a.free(addr));
        let s = a.stats();
        assert_eq!((s.blocks, s.bytes, s.allocated, s.freed), (0, 0, 1, 1));
    }

    #[test]
    fn free_keeps_a_file_linked_elsewhere() {
        let d = tmpfs_dir();
        let a = arena(d.path(), 4096, 1 << 30, 100);
        let addr = a.alloc(8192).unwrap();
        unsafe { bytes(addr, 8192)[0] = 42 };
        let info = a.lookup(addr).unwrap();
        let kept = d.path().join("kept");
        fs::hard_link(&info.path, &kept).unwrap();
        assert!(a.free(addr));
        assert_eq!(fs::read(&kept).unwrap()[a.header_size()], 42);
    }

    #[test]
    fn budget_and_block_limits_refuse() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = arena(d.path(), page, 4 * page, 4);
        let x = a.alloc(2 * page).unwrap();
        assert_eq!(a.alloc(3 * page), None);
        assert_eq!(a.stats().refused_budget, 1);
        let y = a.alloc(page).unwrap();
        let z = a.alloc(page).unwrap();
        assert_eq!(a.alloc(page), None);
        assert_eq!(a.stats().refused_budget, 2);
        a.free(z);
        a.configure(&Settings {
            directory: Some(d.path().to_path_buf()),
            threshold: page,
            budget: 1 << 30,
            max_blocks: 2,
            reserve: true,
            cache: 0,
            cache_decay: Duration::from_secs(3600),
        });
        assert_eq!(a.alloc(page), None);
        assert_eq!(a.stats().refused_blocks, 1);
        a.free(x);
        a.free(y);
        assert_eq!(a.stats().bytes, 0);
    }

    #[test]
    fn failing_directory_refuses_without_leaking_budget() {
        let d = tmpfs_dir();
        let a = arena(&d.path().join("missing"), 4096, 1 << 20, 10);
        assert_eq!(a.alloc(8192), None);
        let s = a.stats();
        assert_eq!((s.refused_error, s.bytes), (1, 0));
        assert_eq!(lock(&a.state).bytes, 0);
    }

    #[test]
    fn realloc_grows_and_shrinks_in_place_keeping_bytes() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = arena(d.path(), page, 1 << 30, 100);
        let addr = a.alloc(2 * page).unwrap();
        unsafe { bytes(addr, 2 * page).fill(9) };
        let Realloc::Moved(to) = a.realloc(addr, 10 * page + 3) else {
            panic!("expected a remap")
        };
        let grown = unsafe { bytes(to, 10 * page + 3) };
        assert!(grown[..2 * page].iter().all(|&b| b == 9));
        assert!(grown[2 * page..].iter().all(|&b| b == 0));
        let info = a.lookup(to).unwrap();
        assert_eq!(info.len, 10 * page + 3);
        assert_eq!(
            fs::metadata(&info.path).unwrap().len() as usize,
            page + 10 * page + 3
        );
        let Realloc::Moved(to2) = a.realloc(to, 3 * page) else {
            panic!("expected a remap")
        };
        assert!(unsafe { bytes(to2, 3 * page) }[..2 * page]
            .iter()
            .all(|&b| b == 9));
        assert_eq!(a.stats().bytes, 3 * page);
        // Below the threshold: the caller copies out.
        assert_eq!(
            a.realloc(to2, page - 1),
            Realloc::CopyOut { copy: page - 1 }
        );
        assert_eq!(a.realloc(12345, page), Realloc::NotOurs);
        assert!(a.free(to2));
    }

    #[test]
    fn seal_protects_the_file_from_the_owner() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = arena(d.path(), page, 1 << 30, 100);
        let len = 5 * page;
        let addr = a.alloc(len).unwrap();
        let data = unsafe { bytes(addr, len) };
        data.fill(1);
        let path = a.seal(addr, len, b"HEADER").unwrap();
        assert!(a.lookup(addr).unwrap().sealed);
        // The owner still reads its bytes, and may write them...
        assert!(data.iter().all(|&b| b == 1));
        data[0] = 2;
        data[len - 1] = 3;
        // ...but the file (what a peer links) never changes.
        let file = fs::read(&path).unwrap();
        assert_eq!(&file[..6], b"HEADER");
        assert!(file[6..page].iter().all(|&b| b == 0));
        assert!(file[page..].iter().all(|&b| b == 1));
        assert_eq!(data[0], 2);
        // Same header again: fine. Another: refused. Wrong length: not found.
        assert_eq!(a.seal(addr, len, b"HEADER").unwrap(), path);
        assert_eq!(
            a.seal(addr, len, b"OTHER").unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        assert_eq!(
            a.seal(addr, len - 1, b"HEADER").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        // A sealed block leaves the arena on realloc.
        assert_eq!(a.realloc(addr, 6 * page), Realloc::CopyOut { copy: len });
        let linked = d.path().join("peer");
        fs::hard_link(&path, &linked).unwrap();
        assert!(a.free(addr));
        assert_eq!(fs::metadata(&linked).unwrap().nlink(), 1);
        assert!(fs::read(&linked).unwrap()[page..].iter().all(|&b| b == 1));
    }

    #[test]
    fn disown_hands_the_file_over() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = arena(d.path(), page, 1 << 30, 100);
        let addr = a.alloc(page).unwrap();
        let store = d.path().join("store-copy");
        assert_eq!(
            a.disown(addr, &store).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        let path = a.seal(addr, page, b"H").unwrap();
        fs::hard_link(&path, &store).unwrap();
        assert_eq!(a.stats().owned_bytes, page);
        a.disown(addr, &store).unwrap();
        assert_eq!(lock(&a.state).bytes, 0); // no longer counts against the budget
        assert!(!path.exists());
        let info = a.lookup(addr).unwrap();
        assert_eq!((info.path.as_path(), info.owned), (store.as_path(), false));
        assert_eq!(a.stats().owned_bytes, 0);
        assert!(a.free(addr));
        assert!(store.exists());
    }

    #[test]
    fn many_threads_allocate_write_and_free() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = std::sync::Arc::new(arena(d.path(), page, 64 * page, 1000));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut mine = 0;
                    for i in 0..200 {
                        let len = page * (1 + (i + t) % 4);
                        if let Some(addr) = a.alloc(len) {
                            let data = unsafe { bytes(addr, len) };
                            data.fill(t as u8);
                            assert!(data.iter().all(|&b| b == t as u8));
                            assert_eq!(a.lookup(addr).unwrap().len, len);
                            assert!(a.free(addr));
                            mine += 1;
                        }
                    }
                    mine
                })
            })
            .collect();
        let served: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        let s = a.stats();
        assert_eq!((s.blocks, s.bytes), (0, 0));
        assert_eq!(s.allocated, served);
        assert_eq!(s.allocated, s.freed);
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0);
    }

    /// Minor page faults of the calling thread so far.
    fn minor_faults() -> i64 {
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: filling our own struct.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
        u.ru_minflt
    }

    #[test]
    fn freed_blocks_are_reused_without_new_files_or_faults() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        let len = 64 * page;
        let addr = a.alloc(len).unwrap();
        let path = a.lookup(addr).unwrap().path;
        unsafe { bytes(addr, len).fill(5) };
        assert!(a.free(addr));
        // Kept: file and mapping intact, still counted as the arena's.
        assert!(path.exists());
        let s = a.stats();
        assert_eq!((s.blocks, s.bytes, s.owned_bytes), (0, 0, 0));
        assert_eq!((s.cached_blocks, s.cached_bytes, s.freed), (1, len, 1));
        assert_eq!(lock(&a.state).bytes, len);
        assert!(a.lookup(addr).is_none());
        assert!(!a.free(addr)); // a cached block is not a live one

        let faults = minor_faults();
        let again = a.alloc(len).unwrap();
        unsafe { bytes(again, len).fill(6) };
        assert!(minor_faults() - faults < 4, "reuse took page faults");
        assert_eq!(again, addr);
        let info = a.lookup(again).unwrap();
        assert_eq!((info.path.as_path(), info.len), (path.as_path(), len));
        // Still the file's shared mapping: what seal and a peer rely on.
        assert!(fs::read(&path).unwrap()[page..].iter().all(|&b| b == 6));
        let s = a.stats();
        assert_eq!(
            (s.allocated, s.reused, s.cached_blocks, s.cached_bytes),
            (2, 1, 0, 0)
        );
        assert_eq!(entries(d.path()), 1);

        // Same mapping length, other byte length: the file is resized to
        // exactly header + len (the spill-file layout).
        a.free(again);
        let odd = a.alloc(len - 17).unwrap();
        assert_eq!(odd, addr);
        assert_eq!(fs::metadata(&path).unwrap().len() as usize, page + len - 17);
        assert_eq!(a.lookup(odd).unwrap().len, len - 17);
        unsafe { bytes(odd, len - 17).fill(7) };
        a.free(odd);
        let back = a.alloc(len).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len() as usize, page + len);
        a.free(back);

        // A mapping length more than FIT_FACTOR away is a fresh block. (A
        // live block at least as large as the cache keeps both cached.)
        let anchor = a.alloc(4 * len).unwrap();
        let other = a.alloc(2 * len + page).unwrap();
        assert_ne!(a.lookup(other).unwrap().path, path);
        assert_eq!(a.stats().reused, 3);
        a.free(other);
        assert_eq!(a.stats().cached_blocks, 2);
        assert_eq!(a.release_cache(), 3 * len + page);
        assert_eq!(entries(d.path()), 1);
        a.free(anchor);
        assert_eq!(a.release_cache(), 4 * len);
        assert_eq!(entries(d.path()), 0);
        let s = a.stats();
        assert_eq!((s.cached_blocks, s.cached_bytes, s.evicted), (0, 0, 3));
        assert_eq!(lock(&a.state).bytes, 0);
        assert_eq!(lock(&a.state).count, 0);
    }

    #[test]
    fn calloc_of_a_cached_block_reads_zeros() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        let len = 8 * page + 100;
        let addr = a.alloc_zeroed(len).unwrap();
        unsafe { bytes(addr, len).fill(0xAB) };
        a.free(addr);
        let z = a.alloc_zeroed(len).unwrap();
        assert_eq!(z, addr);
        assert!(unsafe { bytes(z, len) }.iter().all(|&b| b == 0));
        a.free(z);
        // A shorter length in the same pages: zero as well.
        let z = a.alloc_zeroed(len - 50).unwrap();
        assert_eq!(z, addr);
        assert!(unsafe { bytes(z, len - 50) }.iter().all(|&b| b == 0));
        assert_eq!(a.stats().reused, 2);
        a.free(z);
    }

    #[test]
    fn linked_sealed_and_disowned_blocks_are_never_cached() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        let len = 4 * page;

        // Linked elsewhere while in use: the peer's file must never change.
        let x = a.alloc(len).unwrap();
        unsafe { bytes(x, len).fill(1) };
        let peer = d.path().join("peer");
        fs::hard_link(a.lookup(x).unwrap().path, &peer).unwrap();
        a.free(x);
        // Sealed (its file may be shared).
        let y = a.alloc(len).unwrap();
        unsafe { bytes(y, len).fill(2) };
        let sealed = a.seal(y, len, b"H").unwrap();
        let sealed_copy = d.path().join("sealed-peer");
        fs::hard_link(&sealed, &sealed_copy).unwrap();
        a.free(y);
        // Sealed and disowned (a store's file now).
        let z = a.alloc(len).unwrap();
        let path = a.seal(z, len, b"H").unwrap();
        let store = d.path().join("store");
        fs::hard_link(&path, &store).unwrap();
        a.disown(z, &store).unwrap();
        a.free(z);
        // Sealed, never linked: still not reused (sealing wrote its file).
        let w = a.alloc(len).unwrap();
        a.seal(w, len, b"H").unwrap();
        a.free(w);

        let s = a.stats();
        assert_eq!((s.cached_blocks, s.cached_bytes, s.reused), (0, 0, 0));
        assert_eq!(lock(&a.state).bytes, 0);
        for _ in 0..3 {
            let n = a.alloc(len).unwrap();
            unsafe { bytes(n, len).fill(9) };
        }
        assert_eq!(a.stats().reused, 0);
        assert!(fs::read(&peer).unwrap()[page..].iter().all(|&b| b == 1));
        assert!(fs::read(&sealed_copy).unwrap()[page..]
            .iter()
            .all(|&b| b == 2));
        assert!(store.exists());
    }

    #[test]
    fn a_cached_file_linked_behind_the_arenas_back_is_not_reused() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        let x = a.alloc(2 * page).unwrap();
        unsafe { bytes(x, 2 * page).fill(3) };
        let path = a.lookup(x).unwrap().path;
        a.free(x);
        let peer = d.path().join("peer");
        fs::hard_link(&path, &peer).unwrap();
        let y = a.alloc(2 * page).unwrap();
        unsafe { bytes(y, 2 * page).fill(4) };
        assert_ne!(a.lookup(y).unwrap().path, path);
        let s = a.stats();
        assert_eq!((s.reused, s.cached_blocks, s.evicted), (0, 0, 1));
        assert!(fs::read(&peer).unwrap()[page..].iter().all(|&b| b == 3));
        assert_eq!(lock(&a.state).bytes, 2 * page);
        a.free(y);
    }

    #[test]
    fn cached_blocks_unused_for_the_decay_are_released() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = decaying_arena(d.path(), page, 1 << 30, 1 << 30, Duration::from_millis(200));
        let odd = a.alloc(3 * page).unwrap();
        let odd_path = a.lookup(odd).unwrap().path;
        a.free(odd);
        assert_eq!(a.stats().cached_blocks, 1);
        // Reused within the decay: the same block, its file kept.
        let again = a.alloc(3 * page).unwrap();
        assert_eq!(again, odd);
        a.free(again);
        std::thread::sleep(Duration::from_millis(250));
        // The next allocation (of a length it cannot serve) releases the
        // block nobody asked for in time ...
        let other = a.alloc(7 * page).unwrap();
        let other_path = a.lookup(other).unwrap().path;
        a.free(other);
        assert!(!odd_path.exists());
        let s = a.stats();
        assert_eq!(
            (s.cached_blocks, s.cached_bytes, s.evicted),
            (1, 7 * page, 1)
        );
        // ... and an idle owner releases the rest.
        assert_eq!(a.release_expired(), 0);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(a.release_expired(), 7 * page);
        assert!(!other_path.exists());
        assert_eq!(reserved(&a), (0, 0));
        assert_eq!(entries(d.path()), 0);
    }

    #[test]
    fn the_cache_cap_is_respected_oldest_first() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 5 * page);
        // Live, so that the cache may hold up to its cap.
        let _anchor = a.alloc(8 * page).unwrap();
        let blocks: Vec<usize> = (0..4).map(|_| a.alloc(2 * page).unwrap()).collect();
        let paths: Vec<PathBuf> = blocks.iter().map(|&b| a.lookup(b).unwrap().path).collect();
        for &b in &blocks {
            a.free(b);
        }
        let s = a.stats();
        assert_eq!(
            (s.cached_blocks, s.cached_bytes, s.evicted),
            (2, 4 * page, 2)
        );
        assert!(!paths[0].exists() && !paths[1].exists());
        assert!(paths[2].exists() && paths[3].exists());
        // The newest of a length is taken first.
        assert_eq!(a.alloc(2 * page).unwrap(), blocks[3]);
        // A block longer than the cap is never kept.
        let big = a.alloc(6 * page).unwrap();
        let big_path = a.lookup(big).unwrap().path;
        a.free(big);
        assert!(!big_path.exists());
        assert_eq!(a.stats().cached_bytes, 2 * page);
        assert_eq!(lock(&a.state).bytes, 12 * page);
    }

    #[test]
    fn cached_blocks_give_way_to_budget_block_limit_and_growth() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 10 * page, 6 * page);
        // Live, so that the cache may hold both freed blocks.
        let _anchor = a.alloc(4 * page).unwrap();
        let x = a.alloc(2 * page).unwrap();
        let y = a.alloc(2 * page).unwrap();
        a.free(x);
        a.free(y);
        assert_eq!(lock(&a.state).bytes, 8 * page);
        // 5 pages, which neither cached block can serve: 13 pages are over
        // the budget until both go.
        let z = a.alloc(5 * page).unwrap();
        let s = a.stats();
        assert_eq!(
            (s.cached_blocks, s.evicted, s.refused_budget, s.reused),
            (0, 2, 0, 0)
        );
        assert_eq!(lock(&a.state).bytes, 9 * page);
        a.free(z);
        // Growing in place takes a cached block's budget.
        let w = a.alloc(page).unwrap();
        assert_eq!(a.stats().cached_blocks, 1);
        assert!(matches!(a.realloc(w, 6 * page), Realloc::Moved(_)));
        let s = a.stats();
        assert_eq!((s.cached_blocks, s.evicted), (0, 3));
        assert_eq!(entries(d.path()), 2);

        // The block limit (another directory: file names restart at 0).
        let d2 = tmpfs_dir();
        let b = Arena::new();
        b.configure(&Settings {
            directory: Some(d2.path().to_path_buf()),
            threshold: page,
            budget: 1 << 30,
            max_blocks: 2,
            reserve: true,
            cache: 1 << 30,
            cache_decay: Duration::from_secs(3600),
        });
        let p = b.alloc(page).unwrap();
        let q = b.alloc(page).unwrap();
        b.free(p);
        assert!(b.alloc(3 * page).is_some()); // p's mapping went for it
        assert_eq!(b.stats().evicted, 1);
        assert_eq!(b.alloc(page), None);
        assert_eq!(b.stats().refused_blocks, 1);
        b.free(q);
    }

    #[test]
    fn a_cached_block_serves_a_length_within_the_fit_factor() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        let len = 64 * page;
        let anchor = a.alloc(8 * len).unwrap();
        let addr = a.alloc(len).unwrap();
        let path = a.lookup(addr).unwrap().path;
        unsafe { bytes(addr, len).fill(5) };
        a.free(addr);

        // Shorter, down to half: the same file, cut to the new length, its
        // mapping shrunk in place; the shared pages take no fault.
        let short = len / 2 + 3;
        let faults = minor_faults();
        let s1 = a.alloc(short).unwrap();
        unsafe { bytes(s1, short).fill(6) };
        assert!(minor_faults() - faults < 4, "reuse took page faults");
        assert_eq!(s1, addr);
        let info = a.lookup(s1).unwrap();
        assert_eq!((info.path.as_path(), info.len), (path.as_path(), short));
        assert_eq!(fs::metadata(&path).unwrap().len() as usize, page + short);
        assert!(fs::read(&path).unwrap()[page..].iter().all(|&b| b == 6));
        assert_eq!(a.stats().cached_bytes, 0);
        assert_eq!(reserved(&a), (8 * len + round_up(short, page), 2));
        a.free(s1);

        // Longer, up to twice: grown (the new pages reserved), zeroed when
        // asked, still the file's shared mapping.
        let long = 2 * round_up(short, page);
        let g = a.alloc_zeroed(long).unwrap();
        assert!(unsafe { bytes(g, long) }.iter().all(|&b| b == 0));
        unsafe { bytes(g, long).fill(7) };
        let info = a.lookup(g).unwrap();
        assert_eq!((info.path.as_path(), info.len), (path.as_path(), long));
        assert_eq!(fs::metadata(&path).unwrap().len() as usize, page + long);
        // Every data page backed (the header page is a hole until sealed).
        assert_eq!(fs::metadata(&path).unwrap().blocks() as usize * 512, long);
        assert!(fs::read(&path).unwrap()[page..].iter().all(|&b| b == 7));
        assert_eq!(reserved(&a), (8 * len + long, 2));
        assert_eq!(a.stats().reused, 2);
        assert_eq!(entries(d.path()), 2);
        a.free(g);

        // The closest fit wins: an exact length first, then the shortest
        // longer, then the longest shorter.
        let sizes = [10 * page, 14 * page, 20 * page];
        let blocks: Vec<usize> = sizes.iter().map(|&n| a.alloc(n).unwrap()).collect();
        blocks.iter().for_each(|&b| assert!(a.free(b)));
        let take = |n: usize| {
            let b = a.alloc(n).unwrap();
            (b, a.lookup(b).unwrap().path)
        };
        let path_of = |i: usize| d.path().join((2 + i).to_string());
        assert_eq!(take(14 * page).1, path_of(1));
        assert_eq!(take(12 * page).1, path_of(2));
        assert_eq!(take(16 * page).1, path_of(0));
        // Nothing left within the factor: a fresh file.
        let (_, fresh) = take(29 * page);
        assert_eq!(fresh, d.path().join("5"));
        assert_eq!(a.stats().reused, 5);
        a.free(anchor);
    }

    #[test]
    fn a_cached_block_grown_over_the_budget_is_refused() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 10 * page, 1 << 30);
        let _anchor = a.alloc(4 * page).unwrap();
        let x = a.alloc(4 * page).unwrap();
        a.free(x);
        // 4 + 7 pages: over the budget even with the cached block's 4
        // pages passed on; a fresh block would be refused too.
        assert_eq!(a.alloc(7 * page), None);
        let s = a.stats();
        assert_eq!((s.refused_budget, s.cached_blocks, s.evicted), (1, 0, 1));
        assert_eq!(reserved(&a), (4 * page, 1));
        assert_eq!(entries(d.path()), 1);
        // Within the budget it grows.
        let y = a.alloc(3 * page).unwrap();
        a.free(y);
        assert!(a.alloc(6 * page).is_some());
        assert_eq!(reserved(&a), (10 * page, 2));
    }

    #[test]
    fn stop_reconfigure_and_drop_release_the_cache() {
        let d = tmpfs_dir();
        let page = page_size();
        let settings = |dir: Option<PathBuf>, budget, cache| Settings {
            directory: dir,
            threshold: page,
            budget,
            max_blocks: 1000,
            reserve: true,
            cache,
            cache_decay: Duration::from_secs(3600),
        };
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        // Live, so that the cache may hold all three freed blocks.
        let anchor = a.alloc(8 * page).unwrap();
        for _ in 0..2 {
            let blocks: Vec<usize> = (1..4).map(|n| a.alloc(n * page).unwrap()).collect();
            blocks.into_iter().for_each(|b| assert!(a.free(b)));
        }
        assert_eq!(a.stats().cached_blocks, 3);
        // A smaller cap or budget trims, oldest first.
        a.configure(&settings(Some(d.path().into()), 1 << 30, 5 * page));
        assert_eq!(a.stats().cached_bytes, 5 * page);
        a.configure(&settings(Some(d.path().into()), 11 * page, 5 * page));
        assert_eq!(a.stats().cached_bytes, 3 * page);
        assert_eq!(entries(d.path()), 2);
        a.free(anchor);
        // Stopping releases everything.
        a.configure(&settings(None, 1 << 30, 1 << 30));
        assert_eq!(entries(d.path()), 0);
        let s = a.stats();
        assert_eq!((s.cached_blocks, s.cached_bytes), (0, 0));
        assert_eq!(reserved(&a), (0, 0));
        // Another directory: the old one's cached blocks go.
        let other = tmpfs_dir();
        a.configure(&settings(Some(d.path().into()), 1 << 30, 1 << 30));
        let x = a.alloc(page).unwrap();
        a.free(x);
        a.configure(&settings(Some(other.path().into()), 1 << 30, 1 << 30));
        assert_eq!(entries(d.path()), 0);
        // A block of the old directory freed now is not kept either.
        let x = a.alloc(page).unwrap();
        a.configure(&settings(Some(d.path().into()), 1 << 30, 1 << 30));
        a.free(x);
        assert_eq!(entries(other.path()), 0);
        // Dropping the arena releases what it cached.
        let y = a.alloc(page).unwrap();
        a.free(y);
        assert_eq!(entries(d.path()), 1);
        drop(a);
        assert_eq!(entries(d.path()), 0);
    }

    #[test]
    fn the_cache_holds_no_more_than_the_live_blocks_but_the_newest() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        let blocks: Vec<usize> = (0..4).map(|_| a.alloc(2 * page).unwrap()).collect();
        let paths: Vec<PathBuf> = blocks.iter().map(|&b| a.lookup(b).unwrap().path).collect();
        // While the freed bytes stay within the live ones, all are kept.
        a.free(blocks[0]);
        a.free(blocks[1]);
        let s = a.stats();
        assert_eq!(
            (s.cached_blocks, s.cached_bytes, s.evicted),
            (2, 4 * page, 0)
        );
        // Beyond, the oldest go.
        a.free(blocks[2]);
        let s = a.stats();
        assert_eq!(
            (s.cached_blocks, s.cached_bytes, s.evicted),
            (1, 2 * page, 2)
        );
        // Nothing live any more: only the newest freed block stays (for a
        // chain of tasks that frees one array and makes the next).
        a.free(blocks[3]);
        let s = a.stats();
        assert_eq!(
            (s.cached_blocks, s.cached_bytes, s.evicted),
            (1, 2 * page, 3)
        );
        assert_eq!(
            paths.iter().map(|p| p.exists()).collect::<Vec<_>>(),
            [false, false, false, true]
        );
        assert_eq!(a.alloc(2 * page).unwrap(), blocks[3]);
        assert_eq!(a.stats().reused, 1);

        // Shrinking a block in use trims the cache with the live bytes.
        let big = a.alloc(8 * page).unwrap();
        let y = a.alloc(2 * page).unwrap();
        let z = a.alloc(2 * page).unwrap();
        a.free(y);
        a.free(z);
        assert_eq!(a.stats().cached_blocks, 2);
        // (blocks[3] is in use too: 2 + 1 pages live after the shrink.)
        let big = match a.realloc(big, page) {
            Realloc::Moved(to) => to,
            other => panic!("{other:?}"),
        };
        let s = a.stats();
        assert_eq!((s.cached_blocks, s.cached_bytes), (1, 2 * page));
        a.free(big);
        a.release_cache();

        // Freeing a block that is never cached (sealed) shrinks the live
        // bytes too, and trims the cache with them.
        let sealed = a.alloc(4 * page).unwrap();
        a.seal(sealed, 4 * page, b"H").unwrap();
        let x = a.alloc(2 * page).unwrap();
        a.free(blocks[3]);
        a.free(x);
        assert_eq!(a.stats().cached_blocks, 2);
        a.free(sealed);
        let s = a.stats();
        assert_eq!((s.cached_blocks, s.cached_bytes), (1, 2 * page));
        assert_eq!(lock(&a.state).live_bytes, 0);
        assert_eq!(a.release_cache(), 2 * page);
        assert_eq!(entries(d.path()), 0);
    }

    #[test]
    fn many_threads_reuse_cached_blocks() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = std::sync::Arc::new(cached_arena(d.path(), page, 64 * page, 16 * page));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    for i in 0..300 {
                        let len = page * (1 + (i + t) % 4) - (i % 3);
                        let got = if i % 2 == 0 {
                            a.alloc(len)
                        } else {
                            a.alloc_zeroed(len)
                        };
                        if let Some(addr) = got {
                            let data = unsafe { bytes(addr, len) };
                            if i % 2 == 1 {
                                assert!(data.iter().all(|&b| b == 0));
                            }
                            data.fill(t as u8 + 1);
                            let info = a.lookup(addr).unwrap();
                            assert_eq!(info.len, len);
                            assert_eq!(
                                fs::metadata(&info.path).unwrap().len() as usize,
                                page + len
                            );
                            assert!(data.iter().all(|&b| b == t as u8 + 1));
                            assert!(a.free(addr));
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        let s = a.stats();
        assert_eq!((s.blocks, s.bytes), (0, 0));
        assert_eq!(s.allocated, s.freed);
        assert!(s.reused > 0);
        assert!(s.cached_bytes <= 16 * page);
        assert_eq!(lock(&a.state).bytes, s.cached_bytes);
        assert_eq!(entries(d.path()), s.cached_blocks);
        a.release_cache();
        assert_eq!(entries(d.path()), 0);
        assert_eq!(reserved(&a), (0, 0));
    }

    #[test]
    fn a_forked_child_never_reuses_unlinks_or_serves_the_parents_blocks() {
        let d = tmpfs_dir();
        let page = page_size();
        let a = cached_arena(d.path(), page, 1 << 30, 1 << 30);
        let len = 4 * page;
        let x = a.alloc(len).unwrap();
        unsafe { bytes(x, len).fill(1) };
        let x_path = a.lookup(x).unwrap().path;
        let y = a.alloc(len).unwrap();
        let y_path = a.lookup(y).unwrap().path;
        a.free(y);
        assert_eq!(a.stats().cached_blocks, 1);
        // SAFETY: the child only runs the code below and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = (|| {
                if a.alloc(len).is_some() || a.alloc_zeroed(len).is_some() {
                    return 1;
                }
                if a.seal(x, len, b"H").is_ok() || a.disown(x, &x_path).is_ok() {
                    return 2;
                }
                if a.realloc(x, 2 * len) != (Realloc::CopyOut { copy: len }) {
                    return 3;
                }
                // Freeing an inherited block neither caches nor unlinks it.
                if !a.free(x) || !x_path.exists() || a.stats().cached_blocks != 1 {
                    return 4;
                }
                a.release_cache();
                if !y_path.exists() {
                    return 5;
                }
                a.configure(&Settings {
                    directory: None,
                    threshold: page,
                    budget: 0,
                    max_blocks: 0,
                    reserve: true,
                    cache: 0,
                    cache_decay: Duration::from_secs(3600),
                });
                if !x_path.exists() || !y_path.exists() {
                    return 6;
                }
                0
            })();
            // SAFETY: leave the forked child without running the harness.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0);
        assert!(unsafe { bytes(x, len) }.iter().all(|&b| b == 1));
        assert_eq!(a.alloc(len), Some(y));
        assert_eq!(a.stats().reused, 1);
        a.free(x);
        a.free(y);
    }
}
