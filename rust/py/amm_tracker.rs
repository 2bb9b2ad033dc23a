//! `dask_shm._core.ReplicaTracker`: which replicated tasks a ReduceReplicas
//! run must look at, kept between runs; and `TrackerHub`/`ReplicaHook`, the
//! scheduler hooks that report changes to it.
//!
//! Stock's ReduceReplicas walks every task of `scheduler.replicated_tasks` on
//! every run. Between two runs, a task's count of drops to suggest changes only
//! if its replicas, its waiters (or where they are processing) or its desired
//! count change. The sets and rescan rules live in
//! `dask_shm_core::replica_tracker` (unit-tested there); this binding reads the
//! scheduler's objects for them (`touch`, `touch_dependencies`, called by the
//! hooks of `dask_shm.amm.tracking`) and runs the policy over what they name,
//! so a run costs time proportional to the changed and over-replicated tasks,
//! not to `replicated_tasks`.
//!
//! Decisions are those of a full scan: when two or more tasks get drops and
//! their choices could depend on the order they are decided in (see
//! `amm::order_independent`), one pointer-only pass over `replicated_tasks`
//! recovers stock's order. A replaced `replicated_tasks` object also falls
//! back to a full scan. The run itself is asked of a `Decider` (`AmmRun`),
//! so this module does not depend on the run's module.

use std::sync::Mutex;

use pyo3::exceptions::{PyAssertionError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyWeakrefReference};

use crate::amm_task::{len_or_zero, task_slots, Decider, Prefetched, Prepared, TASK_LINES};
use crate::set_order::SetTable;
use crate::slots::{prefetch_ahead, prefetch_at};
use dask_shm_core::addr_map::AddrMap;
use dask_shm_core::amm::{self, DropRequest};
use dask_shm_core::replica_tracker::{Decided, TrackerState};

/// The over-replicated tasks and the tasks changed since the last run (the
/// rules: `dask_shm_core::replica_tracker`), over the scheduler's objects.
#[pyclass(module = "dask_shm._core", weakref)]
pub struct ReplicaTracker {
    state: TrackerState<Py<PyAny>>,
    /// The `replicated_tasks` object of the last run (kept alive, so its
    /// address cannot be reused by another object).
    tasks: Option<Py<PyAny>>,
    /// Buffers of the drop requests of past runs, reused.
    requests: Vec<DropRequest>,
}

fn addr(obj: &Bound<'_, PyAny>) -> usize {
    obj.as_ptr() as usize
}

#[pymethods]
impl ReplicaTracker {
    /// A tracker whose first run scans everything.
    #[new]
    fn new() -> Self {
        ReplicaTracker {
            state: TrackerState::new(),
            tasks: None,
            requests: Vec::new(),
        }
    }

    /// Report that `ts`'s replicas (or waiters) may have changed.
    fn touch(&mut self, ts: &Bound<'_, PyAny>) {
        self.state.touch(addr(ts), || ts.clone().unbind());
    }

    /// Report that `ts` changed state or worker: its own facts and the waiters
    /// of each of its dependencies may have changed.
    fn touch_dependencies(&mut self, ts: &Bound<'_, PyAny>) -> PyResult<()> {
        self.touch(ts);
        let deps = ts.getattr(intern!(ts.py(), "dependencies"))?;
        if !deps.is_none() {
            for dts in deps.try_iter()? {
                self.touch(&dts?);
            }
        }
        Ok(())
    }

    /// Make the next run scan every replicated task.
    fn request_rescan(&mut self) {
        self.state.request_rescan();
    }

    /// Number of tasks that had drops to suggest at the last look.
    #[getter]
    fn over_replicated(&self) -> usize {
        self.state.over_replicated()
    }

    /// `(full scan, tasks looked at, ordered by a pass over replicated_tasks)`
    /// for the last run.
    #[getter]
    fn last_run(&self) -> (bool, usize, bool) {
        let last = self.state.last_run();
        (last.full_scan, last.looked_at, last.ordered_by_scan)
    }
}

