"""The Active Memory Manager scheduler extension, with decisions made in Rust.

:class:`ActiveMemoryManagerExtension` subclasses the stock extension so that it keeps
its constructor, configuration (``distributed.scheduler.active-memory-manager.*``),
``amm_handler`` (``client.amm.start/stop/run_once/running``) and policy registration.
What changes is one run:

- the per-run worker table (memory downstream of accepted actions, running status,
  eligibility as a recipient) lives in :class:`dask_shm._core.AmmWorkerTable`, which
  answers "find recipient" by walking an ordered index over memory and "find dropper"
  by scanning the holders only, so neither costs a pass over the whole cluster;
- the stock policies (``ReduceReplicas``, ``RetireWorker``, and ours) are executed in
  bulk: their suggestions are computed exactly as their generators would yield them
  and decided in one Rust call per policy;
- any other policy goes through the generator protocol
  (``choice = yield Suggestion(...)``) one suggestion at a time, as with stock.

Decisions equal stock's wherever stock's choice is unique. **Tie rule**: when several
workers tie on stock's sort key (memory for recipients; not-running first, then memory,
for droppers) we pick the one that comes first in ``scheduler.workers``; stock picks
whichever its set iteration yields first.

During a run, ``pending`` is the same ``dict[TaskState, (set, set)]`` as stock's and
``workers_memory`` is a live mapping (:class:`WorkersMemory`) over the Rust table.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import distributed.active_memory_manager as stock
from dask.typing import Key
from distributed.active_memory_manager import ActiveMemoryManagerPolicy, Suggestion
from distributed.core import Status
from distributed.metrics import time
from distributed.utils import log_errors

from dask_shm._core import AmmWorkerTable

if TYPE_CHECKING:
    from distributed.scheduler import TaskState, WorkerState

logger = logging.getLogger("dask_shm.amm")
task_logger = logging.getLogger("dask_shm.amm.tasks")

#: Reasons the Rust table gives for rejecting a suggestion (negated codes).
REJECTIONS = {
    1: "no running candidates",
    2: "all candidates already own a replica",
    3: "already pending replication on all candidates",
    11: "less than 2 replicas exist",
    12: "no candidates suggested by the policy own a replica",
    13: "already pending drop on all candidates",
    14: "all candidates have dependent tasks queued or running on them",
    15: "there is only one replica on workers that aren't paused or retiring",
}

Pending = tuple[set["WorkerState"], set["WorkerState"]]


class WorkersMemory(MutableMapping["WorkerState", int]):
    """Live view of each worker's memory downstream of this run's accepted actions.

    Reads come from the Rust table; writes go to it (and re-sort its index). Keys are
    the scheduler's ``WorkerState`` objects as of the start of the run; an unknown
    worker raises KeyError. Workers cannot be added or removed.
    """

    __slots__ = ("_table", "_workers", "_index")

    def __init__(
        self, workers: Sequence[WorkerState], index: dict[int, int], table: AmmWorkerTable
    ):
        self._workers = workers
        self._index = index
        self._table = table

    def _pos(self, ws: WorkerState) -> int:
        pos = self._index.get(id(ws))
        if pos is None or self._workers[pos] is not ws:
            raise KeyError(ws)
        return pos

    def __getitem__(self, ws: WorkerState) -> int:
        return self._table.memory(self._pos(ws))

    def __setitem__(self, ws: WorkerState, value: int) -> None:
        self._table.set_memory(self._pos(ws), int(value))

    def __delitem__(self, ws: WorkerState) -> None:
        raise TypeError("workers cannot be removed from workers_memory during a run")

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, ws: object) -> bool:
        pos = self._index.get(id(ws))
        return pos is not None and self._workers[pos] is ws


class ActiveMemoryManagerExtension(stock.ActiveMemoryManagerExtension):
    """Drop-in for ``distributed.active_memory_manager.ActiveMemoryManagerExtension``.

    Same constructor, configuration keys, handler and policy protocol as stock; see
    the module documentation for what differs (speed, and the tie rule).
    """

    #: Live view of memory per worker; only exists within :meth:`run_once`.
    workers_memory: WorkersMemory  # type: ignore[assignment]
    #: Positions of the run's workers, keyed by ``id(WorkerState)``.
    _index: dict[int, int]
    #: The run's workers in ``scheduler.workers`` order.
    _workers: list[WorkerState]
    #: The run's Rust table.
    _table: AmmWorkerTable

    @log_errors
    def run_once(self) -> None:
        """Run all policies once, then send the accepted replications and drops to the
        workers (fire and forget). Never runs concurrently with itself."""
        ts_start = time()
        assert not hasattr(self, "pending"), "run_once is not reentrant"
        scheduler = self.scheduler
        workers = list(scheduler.workers.values())
        measure = self.measure
        running = scheduler.running
        table = AmmWorkerTable(
            [getattr(ws.memory, measure) for ws in workers],
            [ws.status == Status.running for ws in workers],
            [ws in running for ws in workers],
        )
        self._workers = workers
        self._index = {id(ws): i for i, ws in enumerate(workers)}
        self._table = table
        self.pending = {}
        self.workers_memory = WorkersMemory(workers, self._index, table)
        try:
            self._run_policies()
            if self.pending:
                self._enact_suggestions()
        finally:
            del self.workers_memory
            del self.pending
            del self._table, self._index, self._workers
        logger.debug("Active Memory Manager run in %.0fms", (time() - ts_start) * 1000)

    def _run_policies(self) -> None:
        """Run every registered policy once, in bulk where we know its contract."""
        from dask_shm.amm._bulk import bulk_runner

        for policy in list(self.policies):  # a policy may remove itself
            logger.debug("Running policy: %s", policy)
            runner = bulk_runner(policy)
            if runner is not None:
                runner(self, policy)
            else:
                self._run_generator(policy)

    def _run_generator(self, policy: ActiveMemoryManagerPolicy) -> None:
        """Drive ``policy.run()`` one suggestion at a time (the generator protocol)."""
        gen = policy.run()
        choice: WorkerState | None = None
        while True:
            try:
                suggestion = gen.send(choice)
            except StopIteration:
                return
            if not isinstance(suggestion, Suggestion):
                suggestion = Suggestion(*suggestion)  # legacy: plain tuples
            op, ts, candidates = suggestion
            entry = self._pending_entry(ts)
            if op == "replicate":
                choice = self._replicate_one(ts, candidates, entry[0])
            elif op == "drop":
                choice = self._drop_one(ts, candidates, entry[1])
            else:
                raise ValueError(f"Unknown op: {op!r}; expected 'replicate' or 'drop'")

    # ---- helpers shared with the bulk runners -------------------------------------

    def _pending_entry(self, ts: TaskState) -> Pending:
        entry = self.pending.get(ts)
        if entry is None:
            entry = self.pending[ts] = (set(), set())
        return entry

    def _positions(self, workers: Iterable[WorkerState]) -> list[int]:
        """Table positions of ``workers``; workers unknown to this run are skipped."""
        get = self._index.get
        return [p for p in map(get, map(id, workers)) if p is not None]

    def _log_reject(self, op: str, ts: TaskState, candidates: Any, code: int | str) -> None:
        if task_logger.isEnabledFor(logging.DEBUG):
            reason = REJECTIONS.get(code, code) if isinstance(code, int) else code
            task_logger.debug("(%s, %s, %s) rejected: %s", op, ts, candidates, reason)

    def _replicate_one(
        self,
        ts: TaskState,
        candidates: set[WorkerState] | None,
        pending_repl: set[WorkerState],
    ) -> WorkerState | None:
        if ts.state != "memory":
            self._log_reject("replicate", ts, candidates, f"ts.state = {ts.state}")
            return None
        assert ts.who_has
        if ts.actor:
            self._log_reject("replicate", ts, candidates, "task is an actor")
            return None
        cands = None if candidates is None else self._positions(candidates)
        r = self._table.replicate(
            cands, self._positions(ts.who_has), self._positions(pending_repl), ts.nbytes
        )
        if r < 0:
            self._log_reject("replicate", ts, candidates, -r)
            return None
        ws = self._workers[r]
        pending_repl.add(ws)
        return ws

    def _drop_one(
        self,
        ts: TaskState,
        candidates: set[WorkerState] | None,
        pending_drop: set[WorkerState],
    ) -> WorkerState | None:
        if not ts.who_has:
            return None
        if ts.actor:
            self._log_reject("drop", ts, candidates, "task is an actor")
            return None
        cands = None if candidates is None else self._positions(candidates)
        r = self._table.drop(
            self._positions(ts.who_has),
            self._positions(pending_drop),
            cands,
            self._dependents(ts),
            ts.nbytes,
        )
        if r < 0:
            self._log_reject("drop", ts, candidates, -r)
            return None
        ws = self._workers[r]
        pending_drop.add(ws)
        return ws

    def _dependents(self, ts: TaskState) -> list[int]:
        """Positions of the workers where dependents of ``ts`` are processing."""
        waiters = ts.waiters
        if not waiters:
            return []
        get = self._index.get
        out = []
        for waiter in waiters:
            ws = waiter.processing_on
            if ws is not None:
                pos = get(id(ws))
                if pos is not None:
                    out.append(pos)
        return out

    def _replicate_many(self, tasks: Sequence[TaskState]) -> list[WorkerState | None]:
        """Decide one unrestricted replication per task (distinct tasks), in order.

        Equivalent to yielding ``Suggestion("replicate", ts)`` for each task in turn.
        Returns the recipient or None per task.
        """
        index_get = self._index.get
        nbytes: list[int] = []
        excluded: list[int] = []
        offsets = [0]
        sent: list[tuple[TaskState, set[WorkerState]]] = []
        results: list[WorkerState | None] = [None] * len(tasks)
        slots: list[int] = []
        pending = self.pending
        for i, ts in enumerate(tasks):
            entry = pending.get(ts)
            if entry is None:
                entry = pending[ts] = (set(), set())
            if ts.state != "memory" or ts.actor:
                self._log_reject("replicate", ts, None, "task not in memory or an actor")
                continue
            excluded.extend(map(index_get, map(id, ts.who_has)))  # type: ignore[arg-type]
            if entry[0]:
                excluded.extend(map(index_get, map(id, entry[0])))  # type: ignore[arg-type]
            offsets.append(len(excluded))
            nbytes.append(ts.nbytes)
            sent.append((ts, entry[0]))
            slots.append(i)
        if not sent:
            return results
        out = self._table.replicate_many(nbytes, excluded, offsets)
        workers = self._workers
        for (ts, pending_repl), slot, r in zip(sent, slots, out, strict=True):
            if r >= 0:
                ws = workers[r]
                pending_repl.add(ws)
                results[slot] = ws
            else:
                self._log_reject("replicate", ts, None, -r)
        return results

    def _drop_many(
        self,
        tasks: Sequence[TaskState],
        counts: Sequence[int],
        candidate: WorkerState | None = None,
    ) -> list[int]:
        """Decide ``counts[i]`` consecutive drops of ``tasks[i]`` (distinct tasks), in
        order, each restricted to ``candidate`` if given (else to all holders).

        Equivalent to yielding ``Suggestion("drop", ts, {candidate} or None)``
        ``counts[i]`` times per task. Returns the number of accepted drops per task.
        """
        index_get = self._index.get
        cand_pos = None if candidate is None else index_get(id(candidate))
        nbytes: list[int] = []
        sent_counts: list[int] = []
        holders: list[int] = []
        hoff = [0]
        pend: list[int] = []
        poff = [0]
        deps: list[int] = []
        doff = [0]
        sent: list[tuple[TaskState, set[WorkerState], int, int]] = []
        accepted = [0] * len(tasks)
        pending = self.pending
        for i, (ts, count) in enumerate(zip(tasks, counts, strict=True)):
            entry = pending.get(ts)
            if entry is None:
                entry = pending[ts] = (set(), set())
            if not ts.who_has or ts.actor or (candidate is not None and cand_pos is None):
                self._log_reject("drop", ts, None, "no replicas, an actor or unknown worker")
                continue
            holders.extend(map(index_get, map(id, ts.who_has)))  # type: ignore[arg-type]
            hoff.append(len(holders))
            if entry[1]:
                pend.extend(map(index_get, map(id, entry[1])))  # type: ignore[arg-type]
            poff.append(len(pend))
            if ts.waiters:
                deps.extend(self._dependents(ts))
            doff.append(len(deps))
            nbytes.append(ts.nbytes)
            sent_counts.append(count)
            sent.append((ts, entry[1], count, i))
        if not sent:
            return accepted
        out = self._table.drop_many(
            nbytes, sent_counts, holders, hoff, pend, poff, deps, doff, cand_pos
        )
        workers = self._workers
        pos = 0
        for ts, pending_drop, count, slot in sent:
            for r in out[pos : pos + count]:
                if r >= 0:
                    pending_drop.add(workers[r])
                    accepted[slot] += 1
                else:
                    self._log_reject("drop", ts, candidate, -r)
            pos += count
        return accepted

    def _enact_suggestions(self) -> None:
        """Send every accepted replication and drop in ``pending`` to its worker,
        one message per worker and kind. Returns immediately."""
        validate = self.scheduler.validate
        repl_by_worker: defaultdict[WorkerState, list[Key]] = defaultdict(list)
        drop_by_worker: defaultdict[WorkerState, list[Key]] = defaultdict(list)
        for ts, (pending_repl, pending_drop) in self.pending.items():
            who_has = ts.who_has
            if not who_has:
                continue
            if validate:
                assert who_has - pending_drop, "would drop the last replica"
            key = ts.key
            for ws in pending_repl:
                if validate:
                    assert ws not in who_has
                repl_by_worker[ws].append(key)
            for ws in pending_drop:
                if validate:
                    assert ws in who_has
                drop_by_worker[ws].append(key)
        _send(self.scheduler, repl_by_worker, drop_by_worker)


def _send(
    scheduler: Any,
    repl_by_worker: dict[WorkerState, list[Key]],
    drop_by_worker: dict[WorkerState, list[Key]],
) -> None:
    stimulus_id = f"active_memory_manager-{time()}"
    request: Callable[..., None]
    for by_worker, request, what in (
        (repl_by_worker, scheduler.request_acquire_replicas, "acquire"),
        (drop_by_worker, scheduler.request_remove_replicas, "drop"),
    ):
        for ws, keys in by_worker.items():
            logger.debug("- %s to %s %d replicas", ws, what, len(keys))
            request(ws.address, keys, stimulus_id=stimulus_id)
