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

/// Why a suggestion was rejected: the one definition of the codes and of
/// stock's log messages (exported to Python as `AMM_REJECTIONS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// No candidate is a running worker.
    NoRunningCandidates = 1,
    /// Every running candidate already holds a replica.
    AllHoldReplica = 2,
    /// Every remaining candidate is already due to receive a replica.
    AllPendingReplication = 3,
    /// Fewer than two replicas would be left after pending drops.
    LastReplica = 11,
    /// None of the suggested candidates holds a replica.
    NoCandidateHolds = 12,
    /// Every remaining candidate is already due to drop its replica.
    AllPendingDrop = 13,
    /// Every remaining candidate has dependents of the key processing on it.
    AllHaveDependents = 14,
    /// Dropping would leave the only replica on a running worker while the
    /// other holders are paused or retiring and busy with dependents.
    PingPong = 15,
    /// The task is not in memory (replications only).
    NotInMemory = 21,
    /// The task is an actor.
    Actor = 22,
    /// The task has no replicas (`who_has` is None; drops only).
    NoReplicas = 23,
}

impl Reject {
    /// Every code, in numeric order.
    pub const ALL: [Reject; 11] = [
        Reject::NoRunningCandidates,
        Reject::AllHoldReplica,
        Reject::AllPendingReplication,
        Reject::LastReplica,
        Reject::NoCandidateHolds,
        Reject::AllPendingDrop,
        Reject::AllHaveDependents,
        Reject::PingPong,
        Reject::NotInMemory,
        Reject::Actor,
        Reject::NoReplicas,
    ];

    /// The numeric code (stable; Python sees it as `last_reject`).
    pub fn code(self) -> i64 {
        self as i64
    }

    /// Stock's log message for the rejection. `NotInMemory`'s is a
    /// `str.format` template over the task's `state`; `NoReplicas` has none
    /// (stock rejects that silently).
    pub fn message(self) -> &'static str {
        match self {
            Reject::NoRunningCandidates => "no running candidates",
            Reject::AllHoldReplica => "all candidates already own a replica",
            Reject::AllPendingReplication => "already pending replication on all candidates",
            Reject::LastReplica => "less than 2 replicas exist",
            Reject::NoCandidateHolds => "no candidates suggested by the policy own a replica",
            Reject::AllPendingDrop => "already pending drop on all candidates",
            Reject::AllHaveDependents => {
                "all candidates have dependent tasks queued or running on them"
            }
            Reject::PingPong => {
                "there is only one replica on workers that aren't paused or retiring"
            }
            Reject::NotInMemory => "ts.state = {state}",
            Reject::Actor => "task is an actor",
            Reject::NoReplicas => "",
        }
    }
}

/// Stock keeps an extra replica per dependent still waiting, but only counts
/// where they wait (each unassigned waiter apart, waiters sharing a worker
/// once) when there are fewer than this many; above, each waiter counts.
pub const MAX_COUNTED_WAITERS: usize = 20;

/// Number of replicas ReduceReplicas keeps for a task wanting `desired`
/// replicas with `n_waiters` waiters: `max(desired, waiters)`, where waiters
/// is `places()` (the number of distinct places the waiters wait at) if
/// `desired < n_waiters < MAX_COUNTED_WAITERS`, else `n_waiters`. `places` is
/// only called in that case (it is the costly part).
pub fn replicas_to_keep(desired: i64, n_waiters: usize, places: impl FnOnce() -> usize) -> i64 {
    let counted = if desired < n_waiters as i64 && n_waiters < MAX_COUNTED_WAITERS {
        places()
    } else {
        n_waiters
    };
    desired.max(counted as i64)
}

/// How many drops ReduceReplicas suggests for a task: its holders beyond
/// those kept, counting this run's pending replications (+) and drops (-).
pub fn excess_replicas(n_holders: i64, keep: i64, pending_repl: i64, pending_drop: i64) -> i64 {
    n_holders - keep + pending_repl - pending_drop
}

/// A measure of `distributed.scheduler.MemoryState`, the per-worker figure
/// the AMM compares (`distributed.scheduler.active-memory-manager.measure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    Process,
    Managed,
    Spilled,
    UnmanagedOld,
    ManagedTotal,
    Unmanaged,
    UnmanagedRecent,
    Optimistic,
}

