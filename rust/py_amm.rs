//! Python face of `amm::WorkerTable`: `dask_shm._core.AmmRun`.
//!
//! One `AmmRun` serves one Active Memory Manager run. It holds the run's
//! `WorkerState` objects (strong references, so their addresses identify them
//! for the whole run) and the Rust worker table, and works directly on the
//! scheduler's Python objects: `TaskState.who_has` / `waiters` /
//! `processing_on` / `nbytes` / `actor` / `state` / `key`,
//! `WorkerState.has_what`, and the manager's `pending` dict
//! (`{TaskState: (set[WorkerState], set[WorkerState])}`), which it reads and
//! fills exactly as the stock manager does.
//!
//! Workers are identified by object identity. Workers that are not part of the
//! run (not in `scheduler.workers` when it started) are ignored where stock
//! would intersect with the cluster's workers.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use pyo3::exceptions::{PyAssertionError, PyKeyError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyTuple};

use crate::amm::{NoDropper, NoRecipient, WorkerTable};

/// Rejections decided before the table is consulted (stock checks these first).
const REJECT_NOT_IN_MEMORY: i64 = 21;
const REJECT_ACTOR: i64 = 22;
const REJECT_NO_REPLICAS: i64 = 23;

fn recipient_code(e: NoRecipient) -> i64 {
    e as i64
}

fn dropper_code(e: NoDropper) -> i64 {
    e as i64
}

/// Hasher for object addresses: one multiply (addresses are already unique).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = ((n as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type AddrMap = HashMap<usize, u32, BuildHasherDefault<AddrHasher>>;

type Entry<'py> = (Bound<'py, PySet>, Bound<'py, PySet>);

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

