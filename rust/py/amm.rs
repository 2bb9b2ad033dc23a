//! Python face of the AMM core (`dask_shm_core::amm`): `dask_shm._core.AmmRun`.
//!
//! One `AmmRun` serves one Active Memory Manager run. It holds the run's
//! `WorkerState` objects (strong references, so their addresses identify them
//! for the whole run) and the Rust worker table. Its job is the binding's:
//! gather plain inputs from the scheduler's Python objects
//! (`TaskState.who_has` / `waiters` / `processing_on` / `nbytes` / `actor` /
//! `state` / `key`, `WorkerState.has_what`, and the manager's `pending` dict
//! `{TaskState: (set[WorkerState], set[WorkerState])}`), let `dask_shm_core::amm`
//! decide, and write the decisions back into `pending` exactly as the stock
//! manager fills it. No policy logic lives here.
//!
//! Workers are identified by object identity. Workers that are not part of the
//! run (not in `scheduler.workers` when it started) are ignored where stock
//! would intersect with the cluster's workers.

use pyo3::exceptions::{PyAssertionError, PyKeyError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PySet, PyTuple};

use crate::amm_task::{len_or_zero, Decider, Evaluated, Prefetched, Prepared, WaitingOn};
use crate::amm_tracker::ReplicaTracker;
use crate::set_order::SetTable;
use dask_shm_core::addr_map::AddrMap;
use dask_shm_core::amm::{
    self, DropRequest, Measure, MemoryInputs, Reject, RetireOutcome, RetireRequest, WorkerTable,
};

type Entry<'py> = (Bound<'py, PySet>, Bound<'py, PySet>);

/// `[replications, drops]`, each a list of `(worker, keys)`.
type Grouped<'py> = [Vec<(Bound<'py, PyAny>, Vec<Bound<'py, PyAny>>)>; 2];

/// The `(pending replications, pending drops)` entry of `ts`, created empty if
/// absent (one hash of `ts`).
fn entry<'py>(pending: &Bound<'py, PyDict>, ts: &Bound<'py, PyAny>) -> PyResult<Entry<'py>> {
    let py = ts.py();
    let fresh = PyTuple::new(py, [PySet::empty(py)?, PySet::empty(py)?])?;
    let (_, value) = pending.set_default_with_result(ts, fresh)?;
    split_entry(&value)
}

fn split_entry<'py>(value: &Bound<'py, PyAny>) -> PyResult<Entry<'py>> {
    let t = value.cast::<PyTuple>()?;
    Ok((
        t.get_item(0)?.cast_into::<PySet>()?,
        t.get_item(1)?.cast_into::<PySet>()?,
    ))
}

/// Call `f` on each item of `obj` (an iterable). A small exact set is read
/// from its table (see `set_order`) instead of through an iterator object.
fn for_each_member<'py>(
    obj: &Bound<'py, PyAny>,
    mut f: impl FnMut(Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    const SMALL: usize = 8;
    let mut items = [0usize; SMALL];
    let mut n = 0;
    let small = SetTable::of(obj).is_some_and(|table| {
        table.addresses().all(|a| {
            let room = n < SMALL;
            if room {
                items[n] = a;
                n += 1;
            }
            room
        })
    });
    if !small {
        return obj.try_iter()?.try_for_each(|item| f(item?));
    }
    // Strong references first, then `f` (which may run Python code).
    // SAFETY: each address is an item of the set, which holds a reference to
    // it, and no Python code ran since the table was read.
    let owned: [Option<Bound<'py, PyAny>>; SMALL] = std::array::from_fn(|i| {
        (i < n).then(|| unsafe {
            Bound::from_borrowed_ptr(obj.py(), items[i] as *mut pyo3::ffi::PyObject)
        })
    });
    owned.into_iter().flatten().try_for_each(f)
}

/// Stock's `{waiter.processing_on or waiter for waiter in waiters}`, counted;
/// records where the waiters are processing in `waiting_on`.
fn waiter_places(waiters: &Bound<'_, PyAny>, waiting_on: &mut WaitingOn) -> PyResult<usize> {
    // Only called below amm::MAX_COUNTED_WAITERS waiters: a stack array will do.
    let py = waiters.py();
    let mut places = [0usize; amm::MAX_COUNTED_WAITERS];
    let mut n = 0;
    let too_many =
        || pyo3::exceptions::PyRuntimeError::new_err("waiters changed size during the count");
    for_each_member(waiters, |waiter| {
        let on = waiter.getattr(intern!(py, "processing_on"))?;
        if !on.is_none() {
            if waiting_on.len == waiting_on.on.len() {
                return Err(too_many());
            }
            waiting_on.on[waiting_on.len] = on.as_ptr() as usize;
            waiting_on.len += 1;
        }
        let id = if on.is_truthy()? {
            on.as_ptr()
        } else {
            waiter.as_ptr()
        } as usize;
        if !places[..n].contains(&id) {
            if n == places.len() {
                return Err(too_many());
            }
            places[n] = id;
            n += 1;
        }
        Ok(())
    })?;
    Ok(n)
}

