//! The state machine of the AMM's ReduceReplicas tracker: which replicated
//! tasks the next run must look at, kept between runs. The binding
//! (`dask_shm._core.ReplicaTracker`) reads the scheduler's objects and feeds
//! this their addresses and counts; `T` is its handle on a task (a reference
//! that keeps the object, and so its address, alive).
//!
//! Sets, all keyed by task address:
//! - `over`: tasks that had drops to suggest at their last look;
//! - `dirty`: tasks reported changed since the last run (`touch`);
//! - `decided`: tasks the last run decided drops for, with the replicas it
//!   kept, settled into `over` at the start of the next run (`take_settling`,
//!   `settle`) unless a change touched them;
//! - `targets`: the last run's `KeepReplicas` targets.
//!
//! Rules: the first run, `request_rescan`, more than `DIRTY_LIMIT` changed
//! tasks between two runs and a full scan that finds more than `OVER_LIMIT`
//! over-replicated tasks make the next run a full scan; otherwise a run looks
//! at `over`, `dirty`, `targets` and the caller's extra tasks only
//! (`candidates`). Losing a replica never gives a task drops to suggest, so
//! removals need no report.

use crate::addr_map::AddrMap;

/// More changed tasks than this between two runs: forget them and rescan.
pub const DIRTY_LIMIT: usize = 1 << 16;
/// A full scan finding more over-replicated tasks than this stops keeping them
/// (which would slow the scan down) and leaves the next run a full scan too.
pub const OVER_LIMIT: usize = 1 << 14;

/// What the last run did (for tests and benchmarks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunStats {
    pub full_scan: bool,
    pub looked_at: usize,
    pub ordered_by_scan: bool,
}

/// A task the last run decided drops for.
#[derive(Debug)]
pub struct Decided<T> {
    pub task: T,
    /// Replicas ReduceReplicas keeps for it (`n_holders - base_excess`): the
    /// same at the next run unless something touches the task.
    pub keep: i64,
}

/// One full scan in progress (see `TrackerState::begin_full_scan`).
#[derive(Debug)]
pub struct FullScan {
    keeping: bool,
    looked_at: usize,
}

impl FullScan {
    /// False once the scan found more than `OVER_LIMIT` over-replicated
    /// tasks: it then keeps nothing (no `over`, no `decided`).
    pub fn keeping(&self) -> bool {
        self.keeping
    }
}

/// The tracker's sets and rescan flag.
#[derive(Debug)]
pub struct TrackerState<T> {
    decided: AddrMap<Decided<T>>,
    over: AddrMap<T>,
    dirty: AddrMap<T>,
    targets: AddrMap<T>,
    rescan: bool,
    last: RunStats,
}

impl<T> Default for TrackerState<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> TrackerState<T> {
    /// A tracker whose first run scans everything.
    pub fn new() -> Self {
        TrackerState {
            decided: AddrMap::default(),
            over: AddrMap::default(),
            dirty: AddrMap::default(),
            targets: AddrMap::default(),
            rescan: true,
            last: RunStats::default(),
        }
    }

    /// Whether the next run must scan every replicated task.
    pub fn rescan(&self) -> bool {
        self.rescan
    }

    /// Report that the task at `addr` may have changed (its replicas, its
    /// waiters or where they run). `task()` is called only if it is kept.
    pub fn touch(&mut self, addr: usize, task: impl FnOnce() -> T) {
        if self.rescan {
            return; // the next run looks at everything anyway
        }
        if self.dirty.len() >= DIRTY_LIMIT {
            self.dirty.clear();
            self.rescan = true;
            return;
        }
        self.dirty.insert(addr, task());
    }

    /// Make the next run scan every replicated task.
    pub fn request_rescan(&mut self) {
        self.rescan = true;
        self.dirty.clear();
        self.decided.clear();
    }

    /// Number of tasks that had drops to suggest at their last look.
    pub fn over_replicated(&self) -> usize {
        self.over.len()
    }

    /// What the last run did.
    pub fn last_run(&self) -> RunStats {
        self.last
    }

    /// At the start of a run: the tasks the last run decided drops for and
    /// that nothing touched since. The caller reads how many replicas each
    /// has now and calls `settle` for it.
    pub fn take_settling(&mut self) -> Vec<(usize, Decided<T>)> {
        let mut decided = std::mem::take(&mut self.decided);
        let dirty = &self.dirty;
        let settle = decided
            .drain()
            .filter(|(a, _)| !dirty.contains_key(a))
            .collect();
        // The map keeps its capacity for the next run.
        self.decided = decided;
        settle
    }

