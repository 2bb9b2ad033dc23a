//! Candidate selection for the Active Memory Manager.
//!
//! A [`WorkerTable`] lives for one AMM run. It holds, for every worker of the
//! cluster (identified by its position `0..n` in the scheduler's worker dict),
//! the memory downstream of the actions accepted so far in the run and whether
//! the worker is running (status `running`) and may receive replicas (member
//! of `Scheduler.running`). It answers the two questions the AMM asks for each
//! suggestion:
//!
//! * [`WorkerTable::find_recipient`]: the eligible worker with the lowest
//!   memory that neither holds the key nor is already due to receive it. With
//!   no explicit candidate list this walks an ordered index over
//!   `(memory, worker)` and stops at the first worker not excluded, so it costs
//!   `O(log n + excluded)` instead of a scan of all `n` workers.
//! * [`WorkerTable::find_dropper`]: the holder with the highest memory,
//!   non-running holders first, never the last replica, never a worker where a
//!   dependent is processing, with the ping-pong guard between policies that
//!   reduce replicas and those that retire workers. It costs
//!   `O(holders + candidates + dependents)`, independent of the cluster size.
//!
//! Tie rule: among workers with equal sort keys, the one with the lowest index
//! (the earliest in the scheduler's worker dict) wins, for both questions.
//!
//! Memory bookkeeping mirrors `distributed`: an accepted replication adds the
//! key's size to the recipient; an accepted drop subtracts it from the dropper,
//! clamped at zero.

use std::collections::BTreeSet;

/// Why [`WorkerTable::find_recipient`] found nobody.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRecipient {
    /// No candidate is a running worker.
    NoRunningCandidates = 1,
    /// Every running candidate already holds a replica.
    AllHoldReplica = 2,
    /// Every remaining candidate is already due to receive a replica.
    AllPending = 3,
}

/// Why [`WorkerTable::find_dropper`] found nobody.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoDropper {
    /// Fewer than two replicas would be left after pending drops.
    LastReplica = 11,
    /// None of the suggested candidates holds a replica.
    NoCandidateHolds = 12,
    /// Every remaining candidate is already due to drop its replica.
    AllPending = 13,
    /// Every remaining candidate has dependents of the key processing on it.
    AllHaveDependents = 14,
    /// Dropping would leave the only replica on a running worker while the
    /// other holders are paused or retiring and busy with dependents.
    PingPong = 15,
}

// Scratch flag bits, set for the duration of one query and cleared after it.
const HOLDER: u8 = 2;
const CANDIDATE: u8 = 4;
const PENDING: u8 = 8;
const DEPENDENT: u8 = 16;
const SEEN: u8 = 32;

/// Per-run worker table; see the module documentation.
#[derive(Debug, Clone)]
pub struct WorkerTable {
    memory: Vec<i64>,
    running: Vec<bool>,
    eligible: Vec<bool>,
    /// Workers that may receive replicas, ordered by `(memory, index)`.
    by_memory: BTreeSet<(i64, u32)>,
    flags: Vec<u8>,
}

#[allow(clippy::len_without_is_empty)]
impl WorkerTable {
    /// Build a table from per-worker memory, running status (`status ==
    /// running`) and eligibility as a replica recipient.
    ///
    /// # Panics
    /// If the three vectors differ in length or hold more than `u32::MAX` workers.
    pub fn new(memory: Vec<i64>, running: Vec<bool>, eligible: Vec<bool>) -> WorkerTable {
        assert_eq!(
            memory.len(),
            running.len(),
            "memory/running length mismatch"
        );
        assert_eq!(
            memory.len(),
            eligible.len(),
            "memory/eligible length mismatch"
        );
        assert!(u32::try_from(memory.len()).is_ok(), "too many workers");
        let by_memory = (0..memory.len())
            .filter(|&w| eligible[w])
            .map(|w| (memory[w], w as u32))
            .collect();
        let flags = vec![0; memory.len()];
        WorkerTable {
            memory,
            running,
            eligible,
            by_memory,
            flags,
        }
    }

    /// Number of workers in the table.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Memory of worker `w`, downstream of accepted actions.
    ///
    /// # Panics
    /// If `w` is out of range.
    pub fn memory(&self, w: u32) -> i64 {
        self.memory[w as usize]
    }

    /// True if worker `w` may receive replicas (it is in `Scheduler.running`).
    ///
    /// # Panics
    /// If `w` is out of range.
    pub fn eligible(&self, w: u32) -> bool {
        self.eligible[w as usize]
    }