/// `amm::replicas_to_keep` over a Python `waiters` set (or None). Returns
/// where the waiters are processing too when it had to look at them.
fn keep_and_waiting_on(
    desired: i64,
    waiters: &Bound<'_, PyAny>,
) -> PyResult<(i64, Option<WaitingOn>)> {
    let mut err = None;
    let mut waiting_on = None;
    let keep = amm::replicas_to_keep(desired, len_or_zero(waiters)?, || {
        let w = waiting_on.insert(WaitingOn::new());
        waiter_places(waiters, w).unwrap_or_else(|e| {
            err = Some(e);
            0
        })
    });
    match err {
        Some(e) => Err(e),
        None => Ok((keep, waiting_on)),
    }
}

/// `amm::replicas_to_keep` over a Python `waiters` set (or None).
pub(crate) fn keep_for(desired: i64, waiters: &Bound<'_, PyAny>) -> PyResult<i64> {
    Ok(keep_and_waiting_on(desired, waiters)?.0)
}

/// Number of replicas ReduceReplicas keeps for a task wanting `desired`
/// replicas whose dependents waiting on it are `waiters` (a set or None):
/// the one implementation of stock's rule, for Python policies.
#[pyfunction]
#[pyo3(signature = (desired, waiters))]
pub fn replicas_to_keep(desired: i64, waiters: &Bound<'_, PyAny>) -> PyResult<i64> {
    keep_for(desired, waiters)
}

/// `obj` as an i64 if it is exactly an int that fits (anything else: None).
fn exact_i64(obj: &Bound<'_, PyAny>) -> Option<i64> {
    if obj.is_exact_instance_of::<PyInt>() {
        obj.extract().ok()
    } else {
        None
    }
}

/// `dict[key]` of an exact dict, as an exact int; None otherwise.
fn item_i64(dict: &Bound<'_, PyDict>, key: &Bound<'_, PyAny>) -> Option<i64> {
    exact_i64(&dict.get_item(key).ok()??)
}

/// What `WorkerState.memory` is computed from, read from a worker whose
/// `metrics` and `metrics["spilled_bytes"]` are exact dicts and whose figures
/// are exact ints; None for anything else (the caller then asks Python, which
/// also raises what stock raises, e.g. KeyError for a worker without metrics).
fn memory_inputs(ws: &Bound<'_, PyAny>) -> Option<MemoryInputs> {
    let py = ws.py();
    let metrics = ws.getattr(intern!(py, "metrics")).ok()?;
    let metrics = metrics.cast_exact::<PyDict>().ok()?;
    let spilled = metrics.get_item(intern!(py, "spilled_bytes")).ok()??;
    let spilled = spilled.cast_exact::<PyDict>().ok()?;
    Some(MemoryInputs {
        process: item_i64(metrics, intern!(py, "memory"))?,
        nbytes: exact_i64(&ws.getattr(intern!(py, "nbytes")).ok()?)?,
        spilled_memory: item_i64(spilled, intern!(py, "memory"))?,
        spilled_disk: item_i64(spilled, intern!(py, "disk"))?,
        unmanaged_old: exact_i64(&ws.getattr(intern!(py, "_memory_unmanaged_old")).ok()?)?,
    })
}

/// `getattr(ws.memory, measure)`, computed in Rust (`amm::memory_measure`)
/// when `formula` holds and the inputs are plain, else by Python.
fn worker_memory(ws: &Bound<'_, PyAny>, measure: &str, formula: Option<Measure>) -> PyResult<i64> {
    if let Some(m) = formula {
        if let Some(v) = memory_inputs(ws).and_then(|i| amm::memory_measure(m, &i)) {
            return Ok(v);
        }
    }
    ws.getattr(intern!(ws.py(), "memory"))?
        .getattr(measure)?
        .extract()
}

/// `{code: message}` of every rejection (see `amm::Reject`).
pub fn rejections(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for r in Reject::ALL {
        out.set_item(r.code(), r.message())?;
    }
    Ok(out)
}

/// An accepted action of a deferring bulk policy.
struct Deferred {
    ts: Py<PyAny>,
    key: Py<PyAny>,
    w: u32,
    is_drop: bool,
}