    /// A decided task has `n_holders` replicas now: it is over-replicated if
    /// that is more than it kept (its drops were sent; a worker refusing one
    /// adds the replica back).
    pub fn settle(&mut self, addr: usize, decided: Decided<T>, n_holders: usize) {
        if n_holders as i64 > decided.keep {
            self.over.insert(addr, decided.task);
        } else {
            self.over.remove(&addr);
        }
    }

    /// Start a full scan: forget `over`, clear the rescan flag.
    pub fn begin_full_scan(&mut self) -> FullScan {
        self.over.clear();
        self.rescan = false;
        FullScan {
            keeping: true,
            looked_at: 0,
        }
    }

    /// The full scan looked at the task at `addr`, whose drops ignoring this
    /// run's pending actions are `base_excess`.
    pub fn scanned(
        &mut self,
        scan: &mut FullScan,
        addr: usize,
        base_excess: i64,
        task: impl FnOnce() -> T,
    ) {
        scan.looked_at += 1;
        if scan.keeping && base_excess > 0 {
            if self.over.len() == OVER_LIMIT {
                scan.keeping = false;
                self.over.clear();
                self.decided.clear();
            } else {
                self.over.insert(addr, task());
            }
        }
    }

    /// End a full scan: one that stopped keeping leaves a rescan to the next.
    pub fn end_full_scan(&mut self, scan: FullScan) {
        self.rescan = !scan.keeping;
        self.last = RunStats {
            full_scan: true,
            looked_at: scan.looked_at,
            ordered_by_scan: false,
        };
    }

    /// The tasks a run that is not a full scan looks at: `over`, `dirty`,
    /// the last run's `targets` and `extra` (this run's pending and target
    /// tasks), by address, in address order, each once.
    pub fn candidates(&self, extra: impl IntoIterator<Item = usize>) -> Vec<usize> {
        let mut addrs: Vec<usize> =
            Vec::with_capacity(self.over.len() + self.dirty.len() + self.targets.len());
        for map in [&self.over, &self.dirty, &self.targets] {
            addrs.extend(map.keys());
        }
        addrs.extend(extra);
        addrs.sort_unstable();
        addrs.dedup();
        addrs
    }

    /// A run that is not a full scan looked at the task at `addr`: it has
    /// `n_holders` replicas and `base_excess` drops ignoring pending actions.
    /// False if it is not replicated (fewer than 2 holders: nothing to
    /// decide for it).
    pub fn looked(
        &mut self,
        addr: usize,
        n_holders: i64,
        base_excess: i64,
        task: impl FnOnce() -> T,
    ) -> bool {
        if n_holders < 2 {
            self.over.remove(&addr);
            return false;
        }
        if base_excess > 0 {
            self.over.insert(addr, task());
        } else {
            self.over.remove(&addr);
        }
        true
    }

    /// A run decided `dropped` drops for the task at `addr`, keeping `keep`
    /// replicas: the next run settles it (see `take_settling`).
    pub fn decided(&mut self, addr: usize, keep: i64, dropped: usize, task: impl FnOnce() -> T) {
        if dropped > 0 {
            self.decided.insert(addr, Decided { task: task(), keep });
        }
    }

    /// End a run that was not a full scan.
    pub fn end_changed_only(&mut self, looked_at: usize, ordered_by_scan: bool) {
        self.last = RunStats {
            full_scan: false,
            looked_at,
            ordered_by_scan,
        };
    }