    /// Overwrite the memory of worker `w`, keeping the index consistent.
    ///
    /// # Panics
    /// If `w` is out of range.
    pub fn set_memory(&mut self, w: u32, value: i64) {
        let wi = w as usize;
        let old = self.memory[wi];
        if old == value {
            return;
        }
        if self.eligible[wi] {
            self.by_memory.remove(&(old, w));
            self.by_memory.insert((value, w));
        }
        self.memory[wi] = value;
    }

    /// Account an accepted replication of `nbytes` onto `w`.
    pub fn add_replica(&mut self, w: u32, nbytes: i64) {
        let value = self.memory[w as usize].saturating_add(nbytes);
        self.set_memory(w, value);
    }

    /// Account an accepted drop of `nbytes` from `w` (clamped at zero).
    pub fn drop_replica(&mut self, w: u32, nbytes: i64) {
        let value = self.memory[w as usize].saturating_sub(nbytes).max(0);
        self.set_memory(w, value);
    }

    fn check(&self, workers: &[u32]) {
        let n = self.memory.len();
        if let Some(&bad) = workers.iter().find(|&&w| w as usize >= n) {
            panic!("worker index {bad} out of range for {n} workers");
        }
    }

    fn mark(&mut self, workers: &[u32], bit: u8) {
        for &w in workers {
            self.flags[w as usize] |= bit;
        }
    }

    fn unmark(&mut self, workers: &[u32]) {
        for &w in workers {
            self.flags[w as usize] = 0;
        }
    }

    /// Choose a worker to receive a new replica of a key.
    ///
    /// `candidates`: the workers the policy allows, or `None` for all.
    /// `holders`: workers holding the key; `pending`: workers already due to
    /// receive it in this run. Returns the eligible candidate outside both sets
    /// with the lowest `(memory, index)`. Does not change the table; call
    /// [`WorkerTable::add_replica`] to accept.
    ///
    /// # Panics
    /// If any index is out of range.
    pub fn find_recipient(
        &mut self,
        candidates: Option<&[u32]>,
        holders: &[u32],
        pending: &[u32],
    ) -> Result<u32, NoRecipient> {
        self.check(holders);
        self.check(pending);
        if let Some(c) = candidates {
            self.check(c);
        }
        self.mark(holders, HOLDER);
        self.mark(pending, PENDING);
        let result = match candidates {
            Some(c) => self.recipient_among(c),
            None => self.recipient_any(),
        };
        self.unmark(holders);
        self.unmark(pending);
        result
    }

    fn recipient_among(&self, candidates: &[u32]) -> Result<u32, NoRecipient> {
        let mut best: Option<(i64, u32)> = None;
        let (mut any_running, mut any_free) = (false, false);
        for &w in candidates {
            let wi = w as usize;
            if !self.eligible[wi] {
                continue;
            }
            any_running = true;
            let f = self.flags[wi];
            if f & HOLDER != 0 {
                continue;
            }
            any_free = true;
            if f & PENDING != 0 {
                continue;
            }
            let key = (self.memory[wi], w);
            if best.is_none_or(|b| key < b) {
                best = Some(key);
            }
        }
        match best {
            Some((_, w)) => Ok(w),
            None if !any_running => Err(NoRecipient::NoRunningCandidates),
            None if !any_free => Err(NoRecipient::AllHoldReplica),
            None => Err(NoRecipient::AllPending),
        }
    }

    fn recipient_any(&self) -> Result<u32, NoRecipient> {
        if self.by_memory.is_empty() {
            return Err(NoRecipient::NoRunningCandidates);
        }
        let mut any_free = false;
        for &(_, w) in &self.by_memory {
            let f = self.flags[w as usize];
            if f & HOLDER != 0 {
                continue;
            }
            if f & PENDING != 0 {
                any_free = true;
                continue;
            }
            return Ok(w);
        }
        Err(if any_free {
            NoRecipient::AllPending
        } else {
            NoRecipient::AllHoldReplica
        })
    }

