//! Spill files handed over by a peer process on the same host.
//!
//! A handle received from a peer is data from the network: a path and a size.
//! Before anything is linked or mapped, [`open_peer_file`] checks that the path
//! lies inside this user's directory `<root>/dask-shm-<uid>` of the expected
//! root (the tmpfs root for tier 2, the disk root for tier 3: opened with
//! `openat2` beneath that directory without following any symlink, or, where
//! that cannot open it, after resolving every directory component), that the
//! last component is not a symlink (`O_NOFOLLOW`), that it is a regular file
//! owned by this user, that its size
//! is the announced size and that it carries a valid spill-file header for
//! exactly that size. It
//! keeps the file open, so everything afterwards (linking, reading) acts on the
//! inode that was checked, not on whatever the path names a moment later.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

use crate::format::{self, Layout};

#[derive(Debug)]
pub enum PeerError {
    /// The handle does not name a file we may accept: never followed.
    Forged(String),
    /// The handle was valid but the operation failed (I/O, link limits, ...).
    Io(io::Error),
}

impl From<io::Error> for PeerError {
    fn from(e: io::Error) -> Self {
        PeerError::Io(e)
    }
}

impl std::fmt::Display for PeerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerError::Forged(why) => write!(f, "refused shared-memory handle: {why}"),
            PeerError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// An open, validated spill file of a peer.
#[derive(Debug)]
pub struct PeerFile {
    pub file: File,
    pub path: PathBuf,
    pub layout: Layout,
}

fn forged(path: &Path, why: impl std::fmt::Display) -> PeerError {
    PeerError::Forged(format!("{}: {why}", path.display()))
}

/// This user's directory under a shared-memory root: `<root>/dask-shm-<uid>`.
pub fn user_dir(root: &Path) -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    root.join(format!("dask-shm-{me}"))
}

/// Open `path` as a spill file of exactly `size` bytes inside this user's
/// directory of `root` (see [`user_dir`]).
pub fn open_peer_file(root: &Path, path: &Path, size: u64) -> Result<PeerFile, PeerError> {
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return Err(forged(path, "not an absolute path without '..'"));
    }
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(forged(path, "no file name"));
    };
    let user = user_dir(root);
    let (file, resolved) = match open_beneath(&user, path) {
        Some(file) => (file, path.to_path_buf()),
        None => open_resolving(&user, path, parent, name)?,
    };
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(forged(path, "not a regular file"));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(forged(
            path,
            format!("owned by uid {}, not by this user (uid {me})", meta.uid()),
        ));
    }
    if meta.len() != size {
        return Err(forged(
            path,
            format!("{} bytes, the handle announced {size}", meta.len()),
        ));
    }
    let layout = read_layout(&file, size).map_err(|e| match e {
        PeerError::Forged(why) => forged(path, why),
        other => other,
    })?;
    Ok(PeerFile {
        file,
        path: resolved,
        layout,
    })
}

/// The check of [`open_peer_file`] done by resolving every directory
/// component (ten `readlink`s for a path five levels below the root): the
/// resolved parent must lie inside the resolved user directory, and the file
/// itself must not be a symlink. Also names the error wherever
/// [`open_beneath`] could not open the file.
fn open_resolving(
    user: &Path,
    path: &Path,
    parent: &Path,
    name: &std::ffi::OsStr,
) -> Result<(File, PathBuf), PeerError> {
    let root = user.canonicalize().map_err(|e| {
        forged(
            path,
            format!("shared-memory directory {}: {e}", user.display()),
        )
    })?;
    let parent = parent
        .canonicalize()
        .map_err(|e| forged(path, format!("directory cannot be resolved: {e}")))?;
    if !parent.starts_with(&root) {
        return Err(forged(
            path,
            format!("outside the shared-memory directory {}", root.display()),
        ));
    }
    let resolved = parent.join(name);
    match OpenOptions::new()
        .read(true)
        .custom_flags(PEER_OPEN_FLAGS)
        .open(&resolved)
    {
        Ok(file) => Ok((file, resolved)),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(forged(path, "is a symbolic link")),
        Err(e) => Err(PeerError::Io(e)),
    }
}

const PEER_OPEN_FLAGS: i32 = libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;

/// The kernel's `struct open_how` (linux/openat2.h; libc's is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Whether this kernel lets us call `openat2` (Linux 5.6; a seccomp filter
/// may refuse it with EPERM or ENOSYS): unknown, yes, no.
static OPENAT2: AtomicU8 = AtomicU8::new(OPENAT2_UNKNOWN);
const OPENAT2_UNKNOWN: u8 = 0;
const OPENAT2_WORKS: u8 = 1;
const OPENAT2_REFUSED: u8 = 2;

