//! A worker's figures for its nanny, written to a small file by a thread of
//! its own every few tens of milliseconds.
//!
//! The nanny's terminate check counts some of a worker's shared pages only
//! from figures stamped after its previous look (every 100 ms), so a worker
//! publishes about 20 times a second, all its life. A Python thread doing
//! that woke the interpreter each time and took the GIL from the task
//! threads; on the 2-core dev box it used 3 ms of CPU a second per worker
//! under load. This thread needs neither: its figures come from counters
//! the stores and mappings keep in Rust.
//!
//! The file holds one line, `<share> <pid namespace or -> <mapped> <kept>
//! <stamp>` (`dask_shm.shared.published_share` reads it), and is replaced
//! by rename: a reader sees the old line or the new one.

use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// What a worker publishes, in bytes (see `Published` in
/// `dask_shm.shared.published_share`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Figures {
    pub share: u64,
    pub mapped: u64,
    pub kept: u64,
}

/// Seconds of `CLOCK_MONOTONIC`, the clock of Python's `time.monotonic()`
/// on Linux: one clock for every process of the host.
pub fn monotonic_seconds() -> f64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid pointer to a timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

/// The published line.
pub fn format_line(figures: Figures, namespace: Option<u64>, stamp: f64) -> String {
    let namespace = namespace.map_or_else(|| "-".to_owned(), |n| n.to_string());
    format!(
        "{} {namespace} {} {} {stamp:.6}",
        figures.share, figures.mapped, figures.kept
    )
}

/// Write `text` to `<path>.tmp` (created mode 0644, or truncated) and
/// rename it over `path`.
pub fn write_replacing(path: &Path, text: &[u8]) -> io::Result<()> {
    let mut tmp = OsString::from(path.as_os_str());
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(&tmp)?;
    file.write_all(text)?;
    drop(file);
    fs::rename(&tmp, path)
}

/// Publishes `figures()` at `path` every `interval` until stopped (or
/// dropped). The stamp is read before the figures: a mapping made meanwhile
/// shows in neither. A write that fails (a full root) leaves the last line
/// in place, to age; the next round tries again.
pub struct Publisher {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Publisher {
    pub fn start(
        path: PathBuf,
        namespace: Option<u64>,
        interval: Duration,
        figures: Box<dyn Fn() -> Figures + Send>,
    ) -> io::Result<Publisher> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("dask-shm-share".into())
            .spawn(move || {
                let (lock, wake) = &*flag;
                let mut stopped = lock.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    let (guard, _) = wake
                        .wait_timeout_while(stopped, interval, |stopped| !*stopped)
                        .unwrap_or_else(|p| p.into_inner());
                    stopped = guard;
                    if *stopped {
                        return;
                    }
                    let stamp = monotonic_seconds();
                    let line = format_line(figures(), namespace, stamp);
                    let _ = write_replacing(&path, line.as_bytes());
                }
            })?;
        Ok(Publisher {
            stop,
            thread: Some(thread),
        })
    }

    /// End the thread and wait for it (at most one round's write).
    pub fn stop(&mut self) {
        {
            let (lock, wake) = &*self.stop;
            *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
            wake.notify_all();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    #[test]
    fn the_line_is_the_one_python_writes() {
        let figures = Figures {
            share: 5,
            mapped: 7,
            kept: 9,
        };
        assert_eq!(
            format_line(figures, Some(4026531836), 12.5),
            "5 4026531836 7 9 12.500000"
        );
        assert_eq!(format_line(figures, None, 0.25), "5 - 7 9 0.250000");
    }

    #[test]
    fn the_clock_is_monotonic() {
        let a = monotonic_seconds();
        std::thread::sleep(Duration::from_millis(5));
        let b = monotonic_seconds();
        assert!(b - a >= 0.004, "{a} {b}");
    }

    #[test]
    fn write_replacing_leaves_only_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.share");
        write_replacing(&path, b"1 - 0 0 1.0").unwrap();
        write_replacing(&path, b"2 - 0 0 2.0").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "2 - 0 0 2.0");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("w.share")]);
    }

    #[test]
    fn write_replacing_into_a_missing_directory_fails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gone").join("w.share");
        assert!(write_replacing(&path, b"1").is_err());
    }

    fn read_line(path: &Path) -> Option<(u64, f64)> {
        let text = fs::read_to_string(path).ok()?;
        let parts: Vec<&str> = text.split(' ').collect();
        Some((parts[0].parse().ok()?, parts[4].parse().ok()?))
    }

    #[test]
    fn the_thread_follows_the_figures_with_fresh_stamps_and_stops() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.share");
        let share = Arc::new(AtomicU64::new(1));
        let source = Arc::clone(&share);
        let mut publisher = Publisher::start(
            path.clone(),
            None,
            Duration::from_millis(5),
            Box::new(move || Figures {
                share: source.load(Ordering::Relaxed),
                ..Figures::default()
            }),
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let first = loop {
            if let Some((1, stamp)) = read_line(&path) {
                break stamp;
            }
            assert!(Instant::now() < deadline, "never published");
            std::thread::sleep(Duration::from_millis(1));
        };
        share.store(42, Ordering::Relaxed);
        loop {
            if let Some((42, stamp)) = read_line(&path) {
                assert!(
                    stamp > first,
                    "stamp {stamp} not after the first line's {first}"
                );
                break;
            }
            assert!(Instant::now() < deadline, "never followed the figures");
            std::thread::sleep(Duration::from_millis(1));
        }
        let started = Instant::now();
        publisher.stop();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "stop waited a round or more"
        );
        let last = fs::read_to_string(&path).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            last,
            "published after stop"
        );
    }
}
