//! Cross-process core of the local shared-memory scheduler
//! (`dask_shm.local`): map a spill-format file written by another process,
//! and tell whether the pages of a private file mapping still hold the file's
//! bytes. Pure Rust; the binding's `local_transport` module is its Python face.
//!
//! Writing goes through `FileStore::put` (each process has its own store on the
//! shared directory); these functions only read.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use memmap2::MmapMut;

use crate::format::Layout;
use crate::fs::page_size;
use crate::store::{self, StoreError};

/// Map a spill file published by any process of the local scheduler,
/// copy-on-write, and validate its layout: the store's own map-and-check
/// (`store::map_file`; the same errors). Files of the local scheduler are
/// published whole by `FileStore::put`, never truncated or rewritten, only
/// unlinked (a mapping outlives the unlink), in a 0700 directory of this user.
pub fn map_published(path: &Path) -> Result<(MmapMut, Layout), StoreError> {
    store::map_file(path)
}

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;

/// True if no page of `[addr, addr + len)` in this process has been written
/// since it was mapped from a file, judged from `/proc/self/pagemap`: a page
/// of a private file mapping is either not yet faulted in, or present and
/// backed by the file's page cache; a written page is an anonymous copy
/// (present without the file bit, or swapped out).
pub fn pages_unmodified(addr: usize, len: usize) -> io::Result<bool> {
    if len == 0 {
        return Ok(true);
    }
    let end = addr.checked_add(len - 1).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "address range past the end of memory",
        )
    })?;
    let page = page_size();
    let (first, last) = (addr / page, end / page);
    let pagemap = File::open("/proc/self/pagemap")?;
    // In chunks: a range is a few pages, or a caller's mistake that must not
    // allocate its size in entries.
    let mut entries = vec![0u8; 8 * PAGEMAP_CHUNK.min(last - first + 1)];
    let mut start = first;
    while start <= last {
        let count = PAGEMAP_CHUNK.min(last - start + 1);
        let chunk = &mut entries[..8 * count];
        pagemap.read_exact_at(chunk, (start as u64) * 8)?;
        if chunk.chunks_exact(8).any(page_written) {
            return Ok(false);
        }
        start += count;
    }
    Ok(true)
}

/// Pagemap entries read at a time by [`pages_unmodified`].
const PAGEMAP_CHUNK: usize = 4096;

fn page_written(entry: &[u8]) -> bool {
    let mut word = [0u8; 8];
    word.copy_from_slice(entry);
    let entry = u64::from_le_bytes(word);
    entry & PM_SWAPPED != 0 || (entry & PM_PRESENT != 0 && entry & PM_FILE == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::FormatError;
    use crate::store::{FileStore, PutOutcome};

    #[test]
    fn a_range_past_the_end_of_memory_is_an_error_not_a_panic() {
        let err = pages_unmodified(usize::MAX - 10, 100).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn written_pages_are_detected() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStore::open(tmp.path()).unwrap();
        let data = vec![5u8; 5 * page_size()];
        let name = match store.put("p", &[&data], 1, None).unwrap() {
            PutOutcome::Stored { name, .. } => name,
            PutOutcome::OverCapacity => unreachable!(),
        };
        let (mut map, layout) = map_published(&store.path_of(&name)).ok().unwrap();
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
            map_published(&path),
            Err(StoreError::Corrupt {
                error: FormatError::BadMagic,
                ..
            })
        ));
        assert!(matches!(
            map_published(&tmp.path().join("missing")),
            Err(StoreError::Io(_))
        ));
    }
}