/// One AMM run: the run's workers and their table.
#[pyclass(module = "dask_shm._core")]
pub struct AmmRun {
    table: WorkerTable,
    workers: Vec<Py<PyAny>>,
    index: AddrMap<u32>,
    last_reject: i64,
    /// Accepted actions of a deferring bulk policy. The task's key is read
    /// when the action is decided (the task is in the CPU's cache then, and
    /// no longer by enactment).
    deferred: Vec<Deferred>,
    /// Tasks a deferring bulk policy suggested something for that had no
    /// `pending` entry (stock would have created one for each).
    deferred_tasks: usize,
    /// Buffers reused across the tasks of a run: (scratch, dropped).
    buffers: (Vec<u32>, Vec<u32>),
}

impl AmmRun {
    fn pos(&self, obj: &Bound<'_, PyAny>) -> Option<u32> {
        self.index.get(&(obj.as_ptr() as usize)).copied()
    }

    fn pos_or_key_error(&self, ws: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.pos(ws)
            .ok_or_else(|| PyKeyError::new_err(ws.clone().unbind()))
    }

    /// Append the positions of the workers in `obj` (a set or any iterable;
    /// None is empty) to `out`, skipping workers unknown to this run.
    fn positions_into(&self, obj: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> PyResult<()> {
        if obj.is_none() {
            return Ok(());
        }
        if let Some(table) = SetTable::of(obj) {
            // Addresses are all a position needs: no item is touched.
            out.extend(
                table
                    .addresses()
                    .filter_map(|a| self.index.get(&a).copied()),
            );
        } else if let Ok(set) = obj.cast::<PySet>() {
            out.extend(set.iter().filter_map(|w| self.pos(&w)));
        } else {
            for w in obj.try_iter()? {
                if let Some(p) = self.pos(&w?) {
                    out.push(p);
                }
            }
        }
        Ok(())
    }

    fn positions(&self, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut out = Vec::new();
        self.positions_into(obj, &mut out)?;
        Ok(out)
    }

    /// Positions of the workers where dependents (`waiters`) of `ts` are processing.
    fn dependents(&self, ts: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut out = Vec::new();
        self.dependents_into(ts, &mut out)?;
        Ok(out)
    }

    fn dependents_into(&self, ts: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> PyResult<()> {
        let py = ts.py();
        let waiters = ts.getattr(intern!(py, "waiters"))?;
        if waiters.is_none() {
            return Ok(());
        }
        for_each_member(&waiters, |waiter| {
            let on = waiter.getattr(intern!(py, "processing_on"))?;
            if !on.is_none() {
                if let Some(p) = self.pos(&on) {
                    out.push(p);
                }
            }
            Ok(())
        })
    }

    fn worker<'py>(&self, py: Python<'py>, w: u32) -> Bound<'py, PyAny> {
        self.workers[w as usize].bind(py).clone()
    }

    fn nbytes(ts: &Bound<'_, PyAny>) -> PyResult<i64> {
        ts.getattr(intern!(ts.py(), "nbytes"))?.extract()
    }

    fn is_actor(ts: &Bound<'_, PyAny>) -> PyResult<bool> {
        ts.getattr(intern!(ts.py(), "actor"))?.is_truthy()
    }

    fn in_memory(ts: &Bound<'_, PyAny>) -> PyResult<bool> {
        let state = ts.getattr(intern!(ts.py(), "state"))?;
        Ok(state.extract::<&str>().is_ok_and(|s| s == "memory"))
    }

    fn reject<'py>(&mut self, r: Reject) -> Option<Bound<'py, PyAny>> {
        self.last_reject = r.code();
        None
    }

    /// Record an accepted action in its `pending` set, or, without one, in the
    /// deferred log (enacted by `enact` like the `pending` entries), with
    /// `key` (`ts.key`, read here if not given).
    fn record(
        &mut self,
        set: Option<&Bound<'_, PySet>>,
        ts: &Bound<'_, PyAny>,
        key: Option<&Bound<'_, PyAny>>,
        w: u32,
        is_drop: bool,
    ) -> PyResult<()> {
        match set {
            Some(set) => set.add(self.workers[w as usize].bind(ts.py())),
            None => {
                let key = match key {
                    Some(k) => k.clone(),
                    None => ts.getattr(intern!(ts.py(), "key"))?,
                };
                self.deferred.push(Deferred {
                    ts: ts.clone().unbind(),
                    key: key.unbind(),
                    w,
                    is_drop,
                });
                Ok(())
            }
        }
    }