/// One AMM run: the run's workers and their table.
#[pyclass(module = "dask_shm._core")]
pub struct AmmRun {
    table: WorkerTable,
    workers: Vec<Py<PyAny>>,
    index: AddrMap,
    last_reject: i64,
    /// Accepted actions of a deferring bulk policy: (task, worker, is_drop).
    deferred: Vec<(Py<PyAny>, u32, bool)>,
    /// Tasks a deferring bulk policy suggested something for that had no
    /// `pending` entry (stock would have created one for each).
    deferred_tasks: usize,
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
        if let Ok(set) = obj.cast::<PySet>() {
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
        let py = ts.py();
        let waiters = ts.getattr(intern!(py, "waiters"))?;
        let mut out = Vec::new();
        if waiters.is_none() {
            return Ok(out);
        }
        for waiter in waiters.try_iter()? {
            let on = waiter?.getattr(intern!(py, "processing_on"))?;
            if !on.is_none() {
                if let Some(p) = self.pos(&on) {
                    out.push(p);
                }
            }
        }
        Ok(out)
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

    /// Record an accepted action in its `pending` set, or, without one, in the
    /// deferred log (enacted by `group_actions` like the `pending` entries).
    fn record(
        &mut self,
        set: Option<&Bound<'_, PySet>>,
        ts: &Bound<'_, PyAny>,
        w: u32,
        is_drop: bool,
    ) -> PyResult<()> {
        match set {
            Some(set) => set.add(self.workers[w as usize].bind(ts.py())),
            None => {
                self.deferred.push((ts.clone().unbind(), w, is_drop));
                Ok(())
            }
        }
    }

    /// Find, account and record (in `pending_repl`, or deferred if None) a
    /// recipient for `ts`.
    fn replicate_into<'py>(
        &mut self,
        ts: &Bound<'py, PyAny>,
        candidates: Option<&[u32]>,
        holders: &[u32],
        pending_repl: Option<&Bound<'py, PySet>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let pending = match pending_repl {
            Some(set) => self.positions(set.as_any())?,
            None => Vec::new(),
        };
        match self.table.find_recipient(candidates, holders, &pending) {
            Ok(w) => {
                self.table.add_replica(w, Self::nbytes(ts)?);
                self.record(pending_repl, ts, w, false)?;
                Ok(Some(self.worker(ts.py(), w)))
            }
            Err(e) => {
                self.last_reject = recipient_code(e);
                Ok(None)
            }
        }
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
        })
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

    /// Why the last `replicate`/`drop` returned None (a code, see the stubs).
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
            self.last_reject = REJECT_NOT_IN_MEMORY;
            return Ok(None);
        }
        if Self::is_actor(ts)? {
            self.last_reject = REJECT_ACTOR;
            return Ok(None);
        }
        let holders = self.positions(&ts.getattr(intern!(py, "who_has"))?)?;
        let cands = match candidates {
            Some(c) if !c.is_none() => Some(self.positions(c)?),
            _ => None,
        };
        self.replicate_into(ts, cands.as_deref(), &holders, Some(pending_repl))
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
            self.last_reject = REJECT_NO_REPLICAS;
            return Ok(None);
        }
        let holders = self.positions(&who_has)?;
        let pending = self.positions(pending_drop.as_any())?;
        let cands = match candidates {
            Some(c) if !c.is_none() => Some(self.positions(c)?),
            _ => None,
        };
        // Stock checks the replica count before the actor flag.
        if (holders.len() as i64) - (pending.len() as i64) >= 2 && Self::is_actor(ts)? {
            self.last_reject = REJECT_ACTOR;
            return Ok(None);
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
            Err(e) => {
                self.last_reject = dropper_code(e);
                Ok(None)
            }
        }
    }

    /// Stock `ReduceReplicas.run`, decided in one pass: for each task of
    /// `tasks` (normally `scheduler.replicated_tasks`), ask to drop every replica
    /// beyond `max(desired, waiters)` (desired from `targets`, default 1),
    /// counting this run's pending actions, and record accepted drops in
    /// `pending`. With `defer` (no policy runs after this one), only entries
    /// that already exist are updated; new accepted drops go to the deferred
    /// log and suggestions create no entries. Returns `(tasks suggested, drops
    /// suggested)`.
    #[pyo3(signature = (tasks, pending, targets=None, defer=false))]
    fn reduce_replicas(
        &mut self,
        tasks: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyDict>,
        targets: Option<&Bound<'_, PyDict>>,
        defer: bool,
    ) -> PyResult<(usize, i64)> {
        let py = tasks.py();
        let check_pending = !pending.is_empty();
        let (mut nkeys, mut ndrop_total) = (0usize, 0i64);
        let mut distinct: Vec<usize> = Vec::new();
        let mut holders: Vec<u32> = Vec::new();
        let mut dropping: Vec<u32> = Vec::new();
        for ts in tasks.try_iter()? {
            let ts = ts?;
            let who_has = ts.getattr(intern!(py, "who_has"))?;
            let n_holders = if who_has.is_none() {
                0
            } else {
                who_has.len()? as i64
            };
            let desired: i64 = match targets {
                Some(t) => match t.get_item(&ts)? {
                    Some(v) => v.extract()?,
                    None => 1,
                },
                None => 1,
            };
            let waiters = ts.getattr(intern!(py, "waiters"))?;
            let mut nwaiters = if waiters.is_none() {
                0
            } else {
                waiters.len()? as i64
            };
            if desired < nwaiters && nwaiters < 20 {
                // Waiters sharing a worker count once; unassigned ones count each.
                distinct.clear();
                for waiter in waiters.try_iter()? {
                    let waiter = waiter?;
                    let on = waiter.getattr(intern!(py, "processing_on"))?;
                    let id = if on.is_truthy()? {
                        on.as_ptr()
                    } else {
                        waiter.as_ptr()
                    };
                    distinct.push(id as usize);
                }
                distinct.sort_unstable();
                distinct.dedup();
                nwaiters = distinct.len() as i64;
            }
            let mut ndrop = n_holders - desired.max(nwaiters);
            let existing = if check_pending {
                pending.get_item(&ts)?
            } else {
                None
            };
            if let Some(e) = &existing {
                let (r, d) = split_entry(e)?;
                ndrop += r.len() as i64 - d.len() as i64;
            }
            if ndrop <= 0 {
                continue;
            }
            nkeys += 1;
            ndrop_total += ndrop;
            let drop_set = match existing {
                Some(e) => Some(split_entry(&e)?.1),
                None if defer => {
                    self.deferred_tasks += 1;
                    None
                }
                None => Some(entry(pending, &ts)?.1),
            };
            if n_holders == 0 || Self::is_actor(&ts)? {
                continue; // every suggestion is rejected
            }
            holders.clear();
            self.positions_into(&who_has, &mut holders)?;
            dropping.clear();
            if let Some(set) = &drop_set {
                self.positions_into(set.as_any(), &mut dropping)?;
            }
            let deps = self.dependents(&ts)?;
            let nbytes = Self::nbytes(&ts)?;
            for _ in 0..ndrop {
                // A rejection leaves the state unchanged: the rest would be too.
                let Ok(w) = self.table.find_dropper(&holders, &dropping, None, &deps) else {
                    break;
                };
                self.table.drop_replica(w, nbytes);
                self.record(drop_set.as_ref(), &ts, w, true)?;
                dropping.push(w);
            }
        }
        Ok((nkeys, ndrop_total))
    }

    /// Stock `RetireWorker.run` for worker `ws` (which must be in the run),
    /// decided in one pass over `ws.has_what`: replicated keys are offered for
    /// dropping from `ws`; keys that stay unique (or whose other replicas are all
    /// on workers that are not running) are replicated to the least loaded
    /// running worker unless a replication is already pending. Records
    /// everything in `pending` (`defer`: as in `reduce_replicas`). Returns
    /// `(keys to move, keys with no recipient)`.
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
        let only_ws = [w];
        let (mut nrepl, mut nno_rec) = (0usize, 0usize);
        let mut holders: Vec<u32> = Vec::new();
        let mut dropping: Vec<u32> = Vec::new();
        for ts in ws.getattr(intern!(py, "has_what"))?.try_iter()? {
            let ts = ts?;
            if Self::is_actor(&ts)? {
                continue;
            }
            let who_has = ts.getattr(intern!(py, "who_has"))?;
            let n_holders = if who_has.is_none() { 0 } else { who_has.len()? };
            holders.clear();
            self.positions_into(&who_has, &mut holders)?;
            // Some(entry or None if deferring and absent) once looked up.
            let mut known: Option<Option<Entry<'_>>> = None;
            if n_holders > 1 {
                let found = if defer {
                    match check_pending
                        .then(|| pending.get_item(&ts))
                        .transpose()?
                        .flatten()
                    {
                        Some(e) => Some(split_entry(&e)?),
                        None => None,
                    }
                } else {
                    Some(entry(pending, &ts)?)
                };
                if found.is_none() {
                    self.deferred_tasks += 1; // stock creates the entry here
                }
                dropping.clear();
                if let Some((_, drop_set)) = &found {
                    self.positions_into(drop_set.as_any(), &mut dropping)?;
                }
                let deps = self.dependents(&ts)?;
                if let Ok(d) = self
                    .table
                    .find_dropper(&holders, &dropping, Some(&only_ws), &deps)
                {
                    self.table.drop_replica(d, Self::nbytes(&ts)?);
                    self.record(found.as_ref().map(|e| &e.1), &ts, d, true)?;
                    continue;
                }
                if holders.iter().any(|&h| self.table.eligible(h)) {
                    continue; // a running worker keeps a replica
                }
                known = Some(found);
            }
            nrepl += 1;
            let counted = known.is_some(); // looked up (and counted) at the drop
            let repl_set = match known {
                Some(found) => found.map(|e| e.0),
                None if check_pending => match pending.get_item(&ts)? {
                    Some(e) => Some(split_entry(&e)?.0),
                    None => None,
                },
                None => None,
            };
            if repl_set.as_ref().is_some_and(|r| !r.is_empty()) {
                continue; // another policy already asked for a replica
            }
            let repl_set = match repl_set {
                Some(set) => Some(set),
                None if defer => {
                    if !counted {
                        self.deferred_tasks += 1;
                    }
                    None
                }
                None => Some(entry(pending, &ts)?.0),
            };
            if !Self::in_memory(&ts)? {
                nno_rec += 1;
                continue;
            }
            if self
                .replicate_into(&ts, None, &holders, repl_set.as_ref())?
                .is_none()
            {
                nno_rec += 1;
            }
        }
        Ok((nrepl, nno_rec))
    }

    /// Group the accepted actions of `pending` and of the deferred log by
    /// worker, as stock enacts them:
    /// tasks that lost all replicas are skipped. Returns `(replications,
    /// drops)`, each a list of `(worker, [keys])`. With `validate`, raises
    /// AssertionError if an action would drop the last replica, replicate onto
    /// a holder or drop from a non-holder.
    fn group_actions<'py>(
        &self,
        pending: &Bound<'py, PyDict>,
        validate: bool,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
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
        for (ts, w, is_drop) in &self.deferred {
            let ts = ts.bind(py);
            let who_has = ts.getattr(intern!(py, "who_has"))?;
            if who_has.is_none() || !who_has.is_truthy()? {
                continue;
            }
            if validate && who_has.contains(self.workers[*w as usize].bind(py))? != *is_drop {
                return Err(PyAssertionError::new_err(format!(
                    "invalid deferred action on {}",
                    ts.repr()?
                )));
            }
            let key = ts.getattr(intern!(py, "key"))?;
            let lists = if *is_drop { &mut drop } else { &mut repl };
            lists[*w as usize].push(key);
        }
        let out_repl = PyList::empty(py);
        let out_drop = PyList::empty(py);
        for (lists, out) in [(repl, &out_repl), (drop, &out_drop)] {
            for (w, keys) in lists.into_iter().enumerate() {
                if !keys.is_empty() {
                    out.append((self.workers[w].bind(py), PyList::new(py, keys)?))?;
                }
            }
        }
        for (ws, is_drop, keys) in foreign {
            let out = if is_drop { &out_drop } else { &out_repl };
            out.append((ws, PyList::new(py, keys)?))?;
        }
        Ok((out_repl, out_drop))
    }
}