impl Measure {
    /// The measure named like the `MemoryState` attribute; None if unknown.
    pub fn from_name(name: &str) -> Option<Measure> {
        Some(match name {
            "process" => Measure::Process,
            "managed" => Measure::Managed,
            "spilled" => Measure::Spilled,
            "unmanaged_old" => Measure::UnmanagedOld,
            "managed_total" => Measure::ManagedTotal,
            "unmanaged" => Measure::Unmanaged,
            "unmanaged_recent" => Measure::UnmanagedRecent,
            "optimistic" => Measure::Optimistic,
            _ => return None,
        })
    }
}

/// What `WorkerState.memory` is computed from: `metrics["memory"]`,
/// `nbytes`, `metrics["spilled_bytes"]["memory"]` / `["disk"]` and
/// `_memory_unmanaged_old`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryInputs {
    pub process: i64,
    pub nbytes: i64,
    pub spilled_memory: i64,
    pub spilled_disk: i64,
    pub unmanaged_old: i64,
}

/// `getattr(ws.memory, measure)` as `distributed` computes it
/// (`WorkerState.memory` builds a `MemoryState`, which clamps managed memory
/// to the process memory and old unmanaged memory to what is left). None if
/// an intermediate overflows i64 (the caller then asks Python).
pub fn memory_measure(measure: Measure, m: &MemoryInputs) -> Option<i64> {
    let managed = m
        .nbytes
        .checked_sub(m.spilled_memory)?
        .max(0)
        .min(m.process);
    let unmanaged = m.process.checked_sub(managed)?;
    let unmanaged_old = m.unmanaged_old.min(unmanaged);
    match measure {
        Measure::Process => Some(m.process),
        Measure::Managed => Some(managed),
        Measure::Spilled => Some(m.spilled_disk),
        Measure::UnmanagedOld => Some(unmanaged_old),
        Measure::ManagedTotal => managed.checked_add(m.spilled_disk),
        Measure::Unmanaged => Some(unmanaged),
        Measure::UnmanagedRecent => unmanaged.checked_sub(unmanaged_old),
        Measure::Optimistic => managed.checked_add(unmanaged_old),
    }
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
    /// Workers that may receive replicas, ordered by `(memory, index)`; built
    /// on the first recipient query (a run that only drops never needs it).
    by_memory: Option<BTreeSet<(i64, u32)>>,
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
        let flags = vec![0; memory.len()];
        WorkerTable {
            memory,
            running,
            eligible,
            by_memory: None,
            flags,
        }
    }

    /// The ordered index of eligible workers, built if not yet.
    fn index(&mut self) -> &BTreeSet<(i64, u32)> {
        let (memory, eligible) = (&self.memory, &self.eligible);
        self.by_memory.get_or_insert_with(|| {
            (0..memory.len())
                .filter(|&w| eligible[w])
                .map(|w| (memory[w], w as u32))
                .collect()
        })
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

    /// True if worker `w` has status running.
    ///
    /// # Panics
    /// If `w` is out of range.
    pub fn running(&self, w: u32) -> bool {
        self.running[w as usize]
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
            if let Some(index) = &mut self.by_memory {
                index.remove(&(old, w));
                index.insert((value, w));
            }
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
    ) -> Result<u32, Reject> {
        self.check(holders);
        self.check(pending);
        if let Some(c) = candidates {
            self.check(c);
        }
        if candidates.is_none() {
            self.index();
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

    fn recipient_among(&self, candidates: &[u32]) -> Result<u32, Reject> {
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
            None if !any_running => Err(Reject::NoRunningCandidates),
            None if !any_free => Err(Reject::AllHoldReplica),
            None => Err(Reject::AllPendingReplication),
        }
    }

    /// Needs the index built (`index`).
    fn recipient_any(&self) -> Result<u32, Reject> {
        let index = self
            .by_memory
            .as_ref()
            .expect("index built before the walk");
        if index.is_empty() {
            return Err(Reject::NoRunningCandidates);
        }
        let mut any_free = false;
        for &(_, w) in index {
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
            Reject::AllPendingReplication
        } else {
            Reject::AllHoldReplica
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
    ) -> Result<u32, Reject> {
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
    ) -> Result<u32, Reject> {
        // Distinct holders and distinct pending drops, as set sizes.
        let n_holders = self.count_distinct(holders);
        let n_pending = self.count_distinct(pending);
        if (n_holders as i64) - (n_pending as i64) < 2 {
            return Err(Reject::LastReplica);
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
            return Err(Reject::NoCandidateHolds);
        }
        if !any_not_pending {
            return Err(Reject::AllPendingDrop);
        }
        let Some((_, _, std::cmp::Reverse(choice))) = best else {
            return Err(Reject::AllHaveDependents);
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
            return Err(Reject::PingPong);
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

/// What ReduceReplicas needs to know about one task, as plain data gathered
/// by the binding. Worker lists hold table indices; workers unknown to the run
/// are left out.
#[derive(Debug, Clone, Default)]
pub struct DropRequest {
    /// Holders of the task (`who_has`).
    pub holders: Vec<u32>,
    /// `len(who_has)`, counting holders unknown to the run.
    pub n_holders: i64,
    /// Holders already due to drop the task in this run (`pending` drops).
    pub pending_drop: Vec<u32>,
    /// Workers where dependents of the task are processing.
    pub dependents: Vec<u32>,
    /// The task's size, accounted on each dropper.
    pub nbytes: i64,
    /// The task is an actor (every drop is rejected).
    pub actor: bool,
}

/// Stock `ReduceReplicas` for one task with `ndrop` (> 0) suggested drops:
/// each suggestion asks for the best dropper given the drops accepted so far
/// (stock's `_find_dropper`, in order); the first rejection ends the task, as
/// every later suggestion would be rejected alike. Accepted drops are
/// accounted in `table` and appended to `dropped` in order.
///
/// Buffers are the caller's (a run decides many tasks): `dropped` receives the
/// droppers; `scratch` is overwritten.
pub fn reduce_task_into(
    table: &mut WorkerTable,
    task: &DropRequest,
    ndrop: i64,
    scratch: &mut Vec<u32>,
    dropped: &mut Vec<u32>,
) {
    dropped.clear();
    if task.n_holders == 0 || task.actor {
        return;
    }
    scratch.clear();
    scratch.extend_from_slice(&task.pending_drop);
    for _ in 0..ndrop {
        let Ok(w) = table.find_dropper(&task.holders, scratch, None, &task.dependents) else {
            break;
        };
        table.drop_replica(w, task.nbytes);
        scratch.push(w);
        dropped.push(w);
    }
}

/// What RetireWorker needs to know about one (non-actor) task of the retiring
/// worker, as plain data gathered by the binding.
#[derive(Debug, Clone, Default)]
pub struct RetireRequest {
    /// Holders of the task, as table indices.
    pub holders: Vec<u32>,
    /// `len(who_has)`.
    pub n_holders: usize,
    /// Holders already due to drop the task in this run.
    pub pending_drop: Vec<u32>,
    /// A replication of the task is already pending in this run.
    pub pending_repl: bool,
    /// Workers where dependents are processing; only read if `n_holders > 1`.
    pub dependents: Vec<u32>,
    /// The task is in memory.
    pub in_memory: bool,
    /// The task's size.
    pub nbytes: i64,
}

/// What RetireWorker did with one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetireOutcome {
    /// The retiring worker drops its replica (accepted drop from this worker).
    Dropped(u32),
    /// The drop was rejected but a running worker keeps a replica: nothing to do.
    KeptElsewhere,
    /// The task must move, and a replication is already pending.
    AlreadyPending,
    /// The task moves: accepted replication onto this worker.
    Replicated(u32),
    /// The task must move but nobody can receive it.
    NoRecipient(Reject),
}

impl RetireOutcome {
    /// The task counts among the keys being moved away (stock's `nrepl`).
    pub fn moves(self) -> bool {
        !matches!(
            self,
            RetireOutcome::Dropped(_) | RetireOutcome::KeptElsewhere
        )
    }
}

/// Stock `RetireWorker` for one task held by retiring worker `w`: a replicated
/// task is offered for dropping from `w`; a task that stays unique, or whose
/// other replicas are all on workers that are not running, is replicated to the
/// least loaded running worker unless a replication is already pending.
/// Accepted actions are accounted in `table`.
pub fn retire_task(table: &mut WorkerTable, w: u32, task: &RetireRequest) -> RetireOutcome {
    if task.n_holders > 1 {
        if let Ok(d) = table.find_dropper(
            &task.holders,
            &task.pending_drop,
            Some(&[w]),
            &task.dependents,
        ) {
            table.drop_replica(d, task.nbytes);
            return RetireOutcome::Dropped(d);
        }
        if task.holders.iter().any(|&h| table.eligible(h)) {
            return RetireOutcome::KeptElsewhere;
        }
    }
    if task.pending_repl {
        return RetireOutcome::AlreadyPending;
    }
    if !task.in_memory {
        return RetireOutcome::NoRecipient(Reject::NotInMemory);
    }
    match table.find_recipient(None, &task.holders, &[]) {
        Ok(r) => {
            table.add_replica(r, task.nbytes);
            RetireOutcome::Replicated(r)
        }
        Err(e) => RetireOutcome::NoRecipient(e),
    }
}

/// True if running [`reduce_task_into`] over `tasks` (task `i` with
/// `ndrop[i]` drops) gives the same drops in every order, so stock's order
/// (the iteration order of `scheduler.replicated_tasks`) need not be known.
///
/// Tasks interact only through the memory of the workers they may drop from
/// (holders not pending a drop and without dependents processing there). The
/// drops of one task are the top ones of its eligible holders by `(not
/// running, memory)` at the time it runs; a later drop can lower a worker's
/// memory by at most the sizes of the other tasks that may drop from it. If,
/// for a task, each of its best `ndrop` candidates keeps its rank over the
/// ones below it under any such lowering, no order can change its choices
/// (which of them are accepted is counted, not ranked): it is *settled*, and drops in
/// every order exactly what it drops when run first. A settled task lowers
/// only the workers it drops from, so the bound of the others shrinks; the
/// check is repeated until every task is settled (true) or a round settles
/// none (false). Conservative: false means "maybe order-dependent".
pub fn order_independent(table: &WorkerTable, tasks: &[&DropRequest], ndrop: &[i64]) -> bool {
    assert_eq!(tasks.len(), ndrop.len(), "tasks/ndrop length mismatch");
    if tasks.len() < 2 {
        return true;
    }
    let droppable = |task: &DropRequest, h: u32| {
        !task.actor && !task.pending_drop.contains(&h) && !task.dependents.contains(&h)
    };
    // Per task: None while unsettled, else the range of `drops` holding the
    // workers it drops from.
    let mut settled: Vec<Option<std::ops::Range<usize>>> = vec![None; tasks.len()];
    let mut drops: Vec<u32> = Vec::new();
    // A copy of the table on which settled tasks are run first (restored after each).
    let mut first: Option<WorkerTable> = None;
    let (mut scratch, mut dropped) = (Vec::new(), Vec::new());
    let mut cands: Vec<(bool, i64, i64, u32)> = Vec::new();
    let mut newly: Vec<usize> = Vec::new();
    loop {
        // Upper bound of what the tasks may take off each worker (indexed by
        // worker: a run has few workers next to the tasks it looks at).
        let mut exposure = vec![0i64; table.len()];
        for (task, range) in tasks.iter().zip(&settled) {
            let mut add = |h: u32| {
                exposure[h as usize] = exposure[h as usize].saturating_add(task.nbytes);
            };
            match range {
                Some(r) => drops[r.clone()].iter().copied().for_each(&mut add),
                None => task
                    .holders
                    .iter()
                    .copied()
                    .filter(|&h| droppable(task, h))
                    .for_each(&mut add),
            }
        }
        newly.clear();
        let mut unsettled = false;
        for (i, task) in tasks.iter().enumerate() {
            if settled[i].is_some() {
                continue;
            }
            cands.clear();
            for &h in &task.holders {
                if !droppable(task, h) {
                    continue;
                }
                let hi = table.memory(h);
                // The task itself counts in `exposure` at each of its candidates.
                let other = exposure[h as usize].saturating_sub(task.nbytes);
                let lo = hi.saturating_sub(other).max(0);
                cands.push((!table.running(h), hi, lo, h));
            }
            // Best first, as find_dropper ranks: (not running, memory) high, then index low.
            cands.sort_unstable_by(|a, b| (b.0, b.1, a.3).cmp(&(a.0, a.1, b.3)));
            // How many drops are accepted (k <= ndrop) does not depend on order
            // (only on counts); which ones does unless each of the first k
            // candidates outranks the next under any lowering. Neighbours
            // suffice (the bounds chain: lower candidates rank below the next
            // one's upper bound); running status outranks memory. The ranking
            // below the drops does not matter.
            let prefix = usize::try_from(ndrop[i]).unwrap_or(0).min(cands.len());
            let holds = cands.windows(2).take(prefix).all(|pair| {
                let (c, o) = (pair[0], pair[1]);
                let fixed_tie = c.1 == c.2 && o.1 == o.2; // neither moves: index decides
                c.0 != o.0 || fixed_tie || c.2 > o.1
            });
            if holds {
                newly.push(i);
            } else {
                unsettled = true;
            }
        }
        if !unsettled {
            return true;
        }
        if newly.is_empty() {
            return false;
        }
        // What the newly settled tasks drop, run first (on a copy of the table).
        let t = first.get_or_insert_with(|| table.clone());
        for &i in &newly {
            reduce_task_into(t, tasks[i], ndrop[i], &mut scratch, &mut dropped);
            for &w in &dropped {
                t.set_memory(w, table.memory(w));
            }
            settled[i] = Some(drops.len()..drops.len() + dropped.len());
            drops.extend_from_slice(&dropped);
        }
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
            Err(Reject::NoRunningCandidates)
        );
        assert_eq!(
            t.find_recipient(None, &[0, 1, 2], &[]),
            Err(Reject::AllHoldReplica)
        );
        assert_eq!(
            t.find_recipient(None, &[0, 1], &[2]),
            Err(Reject::AllPendingReplication)
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
            Err(Reject::LastReplica)
        );
        assert_eq!(t.find_dropper(&[0, 1, 2], &[0], None, &[]), Ok(1));
        assert_eq!(t.find_dropper(&[0, 1, 2], &[], Some(&[2]), &[]), Ok(2));
        assert_eq!(
            t.find_dropper(&[1, 2], &[], Some(&[0]), &[]),
            Err(Reject::NoCandidateHolds)
        );
        assert_eq!(
            t.find_dropper(&[0, 1, 2], &[2], Some(&[2]), &[]),
            Err(Reject::AllPendingDrop)
        );
        assert_eq!(
            t.find_dropper(&[0, 1, 2], &[], Some(&[2]), &[2]),
            Err(Reject::AllHaveDependents)
        );
    }

    #[test]
    fn ping_pong_guard() {
        // Worker 0 is retiring and busy with dependents; worker 1 running.
        let mut t = table(&[1, 9], &[false, true]);
        assert_eq!(
            t.find_dropper(&[0, 1], &[], None, &[0]),
            Err(Reject::PingPong)
        );
        // If the busy holder is running, there is no guard.
        let mut t = table(&[1, 9], &[true, true]);
        assert_eq!(t.find_dropper(&[0, 1], &[], None, &[0]), Ok(1));
        // Two eligible holders: no guard either.
        let mut t = table(&[1, 9, 3], &[false, true, true]);
        assert_eq!(t.find_dropper(&[0, 1, 2], &[], None, &[0]), Ok(1));
    }

    fn reduce_task(table: &mut WorkerTable, task: &DropRequest, ndrop: i64) -> Vec<u32> {
        let mut dropped = Vec::new();
        reduce_task_into(table, task, ndrop, &mut Vec::new(), &mut dropped);
        dropped
    }

    fn request(holders: &[u32], nbytes: i64) -> DropRequest {
        DropRequest {
            holders: holders.to_vec(),
            n_holders: holders.len() as i64,
            nbytes,
            ..DropRequest::default()
        }
    }

    #[test]
    fn keep_counts_waiter_places_only_below_the_limit() {
        let never = || -> usize { panic!("places must not be counted") };
        assert_eq!(replicas_to_keep(1, 0, never), 1);
        assert_eq!(replicas_to_keep(1, 1, never), 1);
        assert_eq!(replicas_to_keep(1, 5, || 2), 2);
        assert_eq!(replicas_to_keep(3, 5, || 2), 3);
        assert_eq!(replicas_to_keep(4, 4, never), 4);
        assert_eq!(replicas_to_keep(1, MAX_COUNTED_WAITERS, never), 20);
        assert_eq!(replicas_to_keep(1, MAX_COUNTED_WAITERS - 1, || 3), 3);
        assert_eq!(excess_replicas(4, 1, 0, 0), 3);
        assert_eq!(excess_replicas(4, 2, 1, 2), 1);
    }

    #[test]
    fn reduce_task_drops_heaviest_holders_in_turn() {
        let mut t = table(&[10, 40, 30, 20], &[true, true, true, true]);
        assert_eq!(
            reduce_task(&mut t, &request(&[0, 1, 2, 3], 5), 3),
            vec![1, 2, 3]
        );
        assert_eq!(t.memory(1), 35);
        assert_eq!(t.memory(3), 15);
        // Pending drops count against the last replica and are not chosen again.
        let mut t = table(&[10, 40, 30], &[true, true, true]);
        let mut task = request(&[0, 1, 2], 5);
        task.pending_drop = vec![1];
        assert_eq!(reduce_task(&mut t, &task, 2), vec![2]);
        // Workers with dependents processing keep their replica.
        let mut t = table(&[10, 40, 30], &[true, true, true]);
        let mut task = request(&[0, 1, 2], 5);
        task.dependents = vec![1];
        assert_eq!(reduce_task(&mut t, &task, 2), vec![2, 0]);
        // Actors and tasks without replicas are never dropped.
        task.actor = true;
        assert!(reduce_task(&mut t, &task, 2).is_empty());
        assert!(reduce_task(&mut t, &DropRequest::default(), 1).is_empty());
        // Not running first, whatever the memory.
        let mut t = table(&[1, 40], &[false, true]);
        assert_eq!(reduce_task(&mut t, &request(&[0, 1], 5), 1), vec![0]);
    }

    #[test]
    fn retire_task_drops_moves_or_reports() {
        // Worker 0 retires (not eligible); 1 and 2 run.
        let mut t = WorkerTable::new(
            vec![5, 50, 10],
            vec![false, true, true],
            vec![false, true, true],
        );
        let replicated = RetireRequest {
            holders: vec![0, 1],
            n_holders: 2,
            nbytes: 3,
            in_memory: true,
            ..RetireRequest::default()
        };
        assert_eq!(
            retire_task(&mut t, 0, &replicated),
            RetireOutcome::Dropped(0)
        );
        assert_eq!(t.memory(0), 2);
        let unique = RetireRequest {
            holders: vec![0],
            n_holders: 1,
            nbytes: 3,
            in_memory: true,
            ..RetireRequest::default()
        };
        assert_eq!(
            retire_task(&mut t, 0, &unique),
            RetireOutcome::Replicated(2)
        );
        assert_eq!(t.memory(2), 13);
        let pending = RetireRequest {
            pending_repl: true,
            ..unique.clone()
        };
        assert_eq!(
            retire_task(&mut t, 0, &pending),
            RetireOutcome::AlreadyPending
        );
        let lost = RetireRequest {
            in_memory: false,
            ..unique.clone()
        };
        assert_eq!(
            retire_task(&mut t, 0, &lost),
            RetireOutcome::NoRecipient(Reject::NotInMemory)
        );
        // Drop rejected (dependents on 0) but worker 1 runs and keeps a replica.
        let busy = RetireRequest {
            dependents: vec![0],
            ..replicated.clone()
        };
        assert_eq!(retire_task(&mut t, 0, &busy), RetireOutcome::KeptElsewhere);
        assert!(!RetireOutcome::KeptElsewhere.moves());
        // Nobody running: no recipient.
        let mut t = WorkerTable::new(vec![5, 50], vec![false, false], vec![false, false]);
        assert_eq!(
            retire_task(&mut t, 0, &unique),
            RetireOutcome::NoRecipient(Reject::NoRunningCandidates)
        );
        assert!(RetireOutcome::NoRecipient(Reject::NoRunningCandidates).moves());
    }

    #[test]
    fn reject_codes_are_unique_and_documented() {
        let codes: BTreeSet<i64> = Reject::ALL.iter().map(|r| r.code()).collect();
        assert_eq!(codes.len(), Reject::ALL.len());
        for r in Reject::ALL {
            assert_eq!(r.message().is_empty(), r == Reject::NoReplicas);
        }
    }

    /// Every order of `items` (few of them).
    fn permutations(items: &[usize]) -> Vec<Vec<usize>> {
        if items.len() <= 1 {
            return vec![items.to_vec()];
        }
        let mut out = Vec::new();
        for i in 0..items.len() {
            let mut rest = items.to_vec();
            let head = rest.remove(i);
            for mut p in permutations(&rest) {
                p.insert(0, head);
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn order_independence_is_conservative_on_random_batches() {
        // Whenever order_independent says yes, every order gives the same drops.
        let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = |m: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        let (mut yes, mut no) = (0, 0);
        for _ in 0..4000 {
            let n = 2 + next(6) as usize;
            let memory: Vec<i64> = (0..n).map(|_| next(60) as i64).collect();
            let running: Vec<bool> = (0..n).map(|_| next(4) != 0).collect();
            let base = table(&memory, &running);
            let tasks: Vec<(DropRequest, i64)> = (0..2 + next(3))
                .map(|_| {
                    let k = 2 + next(n as u64 - 1) as usize;
                    let mut hs: Vec<u32> = (0..n as u32).collect();
                    for i in 0..n {
                        hs.swap(i, i + next((n - i) as u64) as usize);
                    }
                    hs.truncate(k.min(n));
                    (request(&hs, 1 + next(8) as i64), 1 + next(2) as i64)
                })
                .collect();
            let refs: Vec<&DropRequest> = tasks.iter().map(|(t, _)| t).collect();
            let ndrops: Vec<i64> = tasks.iter().map(|(_, k)| *k).collect();
            let run = |order: &[usize]| {
                let mut t = base.clone();
                let mut out = vec![Vec::new(); tasks.len()];
                for &i in order {
                    let mut d = reduce_task(&mut t, &tasks[i].0, tasks[i].1);
                    d.sort_unstable();
                    out[i] = d;
                }
                out
            };
            if order_independent(&base, &refs, &ndrops) {
                yes += 1;
                let forward: Vec<usize> = (0..tasks.len()).collect();
                let want = run(&forward);
                for order in permutations(&forward) {
                    assert_eq!(run(&order), want, "order {order:?}");
                }
            } else {
                no += 1;
            }
        }
        assert!(yes > 20 && no > 20, "both outcomes exercised: {yes} {no}");
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
            // Drops before the first query: the index is built from them.
            for _ in 0..next(3) {
                t.drop_replica(next(n as u64) as u32, next(5) as i64);
            }
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

    #[test]
    fn memory_measure_clamps_as_memory_state() {
        let m = |process, nbytes, spilled_memory, spilled_disk, unmanaged_old| MemoryInputs {
            process,
            nbytes,
            spilled_memory,
            spilled_disk,
            unmanaged_old,
        };
        let all = |i: &MemoryInputs| {
            [
                "process",
                "managed",
                "spilled",
                "unmanaged_old",
                "managed_total",
                "unmanaged",
                "unmanaged_recent",
                "optimistic",
            ]
            .map(|n| memory_measure(Measure::from_name(n).unwrap(), i).unwrap())
        };
        // process 100, managed 30, old unmanaged 20, spilled 7.
        assert_eq!(
            all(&m(100, 40, 10, 7, 20)),
            [100, 30, 7, 20, 37, 70, 50, 50]
        );
        // managed above process is clamped to it; old unmanaged to what is left.
        assert_eq!(all(&m(50, 80, 0, 0, 20)), [50, 50, 0, 0, 50, 0, 0, 50]);
        // spilled-in-memory above nbytes: managed 0; old unmanaged up to process.
        assert_eq!(all(&m(10, 5, 9, 1, 99)), [10, 0, 1, 10, 1, 10, 0, 10]);
        assert_eq!(Measure::from_name("rss"), None);
        assert_eq!(
            memory_measure(Measure::Process, &m(0, i64::MIN, 1, 0, 0)),
            None
        );
    }
}
