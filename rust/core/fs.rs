//! File-system helpers shared by the stores: opening without following a
//! final symlink, the private (0700) directory every store lives in, writing
//! a list of buffers completely, copying a file in the kernel, the page size,
//! sealing a file read-only and its fingerprint, and the one rule deciding
//! whether a directory is RAM-backed.
//!
//! Nothing here knows about spill files or Python; every other module may use
//! it and it uses none of them.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, IoSlice, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Linux refuses `writev` with more than this many buffers.
const IOV_MAX: usize = 1024;

/// `statfs` magic numbers of the RAM-backed file systems (linux/magic.h).
const TMPFS_MAGIC: u32 = 0x0102_1994;
const RAMFS_MAGIC: u32 = 0x8584_58f6;
const HUGETLBFS_MAGIC: u32 = 0x9584_58f6;

/// Open an existing file read-only, refusing a symlink as its last component
/// (`O_NOFOLLOW`, fails with ELOOP); close-on-exec.
pub fn open_nofollow(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// What tells one version of a file from another: its size, modification
/// time (nanoseconds since the epoch) and inode number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub size: u64,
    pub mtime_ns: i64,
    pub inode: u64,
}

impl Fingerprint {
    pub fn of(meta: &fs::Metadata) -> Fingerprint {
        Fingerprint {
            size: meta.len(),
            mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
            inode: meta.ino(),
        }
    }
}

/// Make the file at `path` read-only (0400) and return its fingerprint, with
/// one path lookup: open without following a symlink (ELOOP, the link left as
/// it is) and without blocking, then `fstat` and `fchmod` the descriptor.
pub fn seal(path: &Path) -> io::Result<Fingerprint> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = file.metadata()?;
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o400))?;
    Ok(Fingerprint::of(&meta))
}

/// The fingerprint of whatever is at `path`, a symlink itself (`lstat`).
pub fn fingerprint(path: &Path) -> io::Result<Fingerprint> {
    Ok(Fingerprint::of(&fs::symlink_metadata(path)?))
}

/// Create a new file for writing that nobody else can read (mode 0600),
/// failing if anything, a symlink included, already has that name
/// (`O_EXCL|O_NOFOLLOW`); close-on-exec.
pub fn create_private(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Create `dir` (mode 0700, parents as needed) or accept an existing
/// directory that is not a symlink and belongs to this user.
///
/// Errors: InvalidInput if `dir` is a symlink or not a directory,
/// PermissionDenied if it belongs to another user, or the creation's error.
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

/// `writev` until every byte of `slices` is written (in batches of at most
/// `IOV_MAX` buffers, retrying on EINTR). Errors with WriteZero if the
/// kernel accepts nothing.
pub fn write_all_vectored(file: &mut File, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
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

/// The system page size (4096 if it cannot be read).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

/// Whether `path` lies on a RAM-backed file system: tmpfs, ramfs or
/// hugetlbfs (judged by `statfs`'s magic number, so bind mounts and mounts
/// under any name count). False when `statfs` fails (missing path, ...) and
/// off Linux. This is the one rule for "is this shared memory" in dask-shm:
/// Python reaches it as `dask_shm._core.is_ram_backed`.
pub fn is_ram_backed(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
            return false;
        };
        let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: `c` is a valid C string and `st` is written on success.
        if unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
            return false;
        }
        // SAFETY: statfs succeeded.
        let st = unsafe { st.assume_init() };
        // f_type's width and signedness vary by target; the magic numbers are
        // 32-bit, so compare the low 32 bits.
        #[allow(clippy::unnecessary_cast)]
        let magic = st.f_type as u32;
        matches!(magic, TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

/// Copy `len` bytes of `src` (from offset 0) to `dst` (at its current offset 0,
/// freshly created). Uses `copy_file_range`, falling back to `sendfile` and
/// then to a plain read/write loop when the kernel refuses (EXDEV across
/// file system types, ENOSYS, EINVAL, EOPNOTSUPP).
pub fn copy_file(src: &File, dst: &mut File, len: u64) -> io::Result<()> {
    let mut done = 0u64;
    let mut method = 0; // 0 copy_file_range, 1 sendfile, 2 read/write
    while done < len {
        let chunk = ((len - done).min(1 << 30)) as usize;
        let n = match method {
            0 => {
                let mut off_in = done as libc::loff_t;
                let mut off_out = done as libc::loff_t;
                // SAFETY: both descriptors are open; offsets are valid pointers.
                unsafe {
                    libc::copy_file_range(
                        src.as_raw_fd(),
                        &mut off_in,
                        dst.as_raw_fd(),
                        &mut off_out,
                        chunk,
                        0,
                    )
                }
            }
            1 => {
                let mut off_in = done as libc::off_t;
                // sendfile writes at the output's file offset.
                // SAFETY: both descriptors are open; offset is a valid pointer.
                unsafe { libc::sendfile(dst.as_raw_fd(), src.as_raw_fd(), &mut off_in, chunk) }
            }
            _ => {
                copy_read_write(src, dst, done, len)?;
                return Ok(());
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP)
                    if method < 2 =>
                {
                    method += 1;
                    if method == 1 {
                        // sendfile appends at the output offset: position it.
                        use std::io::Seek;
                        dst.seek(io::SeekFrom::Start(done))?;
                    }
                    continue;
                }
                _ => return Err(e),
            }
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("source ended after {done} of {len} bytes"),
            ));
        }
        done += n as u64;
    }
    Ok(())
}

