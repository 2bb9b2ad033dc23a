//! A directory of spill files, one per entry, with the ledger of their sizes.
//!
//! Guarantees:
//! - the directory is created with mode 0700 and must not be a symlink;
//! - files are created 0600 with `O_EXCL | O_NOFOLLOW` under a temporary name
//!   and appear under their final name only once completely written (hard link
//!   to the final name, which also refuses to overwrite an existing file), so a
//!   crash mid-write never leaves a half file that reads back as data;
//! - the `max_disk` check and the reservation of the bytes are one atomic step;
//! - every read validates the header against the file size, so a truncated,
//!   extended or foreign file is reported instead of being deserialized.
//!
//! Recycling (off unless opened with `open_recycling`): on a tmpfs, writing a
//! spill file costs mostly the kernel allocating fresh pages for it, and
//! deleting one costs freeing them. A recycling store keeps the files of
//! removed entries, up to a byte budget, under hidden pool names (`.pool-*`,
//! never entry names) and overwrites one of them instead of creating a new
//! file, reusing its already-allocated pages. Only files nobody else can see
//! are pooled: one hard link, never shared, never mapped by this store, no
//! read in progress. A store whose values are mapped must not recycle at all
//! (a `MAP_PRIVATE` mapping still reads the file for pages it has not yet
//! touched), which is why recycling is opt-in. A reused file is written
//! under a temporary name and published exactly like a fresh one, so the
//! crash guarantee above holds; pooled files are not entries (not in the
//! ledger, not in `names()`), are never read, and are deleted on drop.
//!
//! Nothing here touches Python: the binding's `store` module wraps it and releases the GIL
//! around every call that does I/O.

use std::fs::{self, File};
use std::io::{self, IoSlice, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use memmap2::{MmapMut, MmapOptions};

use crate::format::{self, FormatError, Layout};
use crate::fs::{create_private, open_nofollow, prepare_directory, write_all_vectored};
use crate::ledger::{Ledger, Sizes};
use crate::peer::PeerFile;
use crate::recycle::{open_recycled, overwrite, Pool, MIN_RECYCLE};
use crate::unlinker;

static ZEROS: [u8; format::ALIGN as usize] = [0; format::ALIGN as usize];

/// Distinguishes the hidden names of several stores of one process that
/// share a directory.
static STORE_IDS: AtomicU64 = AtomicU64::new(0);

#[derive(Debug)]
pub enum StoreError {
    /// The name is not in the store.
    Missing(String),
    /// The file exists but is not a valid spill file (truncated, corrupted, foreign).
    Corrupt {
        path: PathBuf,
        error: FormatError,
    },
    Io(io::Error),
}

impl From<io::Error> for StoreError {
    fn from(e: io::Error) -> Self {
        StoreError::Io(e)
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Missing(name) => write!(f, "no spill file named {name:?}"),
            StoreError::Corrupt { path, error } => {
                write!(f, "spill file {} is unreadable: {error}", path.display())
            }
            StoreError::Io(e) => write!(f, "{e}"),
        }
    }
}

pub enum PutOutcome {
    /// Written; the final file name and the bytes it occupies.
    Stored { name: String, disk: u64 },
    /// Not written: it would have taken the store past `max_disk`.
    OverCapacity,
}

pub struct FileStore {
    dir: PathBuf,
    ledger: Mutex<Ledger>,
    counter: AtomicU64,
    /// `{pid}-{store id}`: prefix of this store's hidden names.
    tag: String,
    /// Files kept for reuse; None when recycling is off.
    pool: Option<Mutex<Pool>>,
    /// Removed entries' files are deleted at `unlinker`'s pace: in the
    /// caller's thread, a burst's excess on the unlinking thread.
    defer_deletes: bool,
    /// The directory is on a RAM-backed file system (`fs::is_ram_backed`):
    /// its metadata operations never wait for a device.
    ram_backed: bool,
}

/// An entry forgotten by `FileStore::take_entry` whose file is still to be
/// deleted (`FileStore::delete_taken`).
pub struct TakenEntry {
    /// The sizes that were accounted for it.
    pub sizes: Sizes,
    path: PathBuf,
    /// Its file was this store's own (one link): it may be recycled.
    private: bool,
}

/// A copying read in progress: while it lives, removing the entry deletes
/// its file instead of recycling it.
pub struct EntryReader<'a> {
    store: &'a FileStore,
    name: String,
    pub file: File,
    pub size: u64,
}

impl Drop for EntryReader<'_> {
    fn drop(&mut self) {
        self.store.ledger().end_read(&self.name);
    }
}

impl Drop for FileStore {
    /// Delete the pooled files (entries' files stay, as they always have).
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            let mut pool = pool.lock().unwrap_or_else(|p| p.into_inner());
            for path in pool.trim_to(0) {
                let _ = fs::remove_file(path);
            }
        }
    }
}

/// Write `slices` into a new private file at `tmp`; nothing is left there on error.
fn write_fresh(tmp: &Path, slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut file = create_private(tmp)?;
    let written = write_all_vectored(&mut file, slices);
    drop(file);
    if written.is_err() {
        let _ = fs::remove_file(tmp);
    }
    written
}

/// ENOSPC or EDQUOT: the file system (or the user's quota) is full.
fn is_out_of_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// Reject anything that is not a plain, visible file name inside the directory.
pub fn check_name(name: &str) -> io::Result<()> {
    let bad = name.is_empty()
        || name.len() > 255
        || name.starts_with('.')
        || name.contains('/')
        || name.contains('\0');
    if bad {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("invalid spill file name {name:?}"),
        ));
    }
    Ok(())
}

/// Map the spill file at `path` copy-on-write (MAP_PRIVATE, readable and
/// writable: writes never reach the file) and validate its header against
/// its size. Refuses a symlink (`O_NOFOLLOW`). Errors: `Io` if it cannot be
/// opened or mapped, `Corrupt` (naming `path`) if it is truncated, corrupted
/// or not a spill file.
///
/// Only for files written by a `FileStore` (of any process): they are
/// created whole and only ever unlinked, never truncated, in a 0700
/// directory, so only this user could truncate one while it is mapped (reads
/// past the end would then fault with SIGBUS).
pub fn map_file(path: &Path) -> Result<(MmapMut, Layout), StoreError> {
    let corrupt = |error| StoreError::Corrupt {
        path: path.to_path_buf(),
        error,
    };
    let file = open_nofollow(path)?;
    let size = file.metadata()?.len();
    if size < 16 {
        return Err(corrupt(FormatError::TooShort { size }));
    }
    // SAFETY: the mapping is private and the file is never truncated (see above).
    let map = unsafe { MmapOptions::new().map_copy(&file)? };
    let layout = format::parse_layout(&map, size).map_err(corrupt)?;
    Ok((map, layout))
}

impl FileStore {
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<FileStore> {
        Self::open_recycling(dir, 0)
    }