impl ReplicaTracker {
    /// One ReduceReplicas policy run on `run`; see `AmmRun.reduce_replicas`.
    pub(crate) fn reduce_replicas<D: Decider>(
        &mut self,
        run: &mut D,
        tasks: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyDict>,
        targets: Option<&Bound<'_, PyDict>>,
        defer: bool,
        validate: bool,
    ) -> PyResult<(usize, i64)> {
        self.settle_decided(tasks.py())?;
        let same_tasks = self.tasks.as_ref().is_some_and(|t| t.is(tasks));
        let result = if self.state.rescan() || !same_tasks {
            self.full_scan(run, tasks, pending, targets, defer)
        } else {
            self.changed_only(run, tasks, pending, targets, defer, validate)
        };
        let kept = targets.into_iter().flat_map(|t| t.keys());
        self.state
            .finish_run(kept.map(|ts| (addr(&ts), ts.unbind())));
        result
    }

    /// Fold the tasks the last run decided drops for into the over-replicated
    /// set, from how many replicas they have now. Their drops were sent to
    /// the workers (the scheduler forgets a dropped replica at once, and a
    /// worker that refuses adds it back through `add_replica`), and their
    /// waiters are as they were unless a change touched them (then they are
    /// looked at again anyway): `len(who_has) - keep` is their excess now.
    fn settle_decided(&mut self, py: Python<'_>) -> PyResult<()> {
        let settle: Vec<(usize, Decided<Py<PyAny>>)> = self.state.take_settling();
        let slots = settle
            .first()
            .and_then(|(_, d)| task_slots(d.task.bind(py)));
        let mut counts = Vec::with_capacity(settle.len());
        for (i, (_, d)) in settle.iter().enumerate() {
            // The tasks were last touched a run ago: mostly cache misses.
            prefetch_ahead(
                &settle,
                i,
                |(a, _)| prefetch_at(*a, 0..=TASK_LINES),
                |(_, later)| {
                    // `len(who_has)` reads the set's first line only.
                    let who_has = slots.as_ref().and_then(|s| s.peek(later.task.bind(py), 0));
                    if let Some(who_has) = who_has.filter(|&a| a != 0) {
                        prefetch_at(who_has, 0..=0);
                    }
                },
            );
            counts.push(len_or_zero(
                &d.task.bind(py).getattr(intern!(py, "who_has"))?,
            )?);
        }
        for ((a, d), n) in settle.into_iter().zip(counts) {
            self.state.settle(a, d, n);
        }
        Ok(())
    }

    fn decide_later(&mut self, task: &Prepared<'_>, dropped: usize) {
        let keep = task.request.n_holders - task.base_excess;
        self.state
            .decided(addr(&task.ts), keep, dropped, || task.ts.clone().unbind());
    }

    fn full_scan<D: Decider>(
        &mut self,
        run: &mut D,
        tasks: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyDict>,
        targets: Option<&Bound<'_, PyDict>>,
        defer: bool,
    ) -> PyResult<(usize, i64)> {
        let mut scan = self.state.begin_full_scan();
        self.tasks = Some(tasks.clone().unbind());
        let (mut nkeys, mut ndrop) = (0usize, 0i64);
        let mut request = DropRequest::default();
        for ts in tasks.try_iter()? {
            let ev = D::evaluate(ts?, None, Some(pending), targets)?;
            self.state
                .scanned(&mut scan, addr(&ev.ts), ev.base_excess, || {
                    ev.ts.clone().unbind()
                });
            if ev.ndrop > 0 {
                nkeys += 1;
                ndrop += ev.ndrop;
                let task = run.prepare(ev, pending, defer, request)?;
                let dropped = run.decide(&task)?;
                if scan.keeping() {
                    self.decide_later(&task, dropped);
                }
                request = task.request;
            }
        }
        self.state.end_full_scan(scan);
        Ok((nkeys, ndrop))
    }

