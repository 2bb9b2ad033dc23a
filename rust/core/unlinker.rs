//! Deleting files off the caller's thread.
//!
//! Unlinking a file of a tmpfs frees its pages there and then: about 15 us
//! for a 72 KiB value, in the thread that asked. A worker releases keys in
//! batches from its event loop (distributed's `_purge_state` deletes every
//! released key from `Worker.data` within one callback), so a batch of a few
//! thousand shared files held the loop for over 100 ms. A store opened with
//! deferred deletes hands each path to one process-wide thread instead, after
//! its accounting has already dropped the entry.
//!
//! After `fork` the child has no such thread; its deletes are then done
//! synchronously (checked by process id, without a lock a fork could have
//! left held).

use std::fs;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

enum Job {
    Unlink(PathBuf),
    Flush(Sender<()>),
}

/// The thread's queue, and the process that started the thread.
static QUEUE: OnceLock<Option<Sender<Job>>> = OnceLock::new();
static OWNER: AtomicU32 = AtomicU32::new(0);

fn queue() -> Option<&'static Sender<Job>> {
    let sender = QUEUE.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let started = std::thread::Builder::new()
            .name("dask-shm-unlink".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        Job::Unlink(path) => {
                            // Gone already (a directory swept, a peer's
                            // cleanup) is the outcome wanted; anything else
                            // leaves a file that the directory's removal or
                            // a later sweep takes.
                            let _ = fs::remove_file(&path);
                        }
                        Job::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            });
        OWNER.store(std::process::id(), Ordering::Release);
        started.ok().map(|_| tx)
    });
    // A forked child inherits QUEUE but not the thread.
    if OWNER.load(Ordering::Acquire) != std::process::id() {
        return None;
    }
    sender.as_ref()
}

/// Delete the file at `path` soon, on the unlinking thread; at once, in this
/// thread, where there is none (a forked child, a thread that cannot start),
/// returning that deletion's error (a missing file is not one).
pub fn unlink_later(path: PathBuf) -> io::Result<()> {
    let path = match queue() {
        Some(queue) => match queue.send(Job::Unlink(path)) {
            Ok(()) => return Ok(()),
            Err(returned) => match returned.0 {
                Job::Unlink(path) => path,
                Job::Flush(_) => unreachable!("sent an unlink"),
            },
        },
        None => path,
    };
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Wait until every deletion asked for before this call is done.
pub fn flush() {
    let Some(queue) = queue() else { return };
    let (tx, rx) = channel();
    if queue.send(Job::Flush(tx)).is_ok() {
        let _ = rx.recv();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_gone_once_flushed() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..100).map(|i| dir.path().join(format!("f{i}"))).collect();
        for p in &paths {
            fs::write(p, b"x").unwrap();
        }
        for p in &paths {
            unlink_later(p.clone()).unwrap();
        }
        unlink_later(dir.path().join("never-there")).unwrap();
        flush();
        assert!(paths.iter().all(|p| !p.exists()));
    }

    #[test]
    fn a_forked_child_deletes_at_once() {
        let dir = tempfile::tempdir().unwrap();
        unlink_later(dir.path().join("starts-the-thread")).unwrap();
        let path = dir.path().join("child");
        fs::write(&path, b"x").unwrap();
        // SAFETY: the child only runs the code below and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let gone = unlink_later(path.clone()).is_ok() && !path.exists();
            flush(); // returns: no thread to wait for
            unsafe { libc::_exit(if gone { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(!path.exists());
    }
}