    /// Open a store that keeps up to `recycle_bytes` bytes of removed
    /// entries' files for reuse (0: never). Only for stores whose files are
    /// read by copying: see the module documentation.
    pub fn open_recycling(dir: impl Into<PathBuf>, recycle_bytes: u64) -> io::Result<FileStore> {
        let dir = dir.into();
        prepare_directory(&dir)?;
        let id = STORE_IDS.fetch_add(1, Ordering::Relaxed);
        Ok(FileStore {
            ledger: Mutex::new(Ledger::new()),
            counter: AtomicU64::new(0),
            tag: format!("{}-{id}", std::process::id()),
            pool: (recycle_bytes > 0).then(|| {
                Mutex::new(Pool {
                    cap: recycle_bytes,
                    ..Pool::default()
                })
            }),
            ram_backed: crate::fs::is_ram_backed(&dir),
            dir,
            defer_deletes: false,
        })
    }

    /// Open a store whose removed entries' files are deleted at a pace (see
    /// `unlinker::unlink_paced`): in the caller's thread while its budget of
    /// unlink time lasts, else on another thread, where `remove` returns once
    /// the entry is no longer accounted and the file disappears shortly
    /// after (`unlinker::flush` waits for it). No recycling.
    pub fn open_deferring_deletes(dir: impl Into<PathBuf>) -> io::Result<FileStore> {
        let mut store = Self::open(dir)?;
        store.defer_deletes = true;
        Ok(store)
    }

    /// Files held for reuse and their bytes.
    pub fn pooled(&self) -> (usize, u64) {
        match self.pool() {
            Some(pool) => (pool.files.len(), pool.bytes),
            None => (0, 0),
        }
    }