    fn changed_only<D: Decider>(
        &mut self,
        run: &mut D,
        tasks: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyDict>,
        targets: Option<&Bound<'_, PyDict>>,
        defer: bool,
        validate: bool,
    ) -> PyResult<(usize, i64)> {
        let py = tasks.py();
        // Everything whose count may have changed, or may be positive.
        let extra: Vec<Bound<'_, PyAny>> = pending
            .keys()
            .iter()
            .chain(targets.iter().flat_map(|t| t.keys()))
            .collect();
        // Addresses first (keys of the maps: no object is touched), in
        // address order: the objects are then read in the order they lie in
        // memory. Decisions do not depend on it (see `order_independent`).
        let addrs = self.state.candidates(extra.iter().map(addr));
        let looked_at = addrs.len();
        // A reference to each, with the objects prefetched a few steps ahead.
        let mut look: Vec<(usize, Bound<'_, PyAny>)> = Vec::with_capacity(addrs.len());
        for (i, &a) in addrs.iter().enumerate() {
            prefetch_ahead(&addrs, i, |&later| prefetch_at(later, 0..=0), |_| {});
            // SAFETY: `a` is a key of the tracker's over, dirty or targets
            // set (each holds a reference to its object) or the address of
            // one of `extra`; none has changed since, so the object is alive.
            look.push((a, unsafe {
                Bound::from_borrowed_ptr(py, a as *mut pyo3::ffi::PyObject)
            }));
        }
        drop(extra);
        let mut chosen: Vec<Prepared<'_>> = Vec::new();
        let (mut nkeys, mut ndrop) = (0usize, 0i64);
        // Read every task's attributes first, in one loop that prefetches
        // ahead: the reads are mostly cache misses, which then overlap.
        let mut ahead = Prefetched::read_all(&look);
        // The waiters of the task evaluated a few steps later are fetched
        // while this one is evaluated.
        const WAITERS_AHEAD: usize = 6;
        for a in ahead.iter().take(WAITERS_AHEAD).flatten() {
            a.prefetch_waiters();
        }
        for (i, (a, ts)) in look.into_iter().enumerate() {
            if let Some(Some(later)) = ahead.get(i + WAITERS_AHEAD) {
                later.prefetch_waiters();
            }
            let ev = D::evaluate(ts, ahead[i].take(), Some(pending), targets)?;
            // The scheduler keeps `replicated_tasks` = {tasks with 2+ holders}
            // (add_replica/remove_replica); `validate` checks it.
            let replicated = self
                .state
                .looked(a, ev.n_holders, ev.base_excess, || ev.ts.clone().unbind());
            if replicated && ev.ndrop > 0 {
                nkeys += 1;
                ndrop += ev.ndrop;
                let request = self.requests.pop().unwrap_or_default();
                chosen.push(run.prepare(ev, pending, defer, request)?);
            }
        }
        if validate {
            check_against_full_scan::<D>(tasks, pending, targets, &chosen)?;
        }
        let mut ordered_by_scan = false;
        if chosen.len() > 1 {
            let requests: Vec<&DropRequest> = chosen.iter().map(|t| &t.request).collect();
            let ndrop: Vec<i64> = chosen.iter().map(|t| t.ndrop).collect();
            if !amm::order_independent(run.table(), &requests, &ndrop) {
                order_as_iterated(tasks, &mut chosen)?;
                ordered_by_scan = true;
            }
        }
        for task in &chosen {
            let dropped = run.decide(task)?;
            self.decide_later(task, dropped);
        }
        // Keep the requests' buffers for the next run.
        self.requests.extend(chosen.into_iter().map(|t| t.request));
        self.state.end_changed_only(looked_at, ordered_by_scan);
        Ok((nkeys, ndrop))
    }
}

/// Sort `chosen` into the iteration order of `tasks`.
///
/// When the set's table can be read (see `set_order`), each task's slot is
/// found next to where its hash puts it, and slots are the iteration order;
/// a task not found there (rare: a long collision chain) sends everyone
/// through one pass over the table that only compares addresses. Sets that
/// cannot be read are iterated instead.
fn order_as_iterated(tasks: &Bound<'_, PyAny>, chosen: &mut Vec<Prepared<'_>>) -> PyResult<()> {
    // Hashes first, and only for a set whose table can be read: `__hash__`
    // is Python code, which must not run while the table is borrowed.
    let hashes: Option<Vec<isize>> = if SetTable::of(tasks).is_some() {
        Some(
            chosen
                .iter()
                .map(|t| t.ts.hash())
                .collect::<PyResult<_>>()?,
        )
    } else {
        None
    };
    let ranks = match (hashes, SetTable::of(tasks)) {
        (Some(hashes), Some(table)) => chosen
            .iter()
            .zip(&hashes)
            .map(|(t, &h)| table.slot_near(addr(&t.ts), h))
            .collect::<Option<Vec<usize>>>()
            .unwrap_or_else(|| ranks_by_pass(table.addresses(), chosen)),
        _ => {
            let items = tasks
                .try_iter()?
                .map(|ts| ts.map(|ts| addr(&ts)))
                .collect::<PyResult<Vec<usize>>>()?;
            ranks_by_pass(items.into_iter(), chosen)
        }
    };
    let mut order: Vec<(usize, usize)> = ranks.into_iter().zip(0..).collect();
    order.sort_unstable();
    let mut taken: Vec<Option<Prepared<'_>>> = chosen.drain(..).map(Some).collect();
    chosen.extend(order.into_iter().filter_map(|(_, i)| taken[i].take()));
    Ok(())
}

/// The position of each of `chosen` among `items` (addresses in iteration
/// order); `usize::MAX` for one not found.
fn ranks_by_pass(items: impl Iterator<Item = usize>, chosen: &[Prepared<'_>]) -> Vec<usize> {
    let mut rank: AddrMap<usize> = chosen.iter().map(|t| (addr(&t.ts), usize::MAX)).collect();
    let mut left = rank.len();
    for (i, a) in items.enumerate() {
        if let Some(r) = rank.get_mut(&a) {
            *r = i;
            left -= 1;
            if left == 0 {
                break;
            }
        }
    }
    chosen.iter().map(|t| rank[&addr(&t.ts)]).collect()
}

/// AssertionError unless the tasks with drops to suggest are exactly those a
/// full scan finds.
fn check_against_full_scan<D: Decider>(
    tasks: &Bound<'_, PyAny>,
    pending: &Bound<'_, PyDict>,
    targets: Option<&Bound<'_, PyDict>>,
    chosen: &[Prepared<'_>],
) -> PyResult<()> {
    let ours: AddrMap<()> = chosen.iter().map(|t| (addr(&t.ts), ())).collect();
    let mut missed = Vec::new();
    let mut full = 0usize;
    for ts in tasks.try_iter()? {
        let ev = D::evaluate(ts?, None, Some(pending), targets)?;
        if ev.ndrop > 0 {
            full += 1;
            if !ours.contains_key(&addr(&ev.ts)) {
                missed.push(ev.ts.repr()?.to_string());
            }
        }
    }
    if !missed.is_empty() || full != ours.len() {
        return Err(PyAssertionError::new_err(format!(
            "ReplicaTracker out of date: a full scan finds {full} tasks with drops to \
             suggest, the tracker {}; missed: {}",
            ours.len(),
            missed.join(", ")
        )));
    }
    Ok(())
}

/// The trackers of one scheduler, held weakly: what the scheduler hooks
/// (`ReplicaHook`) and the transition plugin of `dask_shm.amm.tracking`
/// report to. A tracker stops receiving changes when it is gone.
#[pyclass(module = "dask_shm._core", frozen)]
pub struct TrackerHub {
    trackers: Mutex<Vec<Py<PyWeakrefReference>>>,
}

impl TrackerHub {
    /// Call `f` on every live tracker (dead ones are forgotten).
    fn each(
        &self,
        py: Python<'_>,
        mut f: impl FnMut(&mut ReplicaTracker) -> PyResult<()>,
    ) -> PyResult<()> {
        // Live trackers are few (one per manager): up to four are collected
        // without allocating (this runs on every replica change), so that no
        // lock is held while a tracker works.
        let mut live: [Option<Bound<'_, PyAny>>; 4] = Default::default();
        let mut more = Vec::new();
        {
            let mut trackers = self.trackers.lock().unwrap_or_else(|e| e.into_inner());
            let mut n = 0;
            trackers.retain(|r| match r.bind(py).upgrade() {
                Some(t) => {
                    match live.get_mut(n) {
                        Some(slot) => *slot = Some(t),
                        None => more.push(t),
                    }
                    n += 1;
                    true
                }
                None => false,
            });
        }
        for t in live.into_iter().flatten().chain(more) {
            let mut tracker = t.cast::<ReplicaTracker>()?.try_borrow_mut()?;
            f(&mut tracker)?;
        }
        Ok(())
    }
}

#[pymethods]
impl TrackerHub {
    #[new]
    fn new() -> Self {
        TrackerHub {
            trackers: Mutex::new(Vec::new()),
        }
    }

    /// Send changes to `tracker` for as long as it lives.
    fn add(&self, tracker: &Bound<'_, ReplicaTracker>) -> PyResult<()> {
        let r = PyWeakrefReference::new(tracker.as_any())?.unbind();
        self.trackers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(r);
        Ok(())
    }

    /// Number of live trackers.
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        let mut n = 0;
        self.each(py, |_| {
            n += 1;
            Ok(())
        })?;
        Ok(n)
    }

    /// `ReplicaTracker.touch` on every tracker.
    fn touch(&self, ts: &Bound<'_, PyAny>) -> PyResult<()> {
        self.each(ts.py(), |t| {
            t.touch(ts);
            Ok(())
        })
    }

    /// `ReplicaTracker.touch_dependencies` on every tracker.
    fn touch_dependencies(&self, ts: &Bound<'_, PyAny>) -> PyResult<()> {
        self.each(ts.py(), |t| t.touch_dependencies(ts))
    }
}

/// Which argument of the hooked scheduler method a `ReplicaHook` reports,
/// and how.
#[derive(Debug, Clone, Copy)]
enum HookKind {
    /// `add_replica(ts, ws)`: `touch(ts)`.
    Touch,
    /// `send_task_to_worker(worker, ts)`: `touch_dependencies(ts)`.
    Dependencies,
}

/// A scheduler method wrapped so that its call is reported to a
/// `TrackerHub` first (then the original runs with the same arguments). In
/// Rust because it runs on every replica change of the scheduler.
#[pyclass(module = "dask_shm._core", frozen)]
pub struct ReplicaHook {
    kind: HookKind,
    name: String,
    original: Py<PyAny>,
    hub: Py<TrackerHub>,
}

/// Argument `i` of a call, by position or by `name`; None if absent (the
/// original then raises its own TypeError).
fn argument<'py>(
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
    i: usize,
    name: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if let Ok(a) = args.get_item(i) {
        return Ok(Some(a));
    }
    match kwargs {
        Some(k) => k.get_item(name),
        None => Ok(None),
    }
}

#[pymethods]
impl ReplicaHook {
    /// Wrap `original`, the scheduler's bound method `name` (`add_replica`
    /// or `send_task_to_worker`), to report to `hub`.
    #[new]
    fn new(name: &str, original: Py<PyAny>, hub: Py<TrackerHub>) -> PyResult<Self> {
        let kind = match name {
            "add_replica" => HookKind::Touch,
            "send_task_to_worker" => HookKind::Dependencies,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "no replica hook for scheduler method {name:?}"
                )))
            }
        };
        Ok(ReplicaHook {
            kind,
            name: name.to_owned(),
            original,
            hub,
        })
    }

    #[pyo3(signature = (*args, **kwargs))]
    fn __call__<'py>(
        &self,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = args.py();
        let hub = self.hub.get();
        match self.kind {
            HookKind::Touch => {
                if let Some(ts) = argument(args, kwargs, 0, "ts")? {
                    hub.touch(&ts)?;
                }
            }
            HookKind::Dependencies => {
                if let Some(ts) = argument(args, kwargs, 1, "ts")? {
                    hub.touch_dependencies(&ts)?;
                }
            }
        }
        self.original.bind(py).call(args, kwargs)
    }

    /// The hooked method's name.
    #[getter]
    fn __name__(&self) -> &str {
        &self.name
    }

    /// The scheduler's own (bound) method.
    #[getter]
    fn __wrapped__(&self, py: Python<'_>) -> Py<PyAny> {
        self.original.clone_ref(py)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "<dask-shm replica hook of {}>",
            self.original.bind(py).repr()?
        ))
    }
}