    /// Choose a worker to drop its replica of a key.
    ///
    /// `holders`: workers holding the key (its `who_has`); `pending`: holders
    /// already due to drop it in this run; `candidates`: the workers the
    /// policy allows, or `None` for all holders; `dependents`: workers where
    /// dependents of the key are processing. Returns the allowed holder, not
    /// pending and without dependents, with the highest
    /// `(not running, memory)` (lowest index on ties); never the last replica.
    /// Does not change the table; call [`WorkerTable::drop_replica`] to accept.
    ///
    /// # Panics
    /// If any index is out of range.
    pub fn find_dropper(
        &mut self,
        holders: &[u32],
        pending: &[u32],
        candidates: Option<&[u32]>,
        dependents: &[u32],
    ) -> Result<u32, NoDropper> {
        self.check(holders);
        self.check(pending);
        self.check(dependents);
        if let Some(c) = candidates {
            self.check(c);
        }
        self.mark(holders, HOLDER);
        self.mark(pending, PENDING);
        self.mark(dependents, DEPENDENT);
        if let Some(c) = candidates {
            self.mark(c, CANDIDATE);
        }
        let result = self.dropper_marked(holders, pending, candidates, dependents);
        self.unmark(holders);
        self.unmark(pending);
        self.unmark(dependents);
        if let Some(c) = candidates {
            self.unmark(c);
        }
        result
    }

    fn dropper_marked(
        &mut self,
        holders: &[u32],
        pending: &[u32],
        candidates: Option<&[u32]>,
        dependents: &[u32],
    ) -> Result<u32, NoDropper> {
        // Distinct holders and distinct pending drops, as set sizes.
        let n_holders = self.count_distinct(holders);
        let n_pending = self.count_distinct(pending);
        if (n_holders as i64) - (n_pending as i64) < 2 {
            return Err(NoDropper::LastReplica);
        }
        let allowed_bit = if candidates.is_some() { CANDIDATE } else { 0 };
        let is_candidate = |f: u8| f & HOLDER != 0 && f & allowed_bit == allowed_bit;

        // Walk the smaller of the two lists describing the candidate set.
        let walk = match candidates {
            Some(c) if c.len() < holders.len() => c,
            _ => holders,
        };
        let (mut any_candidate, mut any_not_pending) = (false, false);
        let mut n_eligible = 0usize;
        let mut best: Option<(bool, i64, std::cmp::Reverse<u32>)> = None;
        for &w in walk {
            let wi = w as usize;
            let f = self.flags[wi];
            if !is_candidate(f) || f & SEEN != 0 {
                continue;
            }
            self.flags[wi] |= SEEN;
            any_candidate = true;
            if f & PENDING != 0 {
                continue;
            }
            any_not_pending = true;
            if f & DEPENDENT != 0 {
                continue;
            }
            n_eligible += 1;
            let key = (!self.running[wi], self.memory[wi], std::cmp::Reverse(w));
            if best.is_none_or(|b| key > b) {
                best = Some(key);
            }
        }
        for &w in walk {
            self.flags[w as usize] &= !SEEN;
        }
        if !any_candidate {
            return Err(NoDropper::NoCandidateHolds);
        }
        if !any_not_pending {
            return Err(NoDropper::AllPending);
        }
        let Some((_, _, std::cmp::Reverse(choice))) = best else {
            return Err(NoDropper::AllHaveDependents);
        };

        // Candidates set aside only because dependents are processing there.
        let mut busy_any = false;
        let mut busy_all_not_running = true;
        for &w in dependents {
            let f = self.flags[w as usize];
            if is_candidate(f) && f & PENDING == 0 {
                busy_any = true;
                busy_all_not_running &= !self.running[w as usize];
            }
        }
        if n_eligible == 1 && self.running[choice as usize] && busy_any && busy_all_not_running {
            return Err(NoDropper::PingPong);
        }
        Ok(choice)
    }

