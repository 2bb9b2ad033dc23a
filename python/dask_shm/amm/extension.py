"""The Active Memory Manager scheduler extension, with decisions made in Rust.

:class:`ActiveMemoryManagerExtension` subclasses the stock extension so that it keeps
its constructor, configuration (``distributed.scheduler.active-memory-manager.*``),
``amm_handler`` (``client.amm.start/stop/run_once/running``) and policy registration.
What changes is one run:

- the per-run worker table (memory downstream of accepted actions, running status,
  eligibility as a recipient) lives in :class:`dask_shm._core.AmmRun`, read from the
  scheduler's workers in one Rust pass (``getattr(ws.memory, measure)`` computed in
  Rust from what ``WorkerState.memory`` reads, see :func:`memory_formula_matches`),
  which answers "find recipient" by walking an ordered index over memory and "find
  dropper" by scanning the holders only, so neither costs a pass over the cluster;
- the stock policies (``ReduceReplicas``, ``RetireWorker``, and ours) are executed in
  bulk: one Rust call walks the scheduler's objects, issuing exactly the suggestions
  the policy's generator would yield, in the same order, and deciding each at once;
- any other policy goes through the generator protocol
  (``choice = yield Suggestion(...)``) one suggestion at a time, as with stock;
- the accepted actions are grouped by worker and sent by the Rust run
  (``AmmRun.enact``), in the same calls and with the same log records as stock.

Decisions equal stock's wherever stock's choice is unique. **Tie rule**: when several
workers tie on stock's sort key (memory for recipients; not-running first, then memory,
for droppers) we pick the one that comes first in ``scheduler.workers``; stock picks
whichever its set iteration yields first.

During a run, ``pending`` is the same ``dict[TaskState, (set, set)]`` as stock's and
``workers_memory`` is a live mapping (:class:`WorkersMemory`) over the Rust table.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING

import distributed.active_memory_manager as stock
from distributed.active_memory_manager import ActiveMemoryManagerPolicy, Suggestion
from distributed.core import Status
from distributed.metrics import time
from distributed.scheduler import WorkerState
from distributed.utils import log_errors

from dask_shm._core import AMM_REJECTIONS, AmmRun, ReplicaTracker
from dask_shm.amm._bulk import bulk_runner

if TYPE_CHECKING:
    from distributed.scheduler import TaskState

#: Stock's loggers, with stock's messages: people configure exactly these to debug
#: the AMM (``distributed.logging``), and distributed's own tests capture them.
logger = stock.logger
task_logger = stock.task_logger


def log_choice(
    op: str, ts: TaskState, candidates: object, choice: WorkerState | None, reject: int
) -> None:
    """Stock's per-suggestion DEBUG record on ``distributed.active_memory_manager.tasks``."""
    if choice is not None:
        verb = "replicating to" if op == "replicate" else "dropping from"
        task_logger.debug("(%s, %s, %s): %s %s", op, ts, candidates, verb, choice)
        return
    # AMM_REJECTIONS (defined once, in rust/core/amm.rs): code -> stock's message, a
    # str.format template over the task's state; empty where stock logs nothing.
    message = AMM_REJECTIONS.get(reject)
    if message:
        message = message.format(state=ts.state)
        task_logger.debug("(%s, %s, %s) rejected: %s", op, ts, candidates, message)


#: The values ``distributed.scheduler.active-memory-manager.measure`` accepts.
MEASURES = (
    "process",
    "managed",
    "spilled",
    "unmanaged_old",
    "managed_total",
    "unmanaged",
    "unmanaged_recent",
    "optimistic",
)


