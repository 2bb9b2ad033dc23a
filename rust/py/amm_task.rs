//! What the AMM bindings read from one scheduler `TaskState`, shared by a
//! run (`amm::AmmRun`) and the ReduceReplicas tracker (`amm_tracker`): the
//! attributes read ahead (`Prefetched`), a task's count of drops
//! (`Evaluated`), its inputs to `dask_shm_core::amm::reduce_task`
//! (`Prepared`), and `Decider`, what the tracker asks of a run.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySet};

use crate::set_order::SetTable;
use crate::slots::{prefetch_ahead, prefetch_at, SlotOffsets};
use dask_shm_core::amm::{self, DropRequest, WorkerTable};

/// What a ReduceReplicas run over tracked tasks needs of the run deciding
/// them (`AmmRun`), so that the tracker does not depend on the run's type.
pub(crate) trait Decider {
    /// ReduceReplicas' count for `ts` (no side effects); see `AmmRun::evaluate`.
    fn evaluate<'py>(
        ts: Bound<'py, PyAny>,
        ahead: Option<Prefetched<'py>>,
        pending: Option<&Bound<'py, PyDict>>,
        targets: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Evaluated<'py>>;
    /// Gather an evaluated task's inputs; see `AmmRun::prepare`.
    fn prepare<'py>(
        &mut self,
        ev: Evaluated<'py>,
        pending: &Bound<'py, PyDict>,
        defer: bool,
        request: DropRequest,
    ) -> PyResult<Prepared<'py>>;
    /// Decide a prepared task; returns how many replicas it drops.
    fn decide(&mut self, task: &Prepared<'_>) -> PyResult<usize>;
    /// The run's workers.
    fn table(&self) -> &WorkerTable;
}

/// `len(obj)`, 0 for None.
pub(crate) fn len_or_zero(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    if obj.is_none() {
        Ok(0)
    } else {
        obj.len()
    }
}

/// Where the waiters of one task are processing (`processing_on` of each
/// waiter that has one, by address), gathered while counting their places,
/// so that deciding the task's drops need not read the waiters again.
#[derive(Clone, Copy)]
pub(crate) struct WaitingOn {
    pub(crate) on: [usize; amm::MAX_COUNTED_WAITERS],
    pub(crate) len: usize,
}

impl WaitingOn {
    pub(crate) fn new() -> Self {
        WaitingOn {
            on: [0; amm::MAX_COUNTED_WAITERS],
            len: 0,
        }
    }

    pub(crate) fn as_slice(&self) -> &[usize] {
        &self.on[..self.len]
    }
}

/// Ask the CPU to start loading `lines` cache lines of `obj` after its first
/// (which the caller has just touched). A hint: no effect on results.
#[inline]
pub(crate) fn prefetch_lines(obj: &Bound<'_, PyAny>, lines: usize) {
    prefetch_at(obj.as_ptr() as usize, 1..=lines);
}

/// The `TaskState` attributes a run reads from many tasks, in the order of
/// their `SlotOffsets`.
const TASK_SLOTS: [&str; 4] = ["who_has", "waiters", "nbytes", "key"];
/// Cache lines (after the first) that hold those attributes and `actor` in
/// a `TaskState` (its slots end 288 bytes in; `actor` lies at 224).
pub(crate) const TASK_LINES: usize = 4;

/// Where the `TaskState` attributes of `TASK_SLOTS` lie in objects of `ts`'s
/// class, if they are plain slots.
pub(crate) fn task_slots(ts: &Bound<'_, PyAny>) -> Option<SlotOffsets> {
    SlotOffsets::of(&ts.get_type(), &TASK_SLOTS)
}

/// Prefetch the objects `ts`'s `who_has`, `waiters` (a small set keeps its
/// items in its first three lines), `nbytes` and `key` point to.
pub(crate) fn prefetch_values(slots: &SlotOffsets, ts: &Bound<'_, PyAny>) {
    for (i, lines) in [2, 2, 0, 0].into_iter().enumerate() {
        match slots.peek(ts, i) {
            Some(0) | None => {}
            Some(a) => prefetch_at(a, 0..=lines),
        }
    }
}