    fn count_distinct(&mut self, workers: &[u32]) -> usize {
        let mut n = 0;
        for &w in workers {
            let f = &mut self.flags[w as usize];
            if *f & SEEN == 0 {
                *f |= SEEN;
                n += 1;
            }
        }
        for &w in workers {
            self.flags[w as usize] &= !SEEN;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(memory: &[i64], running: &[bool]) -> WorkerTable {
        WorkerTable::new(memory.to_vec(), running.to_vec(), running.to_vec())
    }

    /// Reference: the plain scan `distributed` does, with our tie rule.
    fn naive_recipient(t: &WorkerTable, cands: Option<&[u32]>, excl: &[u32]) -> Option<u32> {
        let all: Vec<u32> = (0..t.len() as u32).collect();
        cands
            .unwrap_or(&all)
            .iter()
            .copied()
            .filter(|&w| t.eligible[w as usize] && !excl.contains(&w))
            .min_by_key(|&w| (t.memory(w), w))
    }

    #[test]
    fn recipient_is_lowest_memory_eligible_non_holder() {
        let mut t = table(&[5, 1, 3, 0], &[true, true, true, false]);
        assert_eq!(t.find_recipient(None, &[1], &[]), Ok(2));
        assert_eq!(t.find_recipient(None, &[1], &[2]), Ok(0));
        assert_eq!(t.find_recipient(Some(&[0, 3]), &[], &[]), Ok(0));
        assert_eq!(
            t.find_recipient(Some(&[3]), &[], &[]),
            Err(NoRecipient::NoRunningCandidates)
        );
        assert_eq!(
            t.find_recipient(None, &[0, 1, 2], &[]),
            Err(NoRecipient::AllHoldReplica)
        );
        assert_eq!(
            t.find_recipient(None, &[0, 1], &[2]),
            Err(NoRecipient::AllPending)
        );
    }

    #[test]
    fn ties_go_to_lowest_index() {
        let mut t = table(&[7, 7, 7], &[true, true, true]);
        assert_eq!(t.find_recipient(None, &[], &[]), Ok(0));
        assert_eq!(t.find_recipient(Some(&[2, 1]), &[], &[]), Ok(1));
        assert_eq!(t.find_dropper(&[2, 1, 0], &[], None, &[]), Ok(0));
    }

    #[test]
    fn memory_updates_keep_index_consistent() {
        let mut t = table(&[10, 20, 30], &[true, true, true]);
        t.add_replica(0, 15);
        assert_eq!(t.find_recipient(None, &[], &[]), Ok(1));
        t.drop_replica(2, 100);
        assert_eq!(t.memory(2), 0);
        assert_eq!(t.find_recipient(None, &[], &[]), Ok(2));
    }

    #[test]
    fn dropper_prefers_not_running_then_memory() {
        let mut t = table(&[1, 9, 5], &[false, true, true]);
        assert_eq!(t.find_dropper(&[0, 1, 2], &[], None, &[]), Ok(0));
        assert_eq!(t.find_dropper(&[1, 2], &[], None, &[]), Ok(1));
        assert_eq!(
            t.find_dropper(&[1, 2], &[1], None, &[]),
            Err(NoDropper::LastReplica)
        );
        assert_eq!(t.find_dropper(&[0, 1, 2], &[0], None, &[]), Ok(1));
        assert_eq!(t.find_dropper(&[0, 1, 2], &[], Some(&[2]), &[]), Ok(2));
        assert_eq!(
            t.find_dropper(&[1, 2], &[], Some(&[0]), &[]),
            Err(NoDropper::NoCandidateHolds)
        );
        assert_eq!(
            t.find_dropper(&[0, 1, 2], &[2], Some(&[2]), &[]),
            Err(NoDropper::AllPending)
        );
        assert_eq!(
            t.find_dropper(&[0, 1, 2], &[], Some(&[2]), &[2]),
            Err(NoDropper::AllHaveDependents)
        );
    }

    #[test]
    fn ping_pong_guard() {
        // Worker 0 is retiring and busy with dependents; worker 1 running.
        let mut t = table(&[1, 9], &[false, true]);
        assert_eq!(
            t.find_dropper(&[0, 1], &[], None, &[0]),
            Err(NoDropper::PingPong)
        );
        // If the busy holder is running, there is no guard.
        let mut t = table(&[1, 9], &[true, true]);
        assert_eq!(t.find_dropper(&[0, 1], &[], None, &[0]), Ok(1));
        // Two eligible holders: no guard either.
        let mut t = table(&[1, 9, 3], &[false, true, true]);
        assert_eq!(t.find_dropper(&[0, 1, 2], &[], None, &[0]), Ok(1));
    }

    #[test]
    fn index_walk_matches_scan_on_random_tables() {
        // Small deterministic LCG so the test needs no extra crate.
        let mut seed: u64 = 0x2545F4914F6CDD1D;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        for _ in 0..200 {
            let n = 1 + next(40) as usize;
            let memory: Vec<i64> = (0..n).map(|_| next(8) as i64).collect();
            let running: Vec<bool> = (0..n).map(|_| next(4) != 0).collect();
            let mut t = table(&memory, &running);
            for _ in 0..20 {
                let excl: Vec<u32> = (0..next(6)).map(|_| next(n as u64) as u32).collect();
                let want = naive_recipient(&t, None, &excl);
                assert_eq!(t.find_recipient(None, &excl, &[]).ok(), want);
                if let Some(w) = want {
                    t.add_replica(w, next(5) as i64);
                }
            }
        }
    }
}