@functools.cache
def memory_formula_matches() -> bool:
    """Whether ``AmmRun.read_workers`` may compute ``getattr(ws.memory, measure)`` in
    Rust (``amm::memory_measure``, a copy of ``WorkerState.memory``/``MemoryState``)
    for this version of ``distributed``: checked once per process on workers whose
    figures exercise every clamp, for every measure. False if any differs or the
    check cannot run; the run then reads every worker's memory through Python."""
    cases = [(100, 40, 10, 7, 20), (50, 80, 0, 0, 20), (10, 5, 9, 1, 99), (0, 0, 0, 0, 0)]
    try:
        for process, nbytes, spilled_memory, spilled_disk, unmanaged_old in cases:
            ws = WorkerState(
                address="tcp://dask-shm-memory-check:0",
                status=Status.running,
                pid=0,
                name="dask-shm-memory-check",
                nthreads=1,
                memory_limit=0,
                local_directory="",
                nanny=None,
                server_id="dask-shm-memory-check",
            )
            ws.metrics = {
                "memory": process,
                "spilled_bytes": {"memory": spilled_memory, "disk": spilled_disk},
            }
            ws.nbytes = nbytes
            ws._memory_unmanaged_old = unmanaged_old
            for measure in MEASURES:
                run = AmmRun.read_workers([ws], [ws], Status.running, measure, WorkerState)
                if run.memory(ws) != getattr(ws.memory, measure):
                    return False
    except Exception:  # a distributed whose WorkerState we do not know
        return False
    return True


def check_workers_memory(run: AmmRun, measure: str) -> None:
    """AssertionError unless the run's memory of every worker is stock's
    ``getattr(ws.memory, measure)`` (``scheduler.validate``)."""
    for ws in run.workers:
        expected = getattr(ws.memory, measure)
        actual = run.memory(ws)
        assert actual == expected, f"{ws}: memory {actual}, stock reads {expected}"


Pending = tuple[set["WorkerState"], set["WorkerState"]]


class WorkersMemory(MutableMapping["WorkerState", int]):
    """Live view of each worker's memory downstream of this run's accepted actions.

    Reads come from the Rust table; writes go to it (and re-sort its index). Keys are
    the scheduler's ``WorkerState`` objects as of the start of the run, matched by
    identity; an unknown worker raises KeyError. Workers cannot be added or removed.
    """

    __slots__ = ("_run",)

    def __init__(self, run: AmmRun):
        self._run = run

    def __getitem__(self, ws: WorkerState) -> int:
        return self._run.memory(ws)

    def __setitem__(self, ws: WorkerState, value: int) -> None:
        self._run.set_memory(ws, int(value))

    def __delitem__(self, ws: WorkerState) -> None:
        raise TypeError("workers cannot be removed from workers_memory during a run")

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(self._run.workers)

    def __len__(self) -> int:
        return len(self._run)

    def __contains__(self, ws: object) -> bool:
        return ws in self._run

    def copy(self) -> dict[WorkerState, int]:
        """A plain dict of the figures now (stock's ``workers_memory`` is a
        dict, and policies copy it to plan ahead)."""
        return dict(self.items())