/// The attributes ReduceReplicas reads from a task, read ahead of its
/// evaluation: reading them for a batch of tasks in a tight loop lets the CPU
/// fetch many tasks' objects at once (the reads are mostly cache misses).
pub(crate) struct Prefetched<'py> {
    pub(crate) who_has: Bound<'py, PyAny>,
    pub(crate) waiters: Bound<'py, PyAny>,
    pub(crate) actor: Bound<'py, PyAny>,
    pub(crate) nbytes: Bound<'py, PyAny>,
    /// Read here, where its object was prefetched, for the deferred log.
    pub(crate) key: Bound<'py, PyAny>,
}

impl<'py> Prefetched<'py> {
    /// Prefetch the objects of the task's waiters (their reference count and
    /// `processing_on`, 104 bytes in: within the first three cache lines
    /// whatever the alignment), when `waiters` is a small set whose table can
    /// be read without touching them.
    pub(crate) fn prefetch_waiters(&self) {
        if let Some(table) = SetTable::of(&self.waiters) {
            for a in table.addresses().take(amm::MAX_COUNTED_WAITERS) {
                prefetch_at(a, 0..=2);
            }
        }
    }

    /// `read` for each of `tasks` (in order), with the objects of the tasks
    /// a few steps ahead, and then the objects their attributes point to,
    /// prefetched (see `slots`): the misses of many tasks overlap.
    pub(crate) fn read_all(tasks: &[(usize, Bound<'py, PyAny>)]) -> Vec<Option<Self>> {
        let slots = tasks.first().and_then(|(_, ts)| task_slots(ts));
        let mut out = Vec::with_capacity(tasks.len());
        for (i, (_, ts)) in tasks.iter().enumerate() {
            prefetch_ahead(
                tasks,
                i,
                |(a, _)| prefetch_at(*a, 0..=TASK_LINES),
                |(_, later)| {
                    if let Some(slots) = &slots {
                        prefetch_values(slots, later);
                    }
                },
            );
            out.push(Self::read(ts));
        }
        out
    }

    /// Read `ts`'s attributes and prefetch the small-set tables of `who_has`
    /// and `waiters`; None if a read fails (the evaluation then reads them
    /// itself, and raises where it would have).
    pub(crate) fn read(ts: &Bound<'py, PyAny>) -> Option<Self> {
        let py = ts.py();
        let who_has = ts.getattr(intern!(py, "who_has")).ok()?;
        let waiters = ts.getattr(intern!(py, "waiters")).ok()?;
        let actor = ts.getattr(intern!(py, "actor")).ok()?;
        let nbytes = ts.getattr(intern!(py, "nbytes")).ok()?;
        let key = ts.getattr(intern!(py, "key")).ok()?;
        // A set of up to 5 items keeps them inside the object (CPython's
        // `smalltable`, the 2nd to 4th cache lines).
        prefetch_lines(&who_has, 3);
        prefetch_lines(&waiters, 3);
        Some(Prefetched {
            who_has,
            waiters,
            actor,
            nbytes,
            key,
        })
    }
}

/// ReduceReplicas' look at one task: how many drops it suggests.
pub(crate) struct Evaluated<'py> {
    pub(crate) ts: Bound<'py, PyAny>,
    pub(crate) who_has: Bound<'py, PyAny>,
    pub(crate) n_holders: i64,
    /// Drops suggested ignoring this run's pending actions (> 0: over-replicated).
    pub(crate) base_excess: i64,
    pub(crate) existing: Option<Bound<'py, PyAny>>,
    /// Where the waiters are processing, if they were read.
    pub(crate) waiting_on: Option<WaitingOn>,
    /// `ts.actor` and `ts.nbytes`, if read ahead.
    pub(crate) actor_nbytes: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    /// `ts.key`, if read ahead.
    pub(crate) key: Option<Bound<'py, PyAny>>,
    /// Drops suggested in this run.
    pub(crate) ndrop: i64,
}

/// A task ReduceReplicas suggests drops for, with its inputs gathered.
pub(crate) struct Prepared<'py> {
    pub(crate) ts: Bound<'py, PyAny>,
    /// Drops suggested ignoring this run's pending actions.
    pub(crate) base_excess: i64,
    pub(crate) drop_set: Option<Bound<'py, PySet>>,
    /// `ts.key`, if read ahead.
    pub(crate) key: Option<Bound<'py, PyAny>>,
    pub(crate) request: DropRequest,
    pub(crate) ndrop: i64,
}