    fn pool(&self) -> Option<MutexGuard<'_, Pool>> {
        // Poisoning is ignored for the same reason as the ledger's.
        let pool = self.pool.as_ref()?;
        Some(pool.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn directory(&self) -> &Path {
        &self.dir
    }

    /// Whether removed entries' files may be deleted on `unlinker`'s thread.
    pub fn defers_deletes(&self) -> bool {
        self.defer_deletes
    }

    /// Whether the directory is on a RAM-backed file system (tmpfs, ramfs,
    /// hugetlbfs), checked once when the store was opened.
    pub fn is_ram_backed(&self) -> bool {
        self.ram_backed
    }

    pub fn path_of(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        // A panic while holding the lock cannot leave the ledger half-updated
        // (every method is a few integer ops), so poisoning is ignored.
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Write `frames` to a new file named `{stem}#{n}` and account
    /// `memory` / its size. Refuses (without writing) if the store would exceed
    /// `max_disk` bytes.
    pub fn put(
        &self,
        stem: &str,
        frames: &[&[u8]],
        memory: u64,
        max_disk: Option<u64>,
    ) -> io::Result<PutOutcome> {
        let whole: Vec<[&[u8]; 1]> = frames.iter().map(|&f| [f]).collect();
        let gathered: Vec<&[&[u8]]> = whole.iter().map(|f| &f[..]).collect();
        self.put_gathered(stem, &gathered, memory, max_disk)
    }

    /// As [`put`](Self::put), each frame given as the pieces it is made of,
    /// in order (a strided array's runs, see `strided::c_order_runs`): the
    /// pieces are written back to back, and the file holds each frame as one
    /// frame of their total length, as if it had been copied together first.
    pub fn put_gathered(
        &self,
        stem: &str,
        frames: &[&[&[u8]]],
        memory: u64,
        max_disk: Option<u64>,
    ) -> io::Result<PutOutcome> {
        check_name(stem)?;
        let lengths: Vec<u64> = frames
            .iter()
            .map(|pieces| pieces.iter().map(|p| p.len() as u64).sum())
            .collect();
        let layout = Layout::for_lengths(&lengths);
        let disk = layout.file_size;
        if !self.ledger().try_reserve(disk, max_disk) {
            return Ok(PutOutcome::OverCapacity);
        }
        match self.write_new_file(stem, frames, &layout, max_disk) {
            Ok(name) => {
                self.ledger().commit(&name, Sizes { memory, disk });
                Ok(PutOutcome::Stored { name, disk })
            }
            Err(e) => {
                self.ledger().release(disk);
                Err(e)
            }
        }
    }

    /// Copy `len` bytes of `src` (a spill file of another store) into a new
    /// file `{stem}#{n}` and account `memory` / `len` for it (no capacity
    /// check: the bytes leave another tier). Nothing is left behind on error.
    pub fn put_copy(
        &self,
        stem: &str,
        src: &File,
        len: u64,
        memory: u64,
    ) -> io::Result<(String, u64)> {
        check_name(stem)?;
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".tmp-{}-{n}", self.tag));
        let mut file = create_private(&tmp)?;
        if let Err(e) = crate::fs::copy_file(src, &mut file, len) {
            drop(file);
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        drop(file);
        let name = self.publish_tmp(&tmp, stem, n)?;
        let mut ledger = self.ledger();
        ledger.try_reserve(len, None);
        ledger.commit(&name, Sizes { memory, disk: len });
        Ok((name, len))
    }

    fn write_new_file(
        &self,
        stem: &str,
        frames: &[&[&[u8]]],
        layout: &Layout,
        max_disk: Option<u64>,
    ) -> io::Result<String> {
        let header = layout.header_bytes();
        let pads = layout.padding();
        let pieces: usize = frames.iter().map(|f| f.len()).sum();
        let mut slices = Vec::with_capacity(pieces + frames.len() + 2);
        slices.push(IoSlice::new(&header));
        slices.push(IoSlice::new(&ZEROS[..pads[0] as usize]));
        for (frame, &pad) in frames.iter().zip(&pads[1..]) {
            slices.extend(frame.iter().map(|piece| IoSlice::new(piece)));
            if pad > 0 {
                slices.push(IoSlice::new(&ZEROS[..pad as usize]));
            }
        }
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".tmp-{}-{n}", self.tag));
        let recycled = self.take_pooled(&tmp, layout.file_size);
        self.trim_pool(max_disk);
        if let Some((mut file, meta)) = recycled {
            // `overwrite` advances the slices it is given: keep the originals
            // for a fresh write if it fails.
            match overwrite(&mut file, &meta, layout.file_size, &mut slices.clone()) {
                Ok(()) => {
                    drop(file);
                    return self.publish_tmp(&tmp, stem, n);
                }
                // Give the pooled file up and write a fresh one.
                Err(_) => {
                    drop(file);
                    let _ = fs::remove_file(&tmp);
                }
            }
        }
        match write_fresh(&tmp, &mut slices.clone()) {
            Ok(()) => return self.publish_tmp(&tmp, stem, n),
            // The pool's files hold the space this one needs: give them up.
            Err(e) if is_out_of_space(&e) && self.empty_pool() => {}
            Err(e) => return Err(e),
        }
        write_fresh(&tmp, &mut slices)?;
        self.publish_tmp(&tmp, stem, n)
    }

    /// Delete every pooled file; whether there was any.
    fn empty_pool(&self) -> bool {
        let victims = match self.pool() {
            Some(mut pool) => pool.trim_to(0),
            None => return false,
        };
        for path in &victims {
            let _ = fs::remove_file(path);
        }
        !victims.is_empty()
    }

    /// Publish the written temporary file and remove its temporary name.
    fn publish_tmp(&self, tmp: &Path, stem: &str, n: u64) -> io::Result<String> {
        let result = self.publish(tmp, stem, n);
        let _ = fs::remove_file(tmp);
        result
    }

    /// Move a pooled file suited to `need` bytes to the temporary name `tmp`
    /// and open it for overwriting; returns it with its metadata. None
    /// when recycling is off, nothing suits, or the pooled file is not fit
    /// for reuse (it is then deleted).
    fn take_pooled(&self, tmp: &Path, need: u64) -> Option<(File, fs::Metadata)> {
        let (_, path) = self.pool()?.take(need)?;
        if fs::rename(&path, tmp).is_err() {
            let _ = fs::remove_file(&path);
            return None;
        }
        match open_recycled(tmp) {
            Ok(opened) => Some(opened),
            Err(_) => {
                let _ = fs::remove_file(tmp);
                None
            }
        }
    }

    /// With a `max_disk` limit, delete pooled files (largest first) so that
    /// the directory (entries, writes in flight, pool) stays within it.
    fn trim_pool(&self, max_disk: Option<u64>) {
        let Some(max) = max_disk else { return };
        if self.pool.is_none() {
            return;
        }
        let used = {
            let ledger = self.ledger();
            ledger.total().disk + ledger.reserved_disk()
        };
        let victims = match self.pool() {
            Some(mut pool) => pool.trim_to(max.saturating_sub(used)),
            None => return,
        };
        for path in victims {
            let _ = fs::remove_file(path);
        }
    }

    /// Keep the file of a removed entry for reuse if it is still our private
    /// regular file and the pool has room; false if it was not kept (the
    /// caller deletes it).
    fn recycle(&self, path: &Path) -> bool {
        let Ok(meta) = fs::symlink_metadata(path) else {
            return false;
        };
        let size = meta.len();
        if !meta.file_type().is_file() || meta.nlink() != 1 || size < MIN_RECYCLE {
            return false;
        }
        if !self.pool().is_some_and(|mut pool| pool.admit(size)) {
            return false;
        }
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let dest = self.dir.join(format!(".pool-{}-{n}", self.tag));
        match fs::rename(path, &dest) {
            Ok(()) => {
                if let Some(mut pool) = self.pool() {
                    pool.insert(size, n, dest);
                }
                true
            }
            Err(_) => {
                if let Some(mut pool) = self.pool() {
                    pool.cancel(size);
                }
                false
            }
        }
    }

    /// Give the completed temporary file its final name without ever
    /// replacing an existing file (a stale file left by someone else makes us
    /// pick the next suffix).
    fn publish(&self, tmp: &Path, stem: &str, first: u64) -> io::Result<String> {
        self.link_new_name(stem, first, |dest| fs::hard_link(tmp, dest))
    }

    /// Call `link(path)` with `{stem}#{n}` for increasing n until it does not
    /// report that the name exists; returns the name it succeeded with.
    fn link_new_name(
        &self,
        stem: &str,
        first: u64,
        link: impl Fn(&Path) -> io::Result<()>,
    ) -> io::Result<String> {
        let mut n = first;
        for _ in 0..64 {
            let name = format!("{stem}#{n}");
            check_name(&name)?;
            match link(&self.dir.join(&name)) {
                Ok(()) => return Ok(name),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    n = self.counter.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("could not find a free file name for {stem:?}"),
        ))
    }

    /// Take a validated peer file into the store under `{stem}#{n}` by hard
    /// link (no bytes are copied) and account it as shared. Capacity
    /// (`max_disk`) is not checked: the bytes already exist on the host.
    pub fn adopt(&self, peer: &PeerFile, stem: &str, memory: u64) -> io::Result<(String, u64)> {
        check_name(stem)?;
        let disk = peer.layout.file_size;
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let name = self.link_new_name(stem, n, |dest| peer.link_to(dest))?;
        let links = self.links_on_disk(&name);
        let mut ledger = self.ledger();
        ledger.try_reserve(disk, None);
        ledger.commit(&name, Sizes { memory, disk });
        ledger.mark_shared(&name, links);
        Ok((name, disk))
    }

    /// Create one more hard link to a known entry, in `dir` (which must be on
    /// the same file system), so that the file outlives its removal from this
    /// store until the link is deleted. Marks the entry as shared.
    pub fn link_out(&self, name: &str, dir: &Path) -> Result<PathBuf, StoreError> {
        self.check_known(name)?;
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        // The store's tag, not only the pid: every store of a process links
        // into the same directory, each with a counter of its own.
        let dest = dir.join(format!("{}-{n}", self.tag));
        fs::hard_link(self.path_of(name), &dest)?;
        let links = self.links_on_disk(name);
        self.ledger().mark_shared(name, links);
        Ok(dest)
    }

    /// Change the memory size accounted for an entry; false if unknown.
    pub fn set_memory(&self, name: &str, memory: u64) -> bool {
        self.ledger().set_memory(name, memory)
    }

    /// Number of hard links of an entry's file (1 unless shared); also
    /// corrects the count the ledger knows for a shared entry.
    pub fn link_count(&self, name: &str) -> Result<u64, StoreError> {
        self.check_known(name)?;
        let links = fs::symlink_metadata(self.path_of(name))?.nlink();
        self.ledger().update_links(name, links);
        Ok(links)
    }

    /// Hard links of the file of `name` now (1 if it cannot be seen: a
    /// vanished file counts whole, as it did before).
    fn links_on_disk(&self, name: &str) -> u64 {
        fs::symlink_metadata(self.path_of(name))
            .map(|m| m.nlink().max(1))
            .unwrap_or(1)
    }

    /// Correct the link counts of the shared entries, which other processes
    /// change (a peer adopting or dropping its link, an outgoing link
    /// deleted): one `lstat` per shared entry, done without holding the
    /// ledger's lock, so it may run on any thread while the store is used.
    /// Returns how many counts changed. O(shared entries): callers run it off
    /// the event loop and rate-limit it.
    pub fn refresh_links(&self) -> usize {
        self.refresh_links_changed().len()
    }

    /// `refresh_links`, returning the entries whose count changed, each
    /// with its count now.
    pub fn refresh_links_changed(&self) -> Vec<(String, u64)> {
        let names = self.ledger().shared_names();
        let seen: Vec<(String, u64)> = names
            .into_iter()
            .map(|name| {
                let links = self.links_on_disk(&name);
                (name, links)
            })
            .collect();
        let mut ledger = self.ledger();
        seen.into_iter()
            .filter(|(name, links)| ledger.update_links(name, *links))
            .collect()
    }

    /// Entries whose link counts `refresh_links` checks.
    pub fn shared_len(&self) -> usize {
        self.ledger().shared_len()
    }

    fn check_known(&self, name: &str) -> Result<(), StoreError> {
        if self.ledger().contains(name) {
            Ok(())
        } else {
            Err(StoreError::Missing(name.to_owned()))
        }
    }

    fn corrupt(&self, name: &str, error: FormatError) -> StoreError {
        StoreError::Corrupt {
            path: self.path_of(name),
            error,
        }
    }

    /// Open a known entry for a copying read, counted as in progress until
    /// the returned reader is dropped.
    pub fn open_entry(&self, name: &str) -> Result<EntryReader<'_>, StoreError> {
        self.check_known(name)?;
        let file = open_nofollow(&self.path_of(name))?;
        // Counted only once the file is open, and only if the entry still
        // exists then: a removal in between could have recycled the file.
        if !self.ledger().begin_read(name) {
            return Err(StoreError::Missing(name.to_owned()));
        }
        let mut reader = EntryReader {
            store: self,
            name: name.to_owned(),
            file,
            size: 0,
        };
        // An error here drops `reader`, which ends the read.
        reader.size = reader.file.metadata()?.len();
        Ok(reader)
    }

    /// Read exactly `buf.len()` bytes of `file` into `buf` and parse the layout.
    pub fn read_into(
        &self,
        name: &str,
        file: &mut File,
        buf: &mut [u8],
    ) -> Result<Layout, StoreError> {
        let mut filled = 0;
        while filled < buf.len() {
            match file.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(self.corrupt(
                        name,
                        FormatError::SizeMismatch {
                            expected: buf.len() as u64,
                            actual: filled as u64,
                        },
                    ))
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        format::parse_layout(buf, buf.len() as u64).map_err(|e| self.corrupt(name, e))
    }

    /// Map a known entry copy-on-write (MAP_PRIVATE, readable and writable):
    /// writes through the mapping never reach the file.
    pub fn map(&self, name: &str) -> Result<(MmapMut, Layout), StoreError> {
        if self.pool.is_some() {
            // The mapping may outlive the entry: its file must never be reused.
            if !self.ledger().pin(name) {
                return Err(StoreError::Missing(name.to_owned()));
            }
        } else {
            self.check_known(name)?;
        }
        map_file(&self.path_of(name))
    }

    /// Remove an entry from the ledger and its file from the directory
    /// (recycling keeps the file under a pool name if it may). A file that is
    /// already gone is not an error; returns the sizes that were accounted,
    /// or None for an unknown name.
    pub fn remove(&self, name: &str) -> io::Result<Option<Sizes>> {
        let Some(taken) = self.take_entry(name) else {
            return Ok(None);
        };
        self.delete_taken(&taken)?;
        Ok(Some(taken.sizes))
    }

    /// The ledger half of `remove`: forget `name` and return what deleting
    /// its file needs (see `delete_taken`), or None for an unknown name. The
    /// file stays until then, so a caller can first decide how to run the
    /// deletion (from the sizes) without looking the entry up twice.
    pub fn take_entry(&self, name: &str) -> Option<TakenEntry> {
        let (sizes, private) = self.ledger().remove_entry(name)?;
        Some(TakenEntry {
            sizes,
            path: self.path_of(name),
            private,
        })
    }

    /// The file half of `remove`, for an entry from `take_entry`.
    pub fn delete_taken(&self, taken: &TakenEntry) -> io::Result<()> {
        self.pool_or_delete(&taken.path, taken.private, taken.sizes.disk)
            .map(|_| ())
    }

    /// Keep the file at `path` for reuse if `may_pool` and the pool takes it
    /// (see `recycle`), else delete it (a missing file is not an error; a
    /// deferring store hands a file of `bytes` to `unlinker::unlink_sized`).
    /// Returns whether it was pooled.
    fn pool_or_delete(&self, path: &Path, may_pool: bool, bytes: u64) -> io::Result<bool> {
        if may_pool && self.pool.is_some() && self.recycle(path) {
            return Ok(true);
        }
        if self.defer_deletes {
            return unlinker::unlink_sized(path.to_path_buf(), bytes).map(|()| false);
        }
        match fs::remove_file(path) {
            Ok(()) => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Stop accounting the entry `name` and leave its file alone (someone
    /// else now owns and will delete or reuse it); false if unknown.
    pub fn forget(&self, name: &str) -> bool {
        self.ledger().remove_entry(name).is_some()
    }

    /// Take the file `name` of this directory (an entry of this store, or a
    /// file another process wrote into the same directory) into the reuse
    /// pool, or delete it if the pool cannot keep it (no recycling, full, too
    /// small, not our private one-link file). Returns whether it was pooled;
    /// a missing file is not an error. The caller guarantees that nobody maps
    /// or reads the file any more: it will be overwritten in place.
    pub fn give_for_reuse(&self, name: &str) -> io::Result<bool> {
        check_name(name)?;
        self.ledger().remove_entry(name);
        self.pool_or_delete(&self.path_of(name), true, 0)
    }

    /// Accounted sizes of one entry (disk split among its last known number
    /// of hard links, see `refresh_links`).
    pub fn sizes(&self, name: &str) -> Option<Sizes> {
        let ledger = self.ledger();
        let sizes = ledger.get(name)?;
        let links = ledger.links(name)?;
        Some(Sizes {
            memory: sizes.memory,
            disk: sizes.disk / links,
        })
    }

    /// Sizes summed over all entries (disk of shared files split among their
    /// last known number of links). O(1): kept by the ledger.
    pub fn total(&self) -> Sizes {
        self.ledger().split_total()
    }

    pub fn len(&self) -> usize {
        self.ledger().len()
    }

    pub fn is_empty(&self) -> bool {
        self.ledger().is_empty()
    }

    pub fn names(&self) -> Vec<String> {
        self.ledger().names()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::is_ram_backed;
    use std::fs::OpenOptions;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;

    fn stored(outcome: PutOutcome) -> (String, u64) {
        match outcome {
            PutOutcome::Stored { name, disk } => (name, disk),
            PutOutcome::OverCapacity => panic!("unexpected OverCapacity"),
        }
    }

    fn read_back(store: &FileStore, name: &str) -> Vec<Vec<u8>> {
        let mut reader = store.open_entry(name).unwrap();
        let mut buf = vec![0u8; reader.size as usize];
        let layout = store.read_into(name, &mut reader.file, &mut buf).unwrap();
        layout
            .frames
            .iter()
            .map(|&(o, l)| buf[o as usize..(o + l) as usize].to_vec())
            .collect()
    }

    #[test]
    fn a_gathered_frame_is_stored_as_its_pieces_put_together() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path().join("spill")).unwrap();
        // more pieces than one writev takes (IOV_MAX, 1024)
        let rows: Vec<Vec<u8>> = (0..1029).map(|i| vec![i as u8; 100]).collect();
        let pieces: Vec<&[u8]> = rows.iter().map(|r| &r[..]).collect();
        let frames: [&[&[u8]]; 3] = [&[b"head"], &pieces, &[b"ta", b"il"]];
        let (name, disk) = stored(store.put_gathered("g", &frames, 1, None).unwrap());
        assert_eq!(
            read_back(&store, &name),
            vec![b"head".to_vec(), rows.concat(), b"tail".to_vec()]
        );
        // the same file as a put of the frames copied together
        let whole = rows.concat();
        let (other, other_disk) = stored(
            store
                .put("c", &[b"head", &whole, b"tail"], 1, None)
                .unwrap(),
        );
        assert_eq!(disk, other_disk);
        assert_eq!(
            fs::read(store.path_of(&name)).unwrap(),
            fs::read(store.path_of(&other)).unwrap()
        );
    }

    #[test]
    fn put_get_remove_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path().join("spill")).unwrap();
        let a = vec![1u8; format::ALIGN_MIN_LEN as usize + 1000];
        let (name, disk) = stored(store.put("x", &[b"head", &a], 5000, None).unwrap());
        assert_eq!(name, "x#0");
        let meta = fs::metadata(store.path_of(&name)).unwrap();
        assert_eq!(meta.len(), disk);
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let dmeta = fs::metadata(store.directory()).unwrap();
        assert_eq!(dmeta.permissions().mode() & 0o777, 0o700);
        assert_eq!(read_back(&store, &name), vec![b"head".to_vec(), a.clone()]);

        let (map, layout) = store.map(&name).unwrap();
        for &(off, len) in &layout.frames {
            if len >= format::ALIGN_MIN_LEN {
                assert_eq!((map.as_ptr() as usize + off as usize) % 64, 0);
            }
            assert!(len == 4 || len == a.len() as u64);
        }
        assert_eq!(store.total(), Sizes { memory: 5000, disk });
        assert_eq!(
            store.remove(&name).unwrap(),
            Some(Sizes { memory: 5000, disk })
        );
        assert!(!store.path_of(&name).exists());
        assert_eq!(store.total(), Sizes::default());
        // The mapping outlives the file (Unix semantics).
        assert_eq!(&map[layout.frames[1].0 as usize..][..3], &[1, 1, 1]);
        // Only the published file was ever visible: no temporaries remain.
        assert_eq!(fs::read_dir(store.directory()).unwrap().count(), 0);
    }

    #[test]
    fn a_taken_entry_is_forgotten_at_once_and_its_file_deleted_later() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path().join("spill")).unwrap();
        let (name, disk) = stored(store.put("x", &[&[3u8; 5000]], 700, None).unwrap());
        let taken = store.take_entry(&name).unwrap();
        assert_eq!(taken.sizes, Sizes { memory: 700, disk });
        assert_eq!(store.total(), Sizes::default());
        assert!(store.take_entry(&name).is_none());
        assert_eq!(store.remove(&name).unwrap(), None);
        assert!(store.path_of(&name).exists());
        store.delete_taken(&taken).unwrap();
        assert!(!store.path_of(&name).exists());
        store.delete_taken(&taken).unwrap(); // already gone: not an error
    }

    #[test]
    fn stores_of_one_process_link_out_into_one_directory() {
        // Each store counts its links from 1: the names once collided.
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        prepare_directory(&out).unwrap();
        let one = FileStore::open(tmp.path().join("one")).unwrap();
        let two = FileStore::open(tmp.path().join("two")).unwrap();
        let (a, _) = stored(one.put("a", &[&[1u8; 100]], 1, None).unwrap());
        let (b, _) = stored(two.put("b", &[&[2u8; 100]], 1, None).unwrap());
        let first = one.link_out(&a, &out).unwrap();
        let second = two.link_out(&b, &out).unwrap();
        assert_ne!(first, second);
    }

    #[test]
    fn totals_split_shared_files_and_refresh_corrects_link_counts() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path().join("s")).unwrap();
        let out = tmp.path().join("out");
        prepare_directory(&out).unwrap();
        let (a, disk) = stored(store.put("a", &[&[1u8; 4000]], 10, None).unwrap());
        let (b, _) = stored(store.put("b", &[&[2u8; 4000]], 10, None).unwrap());
        assert_eq!(
            store.total(),
            Sizes {
                memory: 20,
                disk: 2 * disk
            }
        );
        // handed out: the store sees the second link at once
        let handle = store.link_out(&a, &out).unwrap();
        assert_eq!(store.total().disk, disk / 2 + disk);
        assert_eq!(store.sizes(&a).unwrap().disk, disk / 2);
        // a peer links it too and the handle goes: invisible until a refresh
        let peer = out.join("peer");
        fs::hard_link(store.path_of(&a), &peer).unwrap();
        fs::remove_file(&handle).unwrap();
        assert_eq!(store.total().disk, disk / 2 + disk);
        assert_eq!(store.shared_len(), 1);
        assert_eq!(store.refresh_links(), 0, "still 2 links");
        fs::remove_file(&peer).unwrap();
        assert_eq!(store.refresh_links(), 1);
        assert_eq!(store.total().disk, 2 * disk);
        // link_count corrects it as well
        fs::hard_link(store.path_of(&a), &peer).unwrap();
        fs::hard_link(store.path_of(&a), out.join("third")).unwrap();
        assert_eq!(store.link_count(&a).unwrap(), 3);
        assert_eq!(store.total().disk, disk / 3 + disk);
        // an unshared entry is never stat'ed, a removed one leaves no trace
        fs::hard_link(store.path_of(&b), out.join("b")).unwrap();
        assert_eq!(store.refresh_links(), 0);
        store.remove(&a).unwrap();
        assert_eq!(store.total(), Sizes { memory: 10, disk });
        assert_eq!(store.shared_len(), 0);
    }

    #[test]
    fn private_mapping_writes_do_not_reach_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let (name, _) = stored(store.put("k", &[&[7u8; 100]], 1, None).unwrap());
        let (mut map, layout) = store.map(&name).unwrap();
        let off = layout.frames[0].0 as usize;
        map[off] = 42;
        assert_eq!(read_back(&store, &name)[0][0], 7);
    }

    #[test]
    fn max_disk_refuses_without_writing() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let (_, disk) = stored(store.put("a", &[&[0u8; 100]], 1, Some(1000)).unwrap());
        let big = vec![0u8; 1000];
        assert!(matches!(
            store.put("b", &[&big], 1, Some(1000)).unwrap(),
            PutOutcome::OverCapacity
        ));
        assert_eq!(store.total().disk, disk);
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn truncated_and_deleted_files_are_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let (name, disk) = stored(store.put("t", &[&[3u8; 500]], 1, None).unwrap());
        let f = OpenOptions::new()
            .write(true)
            .open(store.path_of(&name))
            .unwrap();
        f.set_len(disk - 10).unwrap();
        let mut reader = store.open_entry(&name).unwrap();
        let mut buf = vec![0u8; reader.size as usize];
        assert!(matches!(
            store.read_into(&name, &mut reader.file, &mut buf),
            Err(StoreError::Corrupt { .. })
        ));
        assert!(matches!(store.map(&name), Err(StoreError::Corrupt { .. })));
        fs::remove_file(store.path_of(&name)).unwrap();
        assert!(matches!(store.open_entry(&name), Err(StoreError::Io(_))));
        // Removing an entry whose file vanished still fixes the accounting.
        assert!(store.remove(&name).unwrap().is_some());
        assert_eq!(store.total(), Sizes::default());
        assert!(matches!(
            store.open_entry(&name),
            Err(StoreError::Missing(_))
        ));
    }

    #[test]
    fn stale_file_with_the_same_name_is_not_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("s#0"), b"someone else's").unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let (name, _) = stored(store.put("s", &[b"mine"], 1, None).unwrap());
        assert_ne!(name, "s#0");
        assert_eq!(fs::read(tmp.path().join("s#0")).unwrap(), b"someone else's");
    }

    #[test]
    fn bad_names_and_symlinked_directories_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path().join("d")).unwrap();
        for bad in ["", "../x", "a/b", ".hidden"] {
            assert!(store.put(bad, &[b"x"], 1, None).is_err(), "{bad:?}");
        }
        std::os::unix::fs::symlink(tmp.path().join("d"), tmp.path().join("link")).unwrap();
        assert!(FileStore::open(tmp.path().join("link")).is_err());
    }

    #[test]
    fn many_frames_exceed_iov_max() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let frames: Vec<Vec<u8>> = (0..3000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
        let (name, _) = stored(store.put("many", &refs, 1, None).unwrap());
        assert_eq!(read_back(&store, &name), frames);
    }

    #[test]
    fn concurrent_puts_and_removes_keep_totals_consistent() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::open(tmp.path()).unwrap());
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    let mut kept = 0;
                    for i in 0..200 {
                        let data = vec![t as u8; 100 + i];
                        let stem = format!("k{t}-{i}");
                        if let PutOutcome::Stored { name, .. } =
                            store.put(&stem, &[&data], 10, Some(200_000)).unwrap()
                        {
                            if i % 2 == 0 {
                                store.remove(&name).unwrap();
                            } else {
                                kept += 1;
                            }
                        }
                    }
                    kept
                })
            })
            .collect();
        let kept: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(store.len(), kept);
        let on_disk: u64 = store
            .names()
            .iter()
            .map(|n| fs::metadata(store.path_of(n)).unwrap().len())
            .sum();
        assert_eq!(store.total().disk, on_disk);
        assert!(on_disk <= 200_000);
    }

    #[test]
    fn shared_files_split_their_disk_size_among_links() {
        let tmp = tempfile::tempdir().unwrap();
        let base = crate::peer::user_dir(tmp.path());
        let a = FileStore::open(base.join("a")).unwrap();
        let b = FileStore::open(base.join("b")).unwrap();
        let out = base.join("out");
        prepare_directory(&out).unwrap();
        let (name, disk) = stored(a.put("k", &[&[1u8; 1000]], 5000, None).unwrap());
        assert_eq!(a.total(), Sizes { memory: 5000, disk });
        let handle = a.link_out(&name, &out).unwrap();
        let peer = crate::peer::open_peer_file(tmp.path(), &handle, disk).unwrap();
        let (adopted, adopted_disk) = b.adopt(&peer, "k", 5000).unwrap();
        assert_eq!(adopted_disk, disk);
        fs::remove_file(&handle).unwrap();
        // two holders: each accounts half, and the host total is the file
        // once (the handle's removal is seen once link counts are refreshed)
        assert_eq!(a.link_count(&name).unwrap(), 2);
        assert_eq!(b.refresh_links(), 1);
        assert_eq!(a.total().disk + b.total().disk, disk);
        assert_eq!(b.sizes(&adopted).unwrap().disk, disk / 2);
        assert!(b.set_memory(&adopted, 10));
        assert_eq!(b.total().memory, 10);
        a.remove(&name).unwrap();
        assert_eq!(b.total().disk, disk / 2);
        b.refresh_links();
        assert_eq!(b.total().disk, disk);
        assert_eq!(read_back(&b, &adopted), vec![vec![1u8; 1000]]);
    }

    // ---- recycling ----

    const KIB: usize = 1024;

    /// Directories to run recycling tests in: a disk directory and, when
    /// available, a tmpfs one.
    fn recycle_dirs() -> Vec<tempfile::TempDir> {
        let mut dirs = vec![tempfile::tempdir().unwrap()];
        if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
            if is_ram_backed(shm.path()) {
                dirs.push(shm);
            }
        }
        dirs
    }

    /// Frames of `len` payload bytes whose content depends on `seed`.
    fn pattern(seed: u8, len: usize) -> Vec<Vec<u8>> {
        let payload = (0..len)
            .map(|i| (i as u8) ^ seed.wrapping_mul(31))
            .collect();
        vec![vec![seed; 7], payload]
    }

    #[test]
    fn a_store_knows_whether_it_is_on_a_ram_backed_file_system() {
        for dir in recycle_dirs() {
            let store = FileStore::open(dir.path().join("spill")).unwrap();
            assert_eq!(store.is_ram_backed(), is_ram_backed(dir.path()));
        }
        if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
            if is_ram_backed(shm.path()) {
                assert!(FileStore::open(shm.path().join("s"))
                    .unwrap()
                    .is_ram_backed());
            }
        }
    }

    #[test]
    fn forget_drops_the_entry_and_keeps_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path().join("spill")).unwrap();
        let (name, _) = put_frames(&store, "x", &[vec![7u8; 5000]]);
        assert!(store.forget(&name));
        assert!(!store.forget(&name));
        assert!(store.is_empty());
        assert_eq!(store.total().disk, 0);
        assert!(store.path_of(&name).exists());
    }

    fn put_frames(store: &FileStore, stem: &str, frames: &[Vec<u8>]) -> (String, u64) {
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
        stored(store.put(stem, &refs, 1, None).unwrap())
    }

    /// Names in the store's directory: (entries, hidden pool files, other hidden).
    fn listing(store: &FileStore) -> (Vec<String>, Vec<String>, Vec<String>) {
        let (mut entries, mut pool, mut other) = (vec![], vec![], vec![]);
        for e in fs::read_dir(store.directory()).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.starts_with(".pool-") {
                pool.push(name);
            } else if name.starts_with('.') {
                other.push(name);
            } else {
                entries.push(name);
            }
        }
        entries.sort();
        (entries, pool, other)
    }

    fn only_pool_file(store: &FileStore) -> PathBuf {
        let (_, pool, _) = listing(store);
        assert_eq!(pool.len(), 1, "{pool:?}");
        store.directory().join(&pool[0])
    }

    #[test]
    fn pool_takes_the_best_fit_or_extends_the_largest_smaller_file() {
        let mut pool = Pool {
            cap: 1 << 30,
            ..Pool::default()
        };
        for (n, size) in [(0, 100), (1, 300), (2, 1000)] {
            assert!(pool.admit(size));
            pool.insert(size, n, PathBuf::from(format!("p{n}")));
        }
        // smallest that holds it, at most twice as large
        assert_eq!(pool.take(250), Some((300, PathBuf::from("p1"))));
        // 1000 is more than twice 400: extend the largest smaller one
        assert_eq!(pool.take(400), Some((100, PathBuf::from("p0"))));
        // nothing smaller left, and 1000 > 2 * 50
        assert_eq!(pool.take(50), None);
        assert_eq!(pool.take(600), Some((1000, PathBuf::from("p2"))));
        assert_eq!(pool.bytes, 0);
        assert!(pool.take(1).is_none());
        // admissions count against the cap before the file is inserted
        pool.cap = 500;
        assert!(pool.admit(300));
        assert!(!pool.admit(300));
        pool.cancel(300);
        assert!(pool.admit(500));
    }

    #[test]
    fn recycled_files_read_back_correctly_through_many_cycles() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path().join("s"), 64 << 20).unwrap();
            // bigger and smaller than the file that is in the pool each time
            let sizes = [
                600 * KIB,
                300 * KIB,
                2048 * KIB,
                1000 * KIB,
                1001 * KIB,
                4096 * KIB,
                257 * KIB,
                3000 * KIB,
                100 * KIB,
                700 * KIB,
            ];
            let mut live: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
            for round in 0..60usize {
                let frames = pattern(round as u8, sizes[round % sizes.len()] + round);
                let (name, disk) = put_frames(&store, &format!("k{round}"), &frames);
                assert_eq!(fs::metadata(store.path_of(&name)).unwrap().len(), disk);
                live.push((name, frames));
                if live.len() > 2 {
                    let (old, frames) = live.remove(round % 3 % live.len());
                    assert_eq!(read_back(&store, &old), frames);
                    store.remove(&old).unwrap().unwrap();
                }
                for (name, frames) in &live {
                    assert_eq!(&read_back(&store, name), frames, "{}", dir.path().display());
                }
                // pool files are not entries
                let (entries, pool, other) = listing(&store);
                let mut names = store.names();
                names.sort();
                assert_eq!(entries, names);
                assert_eq!(pool.len(), store.pooled().0);
                assert!(other.is_empty(), "{other:?}");
                let on_disk: u64 = names
                    .iter()
                    .map(|n| fs::metadata(store.path_of(n)).unwrap().len())
                    .sum();
                assert_eq!(store.total().disk, on_disk);
            }
            assert!(store.pooled().0 > 0);
            for (name, _) in live {
                store.remove(&name).unwrap();
            }
            let dir_path = store.directory().to_path_buf();
            drop(store);
            // dropping the store deletes the pool; no entries were left
            assert_eq!(fs::read_dir(&dir_path).unwrap().count(), 0);
        }
    }

    #[test]
    fn pool_is_bounded_and_small_files_are_not_kept() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path(), 1 << 20).unwrap();
            let names: Vec<String> = (0..4)
                .map(|i| put_frames(&store, &format!("b{i}"), &pattern(i, 400 * KIB)).0)
                .collect();
            let (small, _) = put_frames(&store, "small", &pattern(9, 10 * KIB));
            for name in names.iter().chain([&small]) {
                store.remove(name).unwrap();
            }
            // two 400 KiB files fit in 1 MiB, a third does not; the small one is deleted
            let (count, bytes) = store.pooled();
            assert_eq!(count, 2);
            assert!(bytes <= 1 << 20);
            let (entries, pool, _) = listing(&store);
            assert!(entries.is_empty());
            assert_eq!(pool.len(), 2);
            assert_eq!(store.total(), Sizes::default());
            assert!(store.names().is_empty());
        }
    }

    #[test]
    fn files_given_for_reuse_are_overwritten_by_the_next_put() {
        for dir in recycle_dirs() {
            let writer = FileStore::open(dir.path()).unwrap();
            let reuser = FileStore::open_recycling(dir.path(), 8 << 20).unwrap();
            let (theirs, _) = put_frames(&writer, "a", &pattern(1, 600 * KIB));
            let (mine, _) = put_frames(&reuser, "b", &pattern(2, 600 * KIB));
            let (small, _) = put_frames(&writer, "c", &pattern(3, 10 * KIB));
            assert!(reuser.give_for_reuse(&theirs).unwrap());
            assert!(reuser.give_for_reuse(&mine).unwrap());
            assert!(
                !reuser.give_for_reuse(&small).unwrap(),
                "too small: deleted"
            );
            assert!(!reuser.give_for_reuse("gone#0").unwrap());
            assert!(reuser.give_for_reuse("../x").is_err());
            assert!(reuser.names().is_empty(), "no longer an entry");
            assert_eq!(reuser.pooled().0, 2);
            let frames = pattern(4, 590 * KIB);
            let (name, _) = put_frames(&reuser, "d", &frames);
            assert_eq!(reuser.pooled().0, 1, "a pooled file was overwritten");
            assert_eq!(read_back(&reuser, &name), frames);
            let (entries, _, _) = listing(&reuser);
            assert_eq!(entries, vec![name]);
        }
    }

    #[test]
    fn stores_without_recycling_delete_files() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let (name, _) = put_frames(&store, "a", &pattern(1, 1 << 20));
        store.remove(&name).unwrap();
        assert_eq!(store.pooled(), (0, 0));
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn max_disk_counts_the_pool() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path(), 64 << 20).unwrap();
            let names: Vec<String> = (0..3)
                .map(|i| put_frames(&store, &format!("p{i}"), &pattern(i, 400 * KIB)).0)
                .collect();
            for name in &names {
                store.remove(name).unwrap();
            }
            assert_eq!(store.pooled().0, 3);
            let limit = 1000 * KIB as u64;
            let data = vec![5u8; 900 * KIB];
            let (name, disk) = stored(store.put("big", &[&data], 1, Some(limit)).unwrap());
            let dir_bytes: u64 = fs::read_dir(store.directory())
                .unwrap()
                .map(|e| e.unwrap().metadata().unwrap().len())
                .sum();
            assert!(dir_bytes <= limit, "{dir_bytes} > {limit}");
            assert_eq!(store.total().disk, disk);
            assert_eq!(read_back(&store, &name), vec![data]);
        }
    }

    #[test]
    fn mapped_entries_are_never_recycled() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path(), 64 << 20).unwrap();
            let frames = pattern(3, 1 << 20);
            let (name, _) = put_frames(&store, "m", &frames);
            let (map, layout) = store.map(&name).unwrap();
            store.remove(&name).unwrap();
            assert_eq!(store.pooled(), (0, 0));
            for i in 0..4 {
                let (other, _) = put_frames(&store, &format!("o{i}"), &pattern(i + 10, 1 << 20));
                store.remove(&other).unwrap();
            }
            let (off, len) = layout.frames[1];
            assert_eq!(&map[off as usize..(off + len) as usize], &frames[1][..]);
        }
    }

    #[test]
    fn shared_linked_and_busy_files_are_never_recycled() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path().join("s"), 64 << 20).unwrap();
            let out = dir.path().join("out");
            prepare_directory(&out).unwrap();
            // handed out to a peer (even once the handle is gone again)
            let (shared, _) = put_frames(&store, "shared", &pattern(1, 1 << 20));
            let handle = store.link_out(&shared, &out).unwrap();
            fs::remove_file(handle).unwrap();
            store.remove(&shared).unwrap();
            // hard-linked behind our back
            let (linked, _) = put_frames(&store, "linked", &pattern(2, 1 << 20));
            let other = out.join("other");
            fs::hard_link(store.path_of(&linked), &other).unwrap();
            store.remove(&linked).unwrap();
            // removed while a copying read is in progress
            let (busy, _) = put_frames(&store, "busy", &pattern(3, 1 << 20));
            let reader = store.open_entry(&busy).unwrap();
            store.remove(&busy).unwrap();
            assert_eq!(store.pooled(), (0, 0));
            drop(reader);
            // the ended read does not keep later files from the pool
            let (plain, _) = put_frames(&store, "plain", &pattern(4, 1 << 20));
            store.remove(&plain).unwrap();
            assert_eq!(store.pooled().0, 1);
            assert_eq!(fs::read(&other).unwrap().len() as u64, {
                let frames = pattern(2, 1 << 20);
                let lengths: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
                Layout::for_lengths(&lengths).file_size
            });
        }
    }

    #[test]
    fn a_read_in_progress_keeps_its_bytes() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path(), 64 << 20).unwrap();
            let frames = pattern(7, 1 << 20);
            let (name, _) = put_frames(&store, "r", &frames);
            let mut reader = store.open_entry(&name).unwrap();
            store.remove(&name).unwrap();
            let (next, _) = put_frames(&store, "w", &pattern(8, 1 << 20));
            let mut buf = vec![0u8; reader.size as usize];
            reader.file.read_exact(&mut buf).unwrap();
            let layout = format::parse_layout(&buf, buf.len() as u64).unwrap();
            let (off, len) = layout.frames[1];
            assert_eq!(&buf[off as usize..(off + len) as usize], &frames[1][..]);
            assert!(read_back(&store, &next)[0] == vec![8u8; 7]);
        }
    }

    #[test]
    fn truncated_or_holed_pool_files_are_rewritten_whole() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path(), 64 << 20).unwrap();
            for (i, cut) in [(0u8, 1000u64), (1, 0), (2, 5000)].into_iter() {
                let (name, _) = put_frames(&store, &format!("t{i}"), &pattern(i, 1 << 20));
                store.remove(&name).unwrap();
                let pooled = only_pool_file(&store);
                let f = OpenOptions::new().write(true).open(&pooled).unwrap();
                f.set_len(cut).unwrap();
                if i == 2 {
                    // back to full size, with a hole the write fills
                    f.set_len(2 << 20).unwrap();
                }
                drop(f);
                let frames = pattern(i + 100, 1 << 20);
                let (name, disk) = put_frames(&store, &format!("u{i}"), &frames);
                assert_eq!(fs::metadata(store.path_of(&name)).unwrap().len(), disk);
                assert_eq!(read_back(&store, &name), frames);
                store.remove(&name).unwrap();
                // only the file just removed is pooled: the cut one was reused
                only_pool_file(&store);
                // start the next case from an empty pool
                fs::remove_file(only_pool_file(&store)).unwrap();
                store.pool().unwrap().trim_to(0);
            }
        }
    }

    #[test]
    fn a_pool_file_replaced_by_a_symlink_is_not_followed() {
        for dir in recycle_dirs() {
            let store = FileStore::open_recycling(dir.path().join("s"), 64 << 20).unwrap();
            let victim = dir.path().join("victim");
            fs::write(&victim, vec![1u8; 2 << 20]).unwrap();
            let (name, _) = put_frames(&store, "a", &pattern(1, 1 << 20));
            store.remove(&name).unwrap();
            let pooled = only_pool_file(&store);
            fs::remove_file(&pooled).unwrap();
            std::os::unix::fs::symlink(&victim, &pooled).unwrap();
            let frames = pattern(2, 1 << 20);
            let (name, _) = put_frames(&store, "b", &frames);
            assert_eq!(read_back(&store, &name), frames);
            assert!(!fs::symlink_metadata(store.path_of(&name))
                .unwrap()
                .file_type()
                .is_symlink());
            assert_eq!(fs::read(&victim).unwrap(), vec![1u8; 2 << 20]);
            // the symlink was given up, not kept
            let (entries, pool, other) = listing(&store);
            assert_eq!(entries, vec![name]);
            assert!(pool.is_empty() && other.is_empty());
            assert_eq!(store.pooled(), (0, 0));
        }
    }

    #[test]
    fn concurrent_recycling_keeps_values_and_totals() {
        for dir in recycle_dirs() {
            let store = Arc::new(FileStore::open_recycling(dir.path(), 8 << 20).unwrap());
            let handles: Vec<_> = (0..4u8)
                .map(|t| {
                    let store = Arc::clone(&store);
                    std::thread::spawn(move || {
                        let mut kept = Vec::new();
                        for i in 0..40usize {
                            let frames = pattern(t * 50 + i as u8, 256 * KIB + (i % 7) * 100 * KIB);
                            let (name, _) = put_frames(&store, &format!("k{t}-{i}"), &frames);
                            assert_eq!(read_back(&store, &name), frames);
                            if i % 3 == 0 {
                                kept.push((name, frames));
                            } else {
                                store.remove(&name).unwrap();
                            }
                        }
                        for (name, frames) in &kept {
                            assert_eq!(&read_back(&store, name), frames);
                        }
                        kept.len()
                    })
                })
                .collect();
            let kept: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
            assert_eq!(store.len(), kept);
            let (entries, pool, other) = listing(&store);
            assert_eq!(entries.len(), kept);
            assert_eq!(pool.len(), store.pooled().0);
            assert!(store.pooled().1 <= 8 << 20);
            assert!(other.is_empty());
        }
    }
}