    /// The `pending` sets a suggestion for `ts` writes to: the existing entry,
    /// else a new one, else (deferring) none, counting the entry stock would
    /// have created.
    fn entry_for<'py>(
        &mut self,
        pending: &Bound<'py, PyDict>,
        ts: &Bound<'py, PyAny>,
        existing: Option<Entry<'py>>,
        defer: bool,
    ) -> PyResult<Option<Entry<'py>>> {
        Ok(match existing {
            Some(e) => Some(e),
            None if defer => {
                self.deferred_tasks += 1;
                None
            }
            None => Some(entry(pending, ts)?),
        })
    }

    /// ReduceReplicas' count for `ts` (no side effects): `targets` gives the
    /// desired replicas (default 1); this run's `pending` actions count.
    /// `ahead`: the task's attributes, if read ahead (`Prefetched::read`).
    pub(crate) fn evaluate<'py>(
        ts: Bound<'py, PyAny>,
        ahead: Option<Prefetched<'py>>,
        pending: Option<&Bound<'py, PyDict>>,
        targets: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Evaluated<'py>> {
        let py = ts.py();
        let (who_has, waiters, actor_nbytes, key) = match ahead {
            Some(a) => (
                a.who_has,
                Some(a.waiters),
                Some((a.actor, a.nbytes)),
                Some(a.key),
            ),
            None => (ts.getattr(intern!(py, "who_has"))?, None, None, None),
        };
        let n_holders = len_or_zero(&who_has)? as i64;
        let desired: i64 = match targets.map(|t| t.get_item(&ts)).transpose()?.flatten() {
            Some(v) => v.extract()?,
            None => 1,
        };
        let waiters = match waiters {
            Some(w) => w,
            None => ts.getattr(intern!(py, "waiters"))?,
        };
        let (keep, waiting_on) = keep_and_waiting_on(desired, &waiters)?;
        let base_excess = amm::excess_replicas(n_holders, keep, 0, 0);
        let existing = match pending {
            Some(p) if !p.is_empty() => p.get_item(&ts)?,
            _ => None,
        };
        let ndrop = match &existing {
            Some(e) => {
                let (r, d) = split_entry(e)?;
                amm::excess_replicas(n_holders, keep, r.len() as i64, d.len() as i64)
            }
            None => base_excess,
        };
        Ok(Evaluated {
            ts,
            who_has,
            n_holders,
            base_excess,
            existing,
            waiting_on,
            actor_nbytes,
            key,
            ndrop,
        })
    }

    /// Gather what `amm::reduce_task` needs for an evaluated task with
    /// `ndrop > 0`, creating its `pending` entry as stock's first suggestion
    /// would (or counting it, when deferring).
    pub(crate) fn prepare<'py>(
        &mut self,
        ev: Evaluated<'py>,
        pending: &Bound<'py, PyDict>,
        defer: bool,
        mut request: DropRequest,
    ) -> PyResult<Prepared<'py>> {
        let existing = ev.existing.as_ref().map(split_entry).transpose()?;
        let drop_set = self
            .entry_for(pending, &ev.ts, existing, defer)?
            .map(|e| e.1);
        request.holders.clear();
        request.pending_drop.clear();
        request.dependents.clear();
        request.n_holders = ev.n_holders;
        request.nbytes = 0;
        request.actor = ev.n_holders == 0
            || match &ev.actor_nbytes {
                Some((actor, _)) => actor.is_truthy()?,
                None => Self::is_actor(&ev.ts)?,
            };
        if !request.actor {
            self.positions_into(&ev.who_has, &mut request.holders)?;
            if let Some(set) = &drop_set {
                self.positions_into(set.as_any(), &mut request.pending_drop)?;
            }
            match &ev.waiting_on {
                Some(w) => request
                    .dependents
                    .extend(w.as_slice().iter().filter_map(|a| self.index.get(a))),
                None => self.dependents_into(&ev.ts, &mut request.dependents)?,
            }
            request.nbytes = match &ev.actor_nbytes {
                Some((_, nbytes)) => nbytes.extract()?,
                None => Self::nbytes(&ev.ts)?,
            };
        }
        Ok(Prepared {
            ts: ev.ts,
            base_excess: ev.base_excess,
            drop_set,
            key: ev.key,
            request,
            ndrop: ev.ndrop,
        })
    }

    /// Decide a prepared task (`amm::reduce_task`) and record its drops;
    /// returns how many it drops.
    pub(crate) fn decide(&mut self, task: &Prepared<'_>) -> PyResult<usize> {
        let (mut scratch, mut dropped) = std::mem::take(&mut self.buffers);
        amm::reduce_task_into(
            &mut self.table,
            &task.request,
            task.ndrop,
            &mut scratch,
            &mut dropped,
        );
        let recorded = dropped.iter().try_for_each(|&w| {
            let key = task.key.as_ref();
            self.record(task.drop_set.as_ref(), &task.ts, key, w, true)
        });
        let n = dropped.len();
        self.buffers = (scratch, dropped);
        recorded.map(|()| n)
    }

    /// The accepted actions of `pending` and of the deferred log grouped by
    /// worker, as stock enacts them: `[replications, drops]`, each a list of
    /// `(worker, keys)` (the run's workers in order, then workers a policy put
    /// in `pending` that are not part of the run). Tasks that lost all
    /// replicas are skipped. With `validate`, raises AssertionError if an
    /// action would drop the last replica, replicate onto a holder or drop
    /// from a non-holder.
    fn grouped<'py>(&self, pending: &Bound<'py, PyDict>, validate: bool) -> PyResult<Grouped<'py>> {
        let py = pending.py();
        let n = self.workers.len();
        let mut repl: Vec<Vec<Bound<'py, PyAny>>> = vec![Vec::new(); n];
        let mut drop: Vec<Vec<Bound<'py, PyAny>>> = vec![Vec::new(); n];
        // Workers a policy put in `pending` that are not part of this run.
        let mut foreign: Vec<(Bound<'py, PyAny>, bool, Vec<Bound<'py, PyAny>>)> = Vec::new();
        for (ts, value) in pending.iter() {
            let who_has = ts.getattr(intern!(py, "who_has"))?;
            if who_has.is_none() || !who_has.is_truthy()? {
                continue;
            }
            let (repl_set, drop_set) = split_entry(&value)?;
            if repl_set.is_empty() && drop_set.is_empty() {
                continue;
            }
            if validate {
                let mut keeps = false;
                for h in who_has.try_iter()? {
                    if !drop_set.contains(h?)? {
                        keeps = true;
                        break;
                    }
                }
                if !keeps {
                    return Err(PyAssertionError::new_err(format!(
                        "would drop the last replica of {}",
                        ts.repr()?
                    )));
                }
            }
            let key = ts.getattr(intern!(py, "key"))?;
            for (set, lists, is_drop) in
                [(&repl_set, &mut repl, false), (&drop_set, &mut drop, true)]
            {
                for ws in set.iter() {
                    if validate && who_has.contains(&ws)? != is_drop {
                        return Err(PyAssertionError::new_err(format!(
                            "{} {} a replica of {}",
                            ws.repr()?,
                            if is_drop {
                                "cannot drop"
                            } else {
                                "already holds"
                            },
                            ts.repr()?
                        )));
                    }
                    match self.pos(&ws) {
                        Some(p) => lists[p as usize].push(key.clone()),
                        None => match foreign
                            .iter_mut()
                            .find(|(f, d, _)| f.is(&ws) && *d == is_drop)
                        {
                            Some((_, _, keys)) => keys.push(key.clone()),
                            None => foreign.push((ws, is_drop, vec![key.clone()])),
                        },
                    }
                }
            }
        }
        // Deferred actions were decided by the last policy of this run on tasks
        // with replicas, and nothing ran since: stock's `who_has` check would
        // keep them all.
        for d in &self.deferred {
            if validate {
                let ts = d.ts.bind(py);
                let who_has = ts.getattr(intern!(py, "who_has"))?;
                let holds =
                    !who_has.is_none() && who_has.contains(self.workers[d.w as usize].bind(py))?;
                if holds != d.is_drop {
                    return Err(PyAssertionError::new_err(format!(
                        "invalid deferred action on {}",
                        ts.repr()?
                    )));
                }
            }
            let lists = if d.is_drop { &mut drop } else { &mut repl };
            lists[d.w as usize].push(d.key.bind(py).clone());
        }
        let mut out: Grouped<'py> = [Vec::new(), Vec::new()];
        for (i, lists) in [repl, drop].into_iter().enumerate() {
            for (w, keys) in lists.into_iter().enumerate() {
                if !keys.is_empty() {
                    out[i].push((self.workers[w].bind(py).clone(), keys));
                }
            }
        }
        for (ws, is_drop, keys) in foreign {
            out[usize::from(is_drop)].push((ws, keys));
        }
        Ok(out)
    }

    pub(crate) fn table(&self) -> &WorkerTable {
        &self.table
    }
}

