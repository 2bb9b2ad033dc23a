//! Spill files handed over by a peer process on the same host.
//!
//! A handle received from a peer is data from the network: a path and a size.
//! Before anything is linked or mapped, [`open_peer_file`] checks that the path
//! lies inside this user's directory `<root>/dask-shm-<uid>` of the expected
//! root (the tmpfs root for tier 2, the disk root for tier 3; after resolving
//! every directory component), that the last component is not a symlink
//! (`O_NOFOLLOW`), that it is a regular file owned by this user, that its size
//! is the announced size and that it carries a valid spill-file header for
//! exactly that size. It
//! keeps the file open, so everything afterwards (linking, reading) acts on the
//! inode that was checked, not on whatever the path names a moment later.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

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
    let root = user_dir(root);
    let root = root.canonicalize().map_err(|e| {
        forged(
            path,
            format!("shared-memory directory {}: {e}", root.display()),
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
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(&resolved)
    {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(forged(path, "is a symbolic link"))
        }
        Err(e) => return Err(PeerError::Io(e)),
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
