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
//! Nothing here touches Python: `py_store` wraps it and releases the GIL
//! around every call that does I/O.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, IoSlice, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use memmap2::{MmapMut, MmapOptions};

use crate::format::{self, FormatError, Layout};
use crate::ledger::{Ledger, Sizes};
use crate::peer::PeerFile;

/// Linux refuses `writev` with more than this many buffers.
const IOV_MAX: usize = 1024;
static ZEROS: [u8; format::ALIGN as usize] = [0; format::ALIGN as usize];

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

/// Create `dir` (mode 0700) or accept an existing directory that is not a
/// symlink and belongs to this user.
pub fn prepare_directory(dir: &Path) -> io::Result<()> {
    if let Some(parent) = dir.parent() {
        if !parent.as_os_str().is_empty() {
            fs::create_dir_all(parent)?;
        }
    }
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = fs::symlink_metadata(dir)?;
    if meta.file_type().is_symlink() || !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("spill directory {} is not a plain directory", dir.display()),
        ));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "spill directory {} belongs to uid {}, not to this user (uid {me})",
                dir.display(),
                meta.uid()
            ),
        ));
    }
    Ok(())
}

fn open_nofollow_read(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// `writev` until every byte of `slices` is written.
fn write_all_vectored(file: &mut File, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        let batch = slices.len().min(IOV_MAX);
        match file.write_vectored(&slices[..batch]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "write returned 0")),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl FileStore {
    pub fn open(dir: impl Into<PathBuf>) -> io::Result<FileStore> {
        let dir = dir.into();
        prepare_directory(&dir)?;
        Ok(FileStore {
            dir,
            ledger: Mutex::new(Ledger::new()),
            counter: AtomicU64::new(0),
        })
    }

    pub fn directory(&self) -> &Path {
        &self.dir
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
        check_name(stem)?;
        let lengths: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
        let layout = Layout::for_lengths(&lengths);
        let disk = layout.file_size;
        if !self.ledger().try_reserve(disk, max_disk) {
            return Ok(PutOutcome::OverCapacity);
        }
        match self.write_new_file(stem, frames, &layout) {
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

    fn write_new_file(&self, stem: &str, frames: &[&[u8]], layout: &Layout) -> io::Result<String> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".tmp-{}-{n}", std::process::id()));
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        let result = (|| {
            let header = layout.header_bytes();
            let pads = layout.padding();
            let mut slices = Vec::with_capacity(2 * frames.len() + 2);
            slices.push(IoSlice::new(&header));
            slices.push(IoSlice::new(&ZEROS[..pads[0] as usize]));
            for (frame, &pad) in frames.iter().zip(&pads[1..]) {
                slices.push(IoSlice::new(frame));
                if pad > 0 {
                    slices.push(IoSlice::new(&ZEROS[..pad as usize]));
                }
            }
            write_all_vectored(&mut file, &mut slices)?;
            drop(file);
            self.publish(&tmp, stem, n)
        })();
        let _ = fs::remove_file(&tmp);
        result
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
        let mut ledger = self.ledger();
        ledger.try_reserve(disk, None);
        ledger.commit(&name, Sizes { memory, disk });
        ledger.mark_shared(&name);
        Ok((name, disk))
    }

    /// Create one more hard link to a known entry, in `dir` (which must be on
    /// the same file system), so that the file outlives its removal from this
    /// store until the link is deleted. Marks the entry as shared.
    pub fn link_out(&self, name: &str, dir: &Path) -> Result<PathBuf, StoreError> {
        self.check_known(name)?;
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let dest = dir.join(format!("{}-{n}", std::process::id()));
        fs::hard_link(self.path_of(name), &dest)?;
        self.ledger().mark_shared(name);
        Ok(dest)
    }

    /// Change the memory size accounted for an entry; false if unknown.
    pub fn set_memory(&self, name: &str, memory: u64) -> bool {
        self.ledger().set_memory(name, memory)
    }

    /// Number of hard links of an entry's file (1 unless shared).
    pub fn link_count(&self, name: &str) -> Result<u64, StoreError> {
        self.check_known(name)?;
        Ok(fs::symlink_metadata(self.path_of(name))?.nlink())
    }

    /// Disk size split among the hard links of a shared file: each of k
    /// holders accounts 1/k, so totals over the host add up to the bytes used.
    fn split(&self, name: &str, sizes: Sizes) -> Sizes {
        let links = fs::symlink_metadata(self.path_of(name))
            .map(|m| m.nlink().max(1))
            .unwrap_or(1);
        Sizes {
            memory: sizes.memory,
            disk: sizes.disk / links,
        }
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

    /// Open a known entry for a copying read; returns the file and its size.
    pub fn open_entry(&self, name: &str) -> Result<(File, u64), StoreError> {
        self.check_known(name)?;
        let file = open_nofollow_read(&self.path_of(name))?;
        let size = file.metadata()?.len();
        Ok((file, size))
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
        self.check_known(name)?;
        let file = open_nofollow_read(&self.path_of(name))?;
        let size = file.metadata()?.len();
        if size < 16 {
            return Err(self.corrupt(name, FormatError::TooShort { size }));
        }
        // SAFETY: the mapping is private; if another process truncates the file
        // while mapped, reads past the end fault (SIGBUS). Our files are only
        // ever created whole and unlinked, never truncated, and the directory
        // is 0700, so only this user could do that.
        let map = unsafe { MmapOptions::new().map_copy(&file)? };
        let layout = format::parse_layout(&map, size).map_err(|e| self.corrupt(name, e))?;
        Ok((map, layout))
    }

    /// Remove an entry from the ledger and its file from the directory.
    /// A file that is already gone is not an error; returns the sizes
    /// that were accounted, or None for an unknown name.
    pub fn remove(&self, name: &str) -> io::Result<Option<Sizes>> {
        let sizes = self.ledger().remove(name);
        if sizes.is_some() {
            match fs::remove_file(self.path_of(name)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(sizes)
    }

    /// Accounted sizes of one entry (disk split among hard links if shared).
    pub fn sizes(&self, name: &str) -> Option<Sizes> {
        let (sizes, shared) = {
            let ledger = self.ledger();
            (ledger.get(name)?, ledger.is_shared(name))
        };
        Some(if shared {
            self.split(name, sizes)
        } else {
            sizes
        })
    }

    /// Sizes summed over all entries (disk of shared files split among links).
    pub fn total(&self) -> Sizes {
        let (mut total, shared) = {
            let ledger = self.ledger();
            (ledger.total(), ledger.shared_entries())
        };
        for (name, sizes) in shared {
            total.disk -= sizes.disk - self.split(&name, sizes).disk;
        }
        total
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
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;

    fn stored(outcome: PutOutcome) -> (String, u64) {
        match outcome {
            PutOutcome::Stored { name, disk } => (name, disk),
            PutOutcome::OverCapacity => panic!("unexpected OverCapacity"),
        }
    }

    fn read_back(store: &FileStore, name: &str) -> Vec<Vec<u8>> {
        let (mut file, size) = store.open_entry(name).unwrap();
        let mut buf = vec![0u8; size as usize];
        let layout = store.read_into(name, &mut file, &mut buf).unwrap();
        layout
            .frames
            .iter()
            .map(|&(o, l)| buf[o as usize..(o + l) as usize].to_vec())
            .collect()
    }

    #[test]
    fn put_get_remove_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path().join("spill")).unwrap();
        let a = vec![1u8; 1000];
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
            assert_eq!((map.as_ptr() as usize + off as usize) % 64, 0);
            assert!(len == 4 || len == 1000);
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
        let (mut file, size) = store.open_entry(&name).unwrap();
        let mut buf = vec![0u8; size as usize];
        assert!(matches!(
            store.read_into(&name, &mut file, &mut buf),
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
        let a = FileStore::open(tmp.path().join("a")).unwrap();
        let b = FileStore::open(tmp.path().join("b")).unwrap();
        let out = tmp.path().join("out");
        prepare_directory(&out).unwrap();
        let (name, disk) = stored(a.put("k", &[&[1u8; 1000]], 5000, None).unwrap());
        assert_eq!(a.total(), Sizes { memory: 5000, disk });
        let handle = a.link_out(&name, &out).unwrap();
        let peer = crate::peer::open_peer_file(tmp.path(), &handle, disk).unwrap();
        let (adopted, adopted_disk) = b.adopt(&peer, "k", 5000).unwrap();
        assert_eq!(adopted_disk, disk);
        fs::remove_file(&handle).unwrap();
        // two holders: each accounts half, and the host total is the file once
        assert_eq!(a.link_count(&name).unwrap(), 2);
        assert_eq!(a.total().disk + b.total().disk, disk);
        assert_eq!(b.sizes(&adopted).unwrap().disk, disk / 2);
        assert!(b.set_memory(&adopted, 10));
        assert_eq!(b.total().memory, 10);
        a.remove(&name).unwrap();
        assert_eq!(b.total().disk, disk);
        assert_eq!(read_back(&b, &adopted), vec![vec![1u8; 1000]]);
    }
}