impl Decider for AmmRun {
    fn evaluate<'py>(
        ts: Bound<'py, PyAny>,
        ahead: Option<Prefetched<'py>>,
        pending: Option<&Bound<'py, PyDict>>,
        targets: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Evaluated<'py>> {
        AmmRun::evaluate(ts, ahead, pending, targets)
    }

    fn prepare<'py>(
        &mut self,
        ev: Evaluated<'py>,
        pending: &Bound<'py, PyDict>,
        defer: bool,
        request: DropRequest,
    ) -> PyResult<Prepared<'py>> {
        AmmRun::prepare(self, ev, pending, defer, request)
    }

    fn decide(&mut self, task: &Prepared<'_>) -> PyResult<usize> {
        AmmRun::decide(self, task)
    }

    fn table(&self) -> &WorkerTable {
        AmmRun::table(self)
    }
}

#[pymethods]
impl AmmRun {
    /// `workers`: the scheduler's workers in order; `memory`, `running`
    /// (status is running) and `eligible` (member of `Scheduler.running`) per worker.
    #[new]
    fn new(
        workers: Vec<Bound<'_, PyAny>>,
        memory: Vec<i64>,
        running: Vec<bool>,
        eligible: Vec<bool>,
    ) -> PyResult<Self> {
        let n = workers.len();
        if memory.len() != n || running.len() != n || eligible.len() != n {
            return Err(PyValueError::new_err(
                "workers, memory, running and eligible must have the same length",
            ));
        }
        if u32::try_from(n).is_err() {
            return Err(PyValueError::new_err("too many workers"));
        }
        let mut index = AddrMap::with_capacity_and_hasher(n, Default::default());
        for (i, ws) in workers.iter().enumerate() {
            if index.insert(ws.as_ptr() as usize, i as u32).is_some() {
                return Err(PyValueError::new_err("the same worker is listed twice"));
            }
        }
        Ok(AmmRun {
            table: WorkerTable::new(memory, running, eligible),
            workers: workers.into_iter().map(Bound::unbind).collect(),
            index,
            last_reject: 0,
            deferred: Vec::new(),
            deferred_tasks: 0,
            buffers: (Vec::new(), Vec::new()),
        })
    }