class ActiveMemoryManagerExtension(stock.ActiveMemoryManagerExtension):
    """Drop-in for ``distributed.active_memory_manager.ActiveMemoryManagerExtension``.

    Same constructor, configuration keys, handler and policy protocol as stock; see
    the module documentation for what differs (speed, and the tie rule).
    """

    #: Live view of memory per worker; only exists within :meth:`run_once`.
    workers_memory: WorkersMemory  # type: ignore[assignment]
    #: The run's Rust state; only exists within :meth:`run_once`.
    _run: AmmRun
    #: What changed since the last ReduceReplicas run (None: not subscribed yet).
    _tracker: ReplicaTracker | None = None
    #: The scheduler cannot be hooked: ReduceReplicas scans everything every run.
    _untrackable: bool = False

    def _replica_tracker(self) -> ReplicaTracker | None:
        """This manager's tracker of replica changes, subscribed to the scheduler's
        hooks on first use; None if the scheduler cannot be hooked (then
        ReduceReplicas scans every replicated task, as stock)."""
        if self._tracker is None and not self._untrackable:
            from dask_shm.amm.tracking import subscribe

            self._tracker = subscribe(self.scheduler)
            self._untrackable = self._tracker is None
        return self._tracker

    @log_errors
    def run_once(self) -> None:
        """Run all policies once, then send the accepted replications and drops to the
        workers (fire and forget).

        Logs what stock logs, on stock's loggers (``distributed.active_memory_manager``
        and its ``.tasks`` child). While the per-task logger is enabled for DEBUG,
        every policy goes through the generator protocol, so that each suggestion is
        logged as stock logs it (slower, as stock is at that level).

        The cyclic garbage collector is paused for the duration of the run (the run
        allocates many short-lived containers and no cycles); it is re-enabled after,
        if it was enabled before.
        """
        ts_start = time()
        assert not hasattr(self, "pending"), "run_once is not reentrant"
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            scheduler = self.scheduler
            self._run = AmmRun.read_workers(
                scheduler.workers.values(),
                scheduler.running,
                Status.running,
                self.measure,
                WorkerState if memory_formula_matches() else None,
            )
            if scheduler.validate:
                check_workers_memory(self._run, self.measure)
            self.pending = {}
            self.workers_memory = WorkersMemory(self._run)
            try:
                self._run_policies()
                self._enact_suggestions()  # also when ``pending`` is empty: deferred
            finally:
                del self.workers_memory
                del self.pending
                del self._run
        finally:
            if gc_was_enabled:
                gc.enable()
        logger.debug("Active Memory Manager run in %.0fms", (time() - ts_start) * 1000)

    def _run_policies(self) -> None:
        """Run every registered policy once, in bulk where we know its contract."""
        policies = list(self.policies)  # a policy may remove itself
        per_task_log = task_logger.isEnabledFor(logging.DEBUG)
        for i, policy in enumerate(policies):
            logger.debug("Running policy: %s", policy)
            runner = None if per_task_log else bulk_runner(policy)
            if runner is not None:
                # The last policy may leave new actions out of ``pending``: no other
                # policy will look, and enactment reads them from the Rust run.
                runner(self, policy, i == len(policies) - 1)
            else:
                self._run_generator(policy)

    def _run_generator(self, policy: ActiveMemoryManagerPolicy) -> None:
        """Drive ``policy.run()`` one suggestion at a time (the generator protocol)."""
        gen = policy.run()
        run = self._run
        pending = self.pending
        choice: WorkerState | None = None
        while True:
            try:
                suggestion = gen.send(choice)
            except StopIteration:
                return
            if not isinstance(suggestion, Suggestion):
                suggestion = Suggestion(*suggestion)  # legacy: plain tuples
            op, ts, candidates = suggestion
            entry = pending.get(ts)
            if entry is None:
                entry = pending[ts] = (set(), set())
            if op == "replicate":
                choice = run.replicate(ts, candidates, entry[0])
            elif op == "drop":
                choice = run.drop(ts, candidates, entry[1])
            else:
                raise ValueError(f"Unknown op: {op!r}; expected 'replicate' or 'drop'")
            if task_logger.isEnabledFor(logging.DEBUG):
                log_choice(op, ts, candidates, choice, run.last_reject)

    def _enact_suggestions(self) -> None:
        """Send every accepted replication and drop (in ``pending`` and deferred in
        the Rust run) to its worker, one message per worker and kind, with stock's
        log records (``AmmRun.enact``). Returns immediately. Nothing is logged when
        no task got a suggestion (as stock)."""
        ntasks = len(self.pending) + self._run.deferred_tasks
        if not ntasks:
            return
        logger.debug("Enacting suggestions for %d tasks:", ntasks)
        self._run.enact(
            self.pending,
            self.scheduler,
            f"active_memory_manager-{time()}",
            bool(self.scheduler.validate),
            logger if logger.isEnabledFor(logging.DEBUG) else None,
        )