/// The same check as [`open_resolving`] in two system calls: `path`, when it
/// is spelled below `user`, is opened relative to `user` with `openat2`,
/// which the kernel keeps beneath that directory and refuses to take through
/// any symlink or magic link on the way (`RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`). Symlinks in `user` itself
/// are followed, as resolving it does. None when this cannot open it (not
/// spelled below `user`, no `openat2`, or any error): the caller then
/// resolves the path, which names the error, if there is one.
fn open_beneath(user: &Path, path: &Path) -> Option<File> {
    if OPENAT2.load(Ordering::Relaxed) == OPENAT2_REFUSED {
        return None;
    }
    let relative = path.strip_prefix(user).ok()?;
    if relative.as_os_str().is_empty() {
        return None;
    }
    let relative = CString::new(relative.as_os_str().as_bytes()).ok()?;
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(user)
        .ok()?;
    let how = OpenHow {
        flags: (libc::O_RDONLY | PEER_OPEN_FLAGS) as u64,
        mode: 0,
        resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: `relative` is a valid NUL-terminated string and `how` a valid
    // `open_how` of the size passed; openat2 has no other preconditions.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            relative.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        let errno = io::Error::last_os_error().raw_os_error();
        if matches!(
            errno,
            Some(libc::ENOSYS) | Some(libc::EPERM) | Some(libc::E2BIG)
        ) && OPENAT2.load(Ordering::Relaxed) == OPENAT2_UNKNOWN
        {
            OPENAT2.store(OPENAT2_REFUSED, Ordering::Relaxed);
        }
        return None;
    }
    OPENAT2.store(OPENAT2_WORKS, Ordering::Relaxed);
    // SAFETY: openat2 returned a new file descriptor that nothing else owns.
    Some(unsafe { File::from_raw_fd(fd as RawFd) })
}

fn read_layout(file: &File, size: u64) -> Result<Layout, PeerError> {
    let mut prefix = [0u8; 16];
    if size < 16 {
        return Err(PeerError::Forged(format!("{size} bytes is too short")));
    }
    file.read_exact_at(&mut prefix, 0)?;
    let count = format::parse_count(&prefix, size)
        .map_err(|e| PeerError::Forged(format!("not a spill file: {e}")))?;
    let mut header = vec![0u8; format::header_len_for(count) as usize];
    file.read_exact_at(&mut header, 0)?;
    format::parse_layout(&header, size)
        .map_err(|e| PeerError::Forged(format!("not a spill file: {e}")))
}

impl PeerFile {
    /// Give the open inode a new name `dest` (same file system), without
    /// following anything and without replacing an existing file.
    pub fn link_to(&self, dest: &Path) -> io::Result<()> {
        let source = CString::new(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
            .expect("no NUL in a formatted fd path");
        let dest = CString::new(dest.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))?;
        // SAFETY: both paths are valid NUL-terminated strings; linkat has no
        // other preconditions. AT_SYMLINK_FOLLOW makes /proc/self/fd/N name the
        // open inode itself rather than the magic link.
        let rc = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                source.as_ptr(),
                libc::AT_FDCWD,
                dest.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Copy the whole file into `buf` (exactly `layout.file_size` bytes).
    pub fn read_all_into(&self, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn openat2_opens_only_paths_without_symlinks_and_answers_as_resolving_does() {
        let tmp = tempfile::tempdir().unwrap();
        let user = user_dir(tmp.path());
        std::fs::create_dir_all(user.join("w1")).unwrap();
        std::fs::write(user.join("w1/f"), b"x").unwrap();
        let opened = open_beneath(&user, &user.join("w1/f"));
        if OPENAT2.load(Ordering::Relaxed) == OPENAT2_REFUSED {
            eprintln!("skipped: this kernel (or its seccomp filter) refuses openat2");
            return;
        }
        assert!(opened.is_some());
        // the directory itself may be reached through a symlink, as resolving it would
        let alias = tmp.path().join("user-alias");
        symlink(&user, &alias).unwrap();
        assert!(open_beneath(&alias, &alias.join("w1/f")).is_some());
        // any symlink below it, even one that stays inside, is left to the resolving check
        symlink(user.join("w1"), user.join("w2")).unwrap();
        assert!(open_beneath(&user, &user.join("w2/f")).is_none());
        symlink(user.join("w1/f"), user.join("w1/link")).unwrap();
        assert!(open_beneath(&user, &user.join("w1/link")).is_none());
        // so is a path not spelled below it, and the directory itself
        assert!(open_beneath(&user, &tmp.path().join("elsewhere/f")).is_none());
        assert!(open_beneath(&user, &user).is_none());
        assert!(open_beneath(&user, &user.join("w1/missing")).is_none());

        // Whatever opens it, a handle gets the same answer (one test, as the
        // switch is process-wide).
        std::fs::remove_file(user.join("w1/f")).unwrap();
        let file = user.join("w1/f");
        let size = write_spill_file(&file);
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        write_spill_file(&outside.join("f"));
        symlink(&outside, user.join("escape")).unwrap();
        let cases = [
            file.clone(),
            alias.join("w1/f"),
            user.join("w2/f"),
            user.join("w1/link"),
            user.join("escape/f"),
            outside.join("f"),
            user.join("w1/missing"),
        ];
        let outcomes = || -> Vec<&str> {
            cases
                .iter()
                .map(|p| match open_peer_file(tmp.path(), p, size) {
                    Ok(_) => "ok",
                    Err(PeerError::Forged(_)) => "forged",
                    Err(PeerError::Io(_)) => "io",
                })
                .collect()
        };
        let with_openat2 = outcomes();
        OPENAT2.store(OPENAT2_REFUSED, Ordering::Relaxed);
        let resolving = outcomes();
        OPENAT2.store(OPENAT2_WORKS, Ordering::Relaxed);
        assert_eq!(
            with_openat2,
            ["ok", "ok", "ok", "forged", "forged", "forged", "io"]
        );
        assert_eq!(with_openat2, resolving);
    }

    /// A spill file of one small frame, as a store writes it; returns its size.
    fn write_spill_file(path: &Path) -> u64 {
        let layout = Layout::for_lengths(&[3]);
        let mut bytes = layout.header_bytes();
        bytes.extend_from_slice(b"abc");
        assert_eq!(bytes.len() as u64, layout.file_size);
        std::fs::write(path, bytes).unwrap();
        layout.file_size
    }
}