fn copy_read_write(src: &File, dst: &mut File, from: u64, len: u64) -> io::Result<()> {
    use std::io::Seek;
    let mut src = src.try_clone()?;
    src.seek(io::SeekFrom::Start(from))?;
    dst.seek(io::SeekFrom::Start(from))?;
    let mut left = len - from;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let want = (left as usize).min(buf.len());
        let n = src.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source ended"));
        }
        dst.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn dev_shm_is_ram_backed_and_a_missing_path_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(!is_ram_backed(&tmp.path().join("missing")));
        if Path::new("/dev/shm").is_dir() {
            assert!(is_ram_backed(Path::new("/dev/shm")));
        }
        // /proc is a file system of its own, never RAM-backed storage.
        assert!(!is_ram_backed(Path::new("/proc")));
    }

    #[test]
    fn private_directories_are_created_0700_and_symlinks_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        prepare_directory(&dir).unwrap();
        let mode = fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        prepare_directory(&dir).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let err = prepare_directory(&link).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        let file = tmp.path().join("file");
        fs::write(&file, b"x").unwrap();
        assert!(prepare_directory(&file).is_err());
    }

    #[test]
    fn seal_makes_a_file_read_only_and_refuses_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("t");
        fs::write(&target, b"abc").unwrap();
        let sealed = seal(&target).unwrap();
        assert_eq!(sealed, fingerprint(&target).unwrap());
        assert_eq!(sealed.size, 3);
        let mode = fs::metadata(&target).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o400);
        let link = tmp.path().join("l");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = seal(&link).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
        // The symlink's own fingerprint, not its target's.
        assert_ne!(fingerprint(&link).unwrap().inode, sealed.inode);
        assert_eq!(
            fingerprint(&tmp.path().join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn open_nofollow_refuses_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("t");
        fs::write(&target, b"x").unwrap();
        let link = tmp.path().join("l");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(open_nofollow(&target).is_ok());
        let err = open_nofollow(&link).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
    }

    #[test]
    fn write_all_vectored_writes_more_than_iov_max_buffers() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        let mut file = File::create(&path).unwrap();
        let parts: Vec<Vec<u8>> = (0..(IOV_MAX * 2 + 3)).map(|i| vec![i as u8; 3]).collect();
        let mut slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        write_all_vectored(&mut file, &mut slices).unwrap();
        assert_eq!(fs::read(&path).unwrap(), parts.concat());
        assert!(page_size().is_power_of_two());
    }

    #[test]
    fn copy_file_falls_back_across_file_systems() {
        // /dev/shm (tmpfs) -> a temp dir (usually another file system): the
        // copy must work whichever primitive the kernel accepts.
        let shm = std::path::Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let a = tempfile::tempdir_in(shm).unwrap();
        let b = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..5_000_001u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(a.path().join("f"), &data).unwrap();
        let src = File::open(a.path().join("f")).unwrap();
        let mut dst = File::create(b.path().join("g")).unwrap();
        copy_file(&src, &mut dst, data.len() as u64).unwrap();
        drop(dst);
        assert_eq!(std::fs::read(b.path().join("g")).unwrap(), data);
    }
}
