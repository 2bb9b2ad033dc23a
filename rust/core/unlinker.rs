//! Deleting files off the caller's thread when the caller deletes many, and
//! large files (and mappings: `release_later`) whenever it deletes them.
//!
//! Unlinking a file of a tmpfs frees its pages there and then: about 15 us
//! for a 72 KiB value, in the thread that asked. A worker releases keys in
//! batches from its event loop (distributed's `_purge_state` deletes every
//! released key from `Worker.data` within one callback), so a batch of a few
//! thousand shared files held the loop for over 100 ms.
//!
//! Handing every path to another thread bounds that, but can cost more than
//! it saves: at 30,000 keys (4 workers, 16 cores) the whole computation took
//! 89 s instead of 76 s (one pair; on 2 cores runs were too noisy to tell),
//! and the pages it frees land on another CPU's free list than the one that
//! allocates the next file. So `unlink_paced` deletes in the caller's thread while that thread's
//! budget of unlink time lasts (a token bucket: `BURST` at most, refilled at
//! `SHARE` of the time that passes), and hands the rest of a burst to one
//! process-wide thread, after the store's accounting has dropped the entry.
//!
//! A large file goes to that thread whatever the budget (`unlink_sized`): freeing a
//! 20 MiB file's 4 KiB tmpfs pages took ~3.4 ms of the caller's time on the dev box, each
//! time a worker's event loop released such a key, where a hand-over costs microseconds.
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
use std::time::{Duration, Instant};

/// Unlink time a thread may spend at once before its deletes are deferred.
const BURST: Duration = Duration::from_millis(10);
/// The share of elapsed time by which that budget refills.
const SHARE: f64 = 0.1;

enum Job {
    Unlink(PathBuf),
    Release(Box<dyn Send>),
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
                        Job::Release(value) => drop(value),
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
                Job::Release(_) | Job::Flush(_) => unreachable!("sent an unlink"),
            },
        },
        None => path,
    };
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A thread's budget of unlink time.
struct Pace {
    /// Seconds left; below zero after a delete that overran it.
    left: f64,
    refilled_at: Instant,
}

impl Pace {
    /// Refill for the time since the last call; whether budget is left.
    fn has_budget(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.refilled_at);
        self.left = (self.left + elapsed.as_secs_f64() * SHARE).min(BURST.as_secs_f64());
        self.refilled_at = now;
        self.left > 0.0
    }
}

thread_local! {
    static PACE: std::cell::RefCell<Pace> = std::cell::RefCell::new(Pace {
        left: BURST.as_secs_f64(),
        refilled_at: Instant::now(),
    });
}

/// Delete the file at `path` now, in this thread, while the thread's budget
/// of unlink time lasts (see the module's doc); else soon, on the unlinking
/// thread, as `unlink_later`. A missing file is not an error.
pub fn unlink_paced(path: PathBuf) -> io::Result<()> {
    let start = Instant::now();
    if !PACE.with(|pace| pace.borrow_mut().has_budget(start)) {
        return unlink_later(path);
    }
    let result = match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    let spent = start.elapsed().as_secs_f64();
    PACE.with(|pace| pace.borrow_mut().left -= spent);
    result
}

/// Files of at least this many bytes are always deleted on the unlinking
/// thread by `unlink_sized`: freeing their pages costs milliseconds.
pub const DEFER_FROM: u64 = 1 << 20;

/// Delete the file at `path`, of `bytes` bytes: on the unlinking thread
/// (`unlink_later`) from `DEFER_FROM` bytes on, else `unlink_paced`.
pub fn unlink_sized(path: PathBuf, bytes: u64) -> io::Result<()> {
    if bytes >= DEFER_FROM {
        unlink_later(path)
    } else {
        unlink_paced(path)
    }
}