    /// The run over `workers` (the scheduler's workers, in order) as they
    /// are now, read in one pass: memory is `getattr(ws.memory, measure)`,
    /// running is `ws.status == status_running`, eligible is `ws in running`.
    /// With `worker_type`, the memory of workers of exactly that type is
    /// computed in Rust from the inputs of `WorkerState.memory` (the caller
    /// checks that the formula still matches `distributed`'s); other workers,
    /// and unusual inputs, are asked from Python.
    #[staticmethod]
    #[pyo3(signature = (workers, running, status_running, measure, worker_type=None))]
    fn read_workers(
        workers: &Bound<'_, PyAny>,
        running: &Bound<'_, PyAny>,
        status_running: &Bound<'_, PyAny>,
        measure: &str,
        worker_type: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let formula = worker_type.and(Measure::from_name(measure));
        let mut in_running: AddrMap<()> = AddrMap::default();
        for ws in running.try_iter()? {
            in_running.insert(ws?.as_ptr() as usize, ());
        }
        let mut list = Vec::new();
        let (mut memory, mut is_running, mut eligible) = (Vec::new(), Vec::new(), Vec::new());
        for ws in workers.try_iter()? {
            let ws = ws?;
            let exact = worker_type.is_some_and(|t| ws.get_type().is(t));
            memory.push(worker_memory(&ws, measure, formula.filter(|_| exact))?);
            let status = ws.getattr(intern!(ws.py(), "status"))?;
            is_running.push(status.is(status_running) || status.eq(status_running)?);
            // Identity first; `in` (hash and __eq__) only for the others.
            eligible
                .push(in_running.contains_key(&(ws.as_ptr() as usize)) || running.contains(&ws)?);
            list.push(ws);
        }
        Self::new(list, memory, is_running, eligible)
    }

    fn __len__(&self) -> usize {
        self.table.len()
    }

    fn __contains__(&self, ws: &Bound<'_, PyAny>) -> bool {
        self.pos(ws).is_some()
    }