    /// After any run: the changes are consumed, and `targets` (this run's
    /// `KeepReplicas` targets) are looked at again next run.
    pub fn finish_run(&mut self, targets: impl IntoIterator<Item = (usize, T)>) {
        self.dirty.clear();
        self.targets.clear();
        self.targets.extend(targets);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tracker after a first (full) run that found `over` over-replicated.
    fn after_full_scan(over: &[usize]) -> TrackerState<usize> {
        let mut t = TrackerState::new();
        let mut scan = t.begin_full_scan();
        for &a in over {
            t.scanned(&mut scan, a, 1, || a);
        }
        t.scanned(&mut scan, 999, 0, || 999);
        t.end_full_scan(scan);
        t.finish_run([]);
        t
    }

    #[test]
    fn first_run_is_a_full_scan_and_touches_before_it_are_ignored() {
        let mut t = TrackerState::<usize>::new();
        assert!(t.rescan());
        t.touch(16, || panic!("not kept: the next run scans everything"));
        let t = after_full_scan(&[32, 48]);
        assert!(!t.rescan());
        assert_eq!(t.over_replicated(), 2);
        assert_eq!(
            t.last_run(),
            RunStats {
                full_scan: true,
                looked_at: 3,
                ordered_by_scan: false
            }
        );
    }

    #[test]
    fn a_run_looks_at_over_dirty_targets_and_extra_once_in_address_order() {
        let mut t = after_full_scan(&[64, 32]);
        t.touch(48, || 48);
        t.touch(32, || 32);
        t.finish_run([]);
        assert_eq!(
            t.candidates([]),
            vec![32, 64],
            "changes are consumed by a run"
        );
        let mut t = after_full_scan(&[64, 32]);
        t.touch(48, || 48);
        assert_eq!(t.candidates([80, 16, 64]), vec![16, 32, 48, 64, 80]);
        t.finish_run([(96, 96)]);
        // dirty consumed, last run's targets kept for one more run
        assert_eq!(t.candidates([]), vec![32, 64, 96]);
        t.finish_run([]);
        assert_eq!(t.candidates([]), vec![32, 64]);
    }

    #[test]
    fn too_many_changes_fall_back_to_a_rescan() {
        let mut t = after_full_scan(&[]);
        for a in 0..DIRTY_LIMIT {
            t.touch(a * 16, || a);
        }
        assert!(!t.rescan());
        t.touch(DIRTY_LIMIT * 16, || 0);
        assert!(t.rescan());
        assert!(
            t.candidates([]).is_empty(),
            "the changed tasks are forgotten"
        );
    }

    #[test]
    fn request_rescan_forgets_changes_and_decisions() {
        let mut t = after_full_scan(&[16]);
        t.touch(32, || 32);
        t.decided(16, 2, 1, || 16);
        t.request_rescan();
        assert!(t.rescan());
        assert!(t.take_settling().is_empty());
        assert_eq!(t.candidates([]), vec![16]);
    }

    #[test]
    fn a_full_scan_over_the_limit_keeps_nothing_and_rescans_next_time() {
        let mut t = TrackerState::new();
        let mut scan = t.begin_full_scan();
        for a in 0..=OVER_LIMIT {
            t.scanned(&mut scan, a * 16, 1, || a);
            if scan.keeping() {
                t.decided(a * 16, 2, 1, || a);
            }
        }
        assert!(!scan.keeping());
        t.end_full_scan(scan);
        assert!(t.rescan());
        assert_eq!(t.over_replicated(), 0);
        assert!(t.take_settling().is_empty());
        assert_eq!(t.last_run().looked_at, OVER_LIMIT + 1);
    }

    #[test]
    fn decided_tasks_settle_by_their_replica_count_unless_touched() {
        let mut t = after_full_scan(&[16, 32, 48]);
        t.decided(16, 2, 1, || 16);
        t.decided(32, 2, 1, || 32);
        t.decided(48, 2, 1, || 48);
        t.decided(64, 2, 0, || panic!("no drops: nothing to settle"));
        t.finish_run([]);
        t.touch(48, || 48);
        let mut settling = t.take_settling();
        settling.sort_by_key(|(a, _)| *a);
        assert_eq!(
            settling
                .iter()
                .map(|(a, d)| (*a, d.keep))
                .collect::<Vec<_>>(),
            vec![(16, 2), (32, 2)],
            "a touched task is looked at again instead"
        );
        let mut it = settling.into_iter();
        let (a, d) = it.next().unwrap();
        t.settle(a, d, 2); // drops went through: kept 2, has 2
        let (a, d) = it.next().unwrap();
        t.settle(a, d, 3); // a worker refused a drop: still over
        assert_eq!(t.candidates([]), vec![32, 48]);
    }

    #[test]
    fn a_look_updates_over_and_skips_tasks_no_longer_replicated() {
        let mut t = after_full_scan(&[16, 32]);
        assert!(!t.looked(16, 1, 0, || 16), "one holder: not replicated");
        assert!(t.looked(32, 3, 0, || 32));
        assert!(t.looked(48, 3, 1, || 48));
        t.end_changed_only(3, true);
        assert_eq!(t.candidates([]), vec![48]);
        assert_eq!(
            t.last_run(),
            RunStats {
                full_scan: false,
                looked_at: 3,
                ordered_by_scan: true
            }
        );
    }
}
