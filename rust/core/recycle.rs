//! Reusing the files of removed spill entries (see `store` for when it is
//! safe): the bounded pool of hidden files, the checks a pooled file must pass
//! before it is overwritten, and the overwrite itself.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::fs::write_all_vectored;

/// Files smaller than this are deleted rather than pooled: their few pages
/// cost less to allocate than the renames and checks that reuse takes
/// (measured on a tmpfs: put + delete break even near 128 KiB; at 256 KiB
/// reuse is about 1.5x faster, at 1 MiB 1.9x).
pub const MIN_RECYCLE: u64 = 256 * 1024;
/// Removed entries' files kept for reuse: `(size, n) -> path`, with the bytes
/// they hold plus admissions in flight, bounded by `cap`.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    pub(crate) cap: u64,
    pub(crate) bytes: u64,
    pub(crate) files: BTreeMap<(u64, u64), PathBuf>,
}

impl Pool {
    /// Reserve room for a file of `size` bytes; false if the pool is full.
    pub(crate) fn admit(&mut self, size: u64) -> bool {
        if self.bytes + size > self.cap {
            return false;
        }
        self.bytes += size;
        true
    }

    /// Give back an admission whose rename failed.
    pub(crate) fn cancel(&mut self, size: u64) {
        self.bytes -= size;
    }

    pub(crate) fn insert(&mut self, size: u64, n: u64, path: PathBuf) {
        self.files.insert((size, n), path);
    }

    /// Take the file to overwrite with `need` bytes: the smallest one that
    /// holds them if it is at most twice as large (shrinking a bigger one
    /// would throw warm pages away and free them on the writer's time),
    /// else the largest smaller one (the write extends it).
    pub(crate) fn take(&mut self, need: u64) -> Option<(u64, PathBuf)> {
        let fits = self
            .files
            .range((need, 0)..)
            .next()
            .map(|(&k, _)| k)
            .filter(|&(size, _)| size <= need.saturating_mul(2));
        let key = fits.or_else(|| self.files.range(..(need, 0)).next_back().map(|(&k, _)| k))?;
        let path = self.files.remove(&key)?;
        self.bytes -= key.0;
        Some((key.0, path))
    }

    /// Remove files, largest first, until the pool holds at most `limit` bytes.
    pub(crate) fn trim_to(&mut self, limit: u64) -> Vec<PathBuf> {
        let mut victims = Vec::new();
        while self.bytes > limit {
            let Some(((size, _), path)) = self.files.pop_last() else {
                break;
            };
            self.bytes -= size;
            victims.push(path);
        }
        victims
    }
}

/// Open an existing pooled file for overwriting, refusing anything that is
/// not still our private regular file: a symlink (O_NOFOLLOW), a FIFO or a
/// device (checked before opening; O_NONBLOCK so that a FIFO swapped in
/// meanwhile cannot block), a file with another hard link, another owner or
/// other permissions. Returns it with its metadata as opened.
pub(crate) fn open_recycled(path: &Path) -> io::Result<(File, fs::Metadata)> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let ours = |m: &fs::Metadata| {
        m.file_type().is_file() && m.nlink() == 1 && m.uid() == me && m.mode() & 0o7777 == 0o600
    };
    let refused = || io::Error::new(io::ErrorKind::InvalidData, "pooled file is not ours");
    if !ours(&fs::symlink_metadata(path)?) {
        return Err(refused());
    }
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !ours(&meta) {
        return Err(refused());
    }
    Ok((file, meta))
}

/// Overwrite a reused file of `meta` (opened by `open_recycled`) with
/// `slices`, `total` bytes in all, leaving it exactly `total` bytes long: the
/// file is cut to `total` if longer, then written from its start with one
/// vectored write. Where the file's pages exist, the kernel copies into them
/// and allocates nothing; that is all reuse saves.
///
/// A write rather than a copy into a shared mapping: on a tmpfs (Linux 6.18)
/// the mapping was never the faster of the two (an 18 MB overwrite: `pwrite`
/// 2.1-3.3 ms, `MAP_POPULATE` mapping + copy + unmap 3.2-4.0 ms; five A/B
/// pairs of `bench_spill`'s recycled spills: 6.4-6.8 vs 4.8-6.7 GB/s), and a
/// store into a mapping faults with SIGBUS, not an error, if the file is cut
/// meanwhile or has no space behind it.
pub(crate) fn overwrite(
    file: &mut File,
    meta: &fs::Metadata,
    total: u64,
    slices: &mut [IoSlice<'_>],
) -> io::Result<()> {
    if meta.len() > total {
        file.set_len(total)?;
    }
    write_all_vectored(file, slices)
}