    /// The run's workers, in order.
    #[getter]
    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.workers.iter().map(|w| w.bind(py)))
    }

    /// Why the last `replicate`/`drop` returned None (a key of `AMM_REJECTIONS`).
    #[getter]
    fn last_reject(&self) -> i64 {
        self.last_reject
    }

    /// Number of tasks a deferring bulk policy made suggestions for without
    /// creating their `pending` entry: `len(pending) + deferred_tasks` is the
    /// size stock's `pending` would have.
    #[getter]
    fn deferred_tasks(&self) -> usize {
        self.deferred_tasks
    }

    /// Memory of `ws` downstream of accepted actions. Raises KeyError if unknown.
    fn memory(&self, ws: &Bound<'_, PyAny>) -> PyResult<i64> {
        Ok(self.table.memory(self.pos_or_key_error(ws)?))
    }

    /// Overwrite the memory of `ws`. Raises KeyError if unknown.
    fn set_memory(&mut self, ws: &Bound<'_, PyAny>, value: i64) -> PyResult<()> {
        let w = self.pos_or_key_error(ws)?;
        self.table.set_memory(w, value);
        Ok(())
    }

    /// Stock `_find_recipient` plus accounting: choose the least loaded running
    /// candidate (all workers if `candidates` is None) that neither holds `ts`
    /// nor is in `pending_repl`; add it to `pending_repl` and its memory grows by
    /// `ts.nbytes`. Returns the worker or None (see `last_reject`).
    fn replicate<'py>(
        &mut self,
        ts: &Bound<'py, PyAny>,
        candidates: Option<&Bound<'py, PyAny>>,
        pending_repl: &Bound<'py, PySet>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = ts.py();
        if !Self::in_memory(ts)? {
            return Ok(self.reject(Reject::NotInMemory));
        }
        if Self::is_actor(ts)? {
            return Ok(self.reject(Reject::Actor));
        }
        let holders = self.positions(&ts.getattr(intern!(py, "who_has"))?)?;
        let cands = match candidates {
            Some(c) if !c.is_none() => Some(self.positions(c)?),
            _ => None,
        };
        let pending = self.positions(pending_repl.as_any())?;
        match self
            .table
            .find_recipient(cands.as_deref(), &holders, &pending)
        {
            Ok(w) => {
                self.table.add_replica(w, Self::nbytes(ts)?);
                let ws = self.worker(py, w);
                pending_repl.add(&ws)?;
                Ok(Some(ws))
            }
            Err(e) => Ok(self.reject(e)),
        }
    }

    /// Stock `_find_dropper` plus accounting: choose the holder of `ts` among
    /// `candidates` (all holders if None), not in `pending_drop` and without
    /// dependents processing on it, with the highest (not running, memory);
    /// never the last replica; ping-pong guard. Adds it to `pending_drop`; its
    /// memory shrinks by `ts.nbytes` (clamped at 0). Returns it or None.
    fn drop<'py>(
        &mut self,
        ts: &Bound<'py, PyAny>,
        candidates: Option<&Bound<'py, PyAny>>,
        pending_drop: &Bound<'py, PySet>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = ts.py();
        let who_has = ts.getattr(intern!(py, "who_has"))?;
        if who_has.is_none() {
            return Ok(self.reject(Reject::NoReplicas));
        }
        let holders = self.positions(&who_has)?;
        let pending = self.positions(pending_drop.as_any())?;
        let cands = match candidates {
            Some(c) if !c.is_none() => Some(self.positions(c)?),
            _ => None,
        };
        // Stock checks the replica count before the actor flag.
        if (holders.len() as i64) - (pending.len() as i64) >= 2 && Self::is_actor(ts)? {
            return Ok(self.reject(Reject::Actor));
        }
        let deps = self.dependents(ts)?;
        match self
            .table
            .find_dropper(&holders, &pending, cands.as_deref(), &deps)
        {
            Ok(w) => {
                self.table.drop_replica(w, Self::nbytes(ts)?);
                let ws = self.worker(py, w);
                pending_drop.add(&ws)?;
                Ok(Some(ws))
            }
            Err(e) => Ok(self.reject(e)),
        }
    }

    /// Stock `ReduceReplicas.run` over every task of `tasks` (normally
    /// `scheduler.replicated_tasks`), in its iteration order: `amm::reduce_task`
    /// for each task with drops to suggest (`desired` replicas from `targets`,
    /// default 1), accepted drops recorded in `pending`. With `defer` (no policy
    /// runs after this one), only entries that already exist are updated; new
    /// accepted drops go to the deferred log. Returns `(tasks suggested, drops
    /// suggested)`.
    #[pyo3(signature = (tasks, pending, targets=None, defer=false))]
    fn reduce_replicas(
        &mut self,
        tasks: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyDict>,
        targets: Option<&Bound<'_, PyDict>>,
        defer: bool,
    ) -> PyResult<(usize, i64)> {
        let (mut nkeys, mut ndrop) = (0usize, 0i64);
        let mut request = DropRequest::default();
        for ts in tasks.try_iter()? {
            let ev = Self::evaluate(ts?, None, Some(pending), targets)?;
            if ev.ndrop > 0 {
                nkeys += 1;
                ndrop += ev.ndrop;
                let task = self.prepare(ev, pending, defer, request)?;
                self.decide(&task)?;
                request = task.request;
            }
        }
        Ok((nkeys, ndrop))
    }

    /// As `reduce_replicas`, but only looking at the tasks `tracker` says may
    /// have drops to suggest (see `ReplicaTracker`). Same decisions, same
    /// `pending`; with `validate`, also checks the tracker against a full scan
    /// (AssertionError on a mismatch).
    #[pyo3(signature = (tracker, tasks, pending, targets=None, defer=false, validate=false))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_replicas_tracked(
        &mut self,
        tracker: &Bound<'_, ReplicaTracker>,
        tasks: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyDict>,
        targets: Option<&Bound<'_, PyDict>>,
        defer: bool,
        validate: bool,
    ) -> PyResult<(usize, i64)> {
        tracker
            .borrow_mut()
            .reduce_replicas(self, tasks, pending, targets, defer, validate)
    }

    /// Stock `RetireWorker.run` for worker `ws` (which must be in the run),
    /// decided in one pass over `ws.has_what` (`amm::retire_task` per task).
    /// Records everything in `pending` (`defer`: as in `reduce_replicas`).
    /// Returns `(keys to move, keys with no recipient)`.
    #[pyo3(signature = (ws, pending, defer=false))]
    fn retire_worker(
        &mut self,
        ws: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyDict>,
        defer: bool,
    ) -> PyResult<(usize, usize)> {
        let py = ws.py();
        let w = self.pos_or_key_error(ws)?;
        let check_pending = !pending.is_empty();
        let (mut nrepl, mut nno_rec) = (0usize, 0usize);
        let mut task = RetireRequest::default();
        for ts in ws.getattr(intern!(py, "has_what"))?.try_iter()? {
            let ts = ts?;
            if Self::is_actor(&ts)? {
                continue;
            }
            let who_has = ts.getattr(intern!(py, "who_has"))?;
            task.n_holders = len_or_zero(&who_has)?;
            task.holders.clear();
            self.positions_into(&who_has, &mut task.holders)?;
            let existing = if check_pending {
                pending
                    .get_item(&ts)?
                    .as_ref()
                    .map(split_entry)
                    .transpose()?
            } else {
                None
            };
            task.pending_repl = existing.as_ref().is_some_and(|e| !e.0.is_empty());
            task.pending_drop.clear();
            task.dependents.clear();
            if task.n_holders > 1 {
                if let Some((_, d)) = &existing {
                    self.positions_into(d.as_any(), &mut task.pending_drop)?;
                }
                task.dependents = self.dependents(&ts)?;
            }
            task.in_memory = Self::in_memory(&ts)?;
            task.nbytes = Self::nbytes(&ts)?;
            let outcome = amm::retire_task(&mut self.table, w, &task);
            // Stock suggests something for every task it gets here.
            let sets = self.entry_for(pending, &ts, existing, defer)?;
            match outcome {
                RetireOutcome::Dropped(d) => {
                    self.record(sets.as_ref().map(|e| &e.1), &ts, None, d, true)?
                }
                RetireOutcome::Replicated(r) => {
                    self.record(sets.as_ref().map(|e| &e.0), &ts, None, r, false)?
                }
                RetireOutcome::NoRecipient(_) => nno_rec += 1,
                RetireOutcome::KeptElsewhere | RetireOutcome::AlreadyPending => {}
            }
            if outcome.moves() {
                nrepl += 1;
            }
        }
        Ok((nrepl, nno_rec))
    }

    /// Send the accepted actions of `pending` and of the deferred log to the
    /// workers as stock's `_enact_suggestions` does: grouped by worker
    /// (`grouped`), each worker's replications through
    /// `scheduler.request_acquire_replicas(address, keys, stimulus_id=...)`,
    /// then each worker's drops through `request_remove_replicas`, each call
    /// preceded by stock's DEBUG record on `logger` when one is given.
    /// `validate`: see `grouped`.
    #[pyo3(signature = (pending, scheduler, stimulus_id, validate, logger=None))]
    fn enact(
        &self,
        pending: &Bound<'_, PyDict>,
        scheduler: &Bound<'_, PyAny>,
        stimulus_id: &Bound<'_, PyAny>,
        validate: bool,
        logger: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let py = pending.py();
        let [repl, drop] = self.grouped(pending, validate)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item(intern!(py, "stimulus_id"), stimulus_id)?;
        let steps = [
            (
                repl,
                intern!(py, "request_acquire_replicas"),
                "- %s to acquire %d replicas",
            ),
            (
                drop,
                intern!(py, "request_remove_replicas"),
                "- %s to drop %d replicas",
            ),
        ];
        for (groups, method, message) in steps {
            if groups.is_empty() {
                continue;
            }
            let request = scheduler.getattr(method)?;
            for (ws, keys) in groups {
                if let Some(logger) = logger {
                    logger.call_method1(intern!(py, "debug"), (message, &ws, keys.len()))?;
                }
                let address = ws.getattr(intern!(py, "address"))?;
                request.call((address, PyList::new(py, keys)?), Some(&kwargs))?;
            }
        }
        Ok(())
    }
}