/// Drop `value` on the unlinking thread (a large mapping: unmapping 20 MiB
/// of touched 4 KiB pages took ~2 ms, with the GIL held where a Python
/// object owned it); at once, in this thread, where there is none.
pub fn release_later(value: Box<dyn Send>) {
    match queue() {
        // A failed send hands the job back, which drops it here.
        Some(queue) => drop(queue.send(Job::Release(value))),
        None => drop(value),
    }
}

/// Wait until every deletion (and release) asked for before this call is done.
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
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

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
    fn paced_deletes_are_done_in_place_then_deferred() {
        let dir = tempfile::tempdir().unwrap();
        // A fresh thread has the whole budget: its delete is done before the
        // call returns.
        let first = dir.path().join("first");
        fs::write(&first, b"x").unwrap();
        let path = first.clone();
        std::thread::spawn(move || unlink_paced(path).unwrap())
            .join()
            .unwrap();
        assert!(!first.exists());
        // A thread whose budget is spent defers (see the next test for the
        // decision); the files are gone once flushed.
        let dir_path = dir.path().to_path_buf();
        let paths = std::thread::spawn(move || {
            PACE.with(|p| p.borrow_mut().left = -1.0);
            let paths: Vec<PathBuf> = (0..50).map(|i| dir_path.join(format!("f{i}"))).collect();
            for p in &paths {
                fs::write(p, vec![0u8; 4096]).unwrap();
                unlink_paced(p.clone()).unwrap();
            }
            unlink_paced(dir_path.join("never-there")).unwrap();
            paths
        })
        .join()
        .unwrap();
        flush();
        assert!(paths.iter().all(|p| !p.exists()));
    }

    #[test]
    fn large_files_go_to_the_thread_and_leave_the_budget_alone() {
        let dir = tempfile::tempdir().unwrap();
        let dir_path = dir.path().to_path_buf();
        let (large, small) = (dir.path().join("large"), dir.path().join("small"));
        fs::write(&large, vec![0u8; DEFER_FROM as usize]).unwrap();
        fs::write(&small, b"x").unwrap();
        let (l, s) = (large.clone(), small.clone());
        let (after_large, after_small) = std::thread::spawn(move || {
            let full = BURST.as_secs_f64();
            unlink_sized(l, DEFER_FROM).unwrap();
            let after_large = PACE.with(|p| p.borrow().left);
            unlink_sized(s, 1).unwrap();
            let after_small = PACE.with(|p| p.borrow().left);
            unlink_sized(dir_path.join("never-there"), DEFER_FROM).unwrap();
            (full - after_large, after_small)
        })
        .join()
        .unwrap();
        // The large delete left the thread's budget full (BURST); the small
        // one, done in place, spent some of it and is gone already.
        assert!(after_large.abs() < 1e-9, "budget spent: {after_large}");
        assert!(after_small < BURST.as_secs_f64());
        assert!(!small.exists());
        flush();
        assert!(!large.exists());
    }

    #[test]
    fn released_values_are_dropped_by_the_thread_before_a_flush_returns() {
        struct Flag(Arc<AtomicBool>, Sender<std::thread::ThreadId>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
                let _ = self.1.send(std::thread::current().id());
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let (tx, rx) = channel();
        release_later(Box::new(Flag(dropped.clone(), tx)));
        flush();
        assert!(dropped.load(Ordering::SeqCst));
        assert_ne!(rx.recv().unwrap(), std::thread::current().id());
    }

    #[test]
    fn the_budget_refills_with_time_and_is_capped() {
        let t0 = Instant::now();
        let mut pace = Pace {
            left: -0.001,
            refilled_at: t0,
        };
        assert!(!pace.has_budget(t0));
        assert!(!pace.has_budget(t0 + Duration::from_millis(9)));
        // 1 ms overrun refills in 1 ms / SHARE = 10 ms.
        assert!(pace.has_budget(t0 + Duration::from_millis(11)));
        assert!(pace.has_budget(t0 + Duration::from_secs(100)));
        assert_eq!(pace.left, BURST.as_secs_f64());
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
