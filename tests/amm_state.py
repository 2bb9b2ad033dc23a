"""Fake scheduler states for AMM tests and benchmarks.

Workers and tasks are the real ``distributed.scheduler.WorkerState`` /
``TaskState`` objects (so hashing and attribute costs are realistic); the scheduler is
a small stand-in holding what an Active Memory Manager reads, and recording the
replications and drops it is asked to enact instead of sending them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from distributed.core import Status
from distributed.scheduler import MemoryState, TaskGroup, TaskPrefix, TaskState, WorkerState

STATUSES = (Status.running, Status.paused, Status.closing_gracefully)


@dataclass
class FakeScheduler:
    """What ``ActiveMemoryManagerExtension`` needs from a scheduler."""

    workers: dict[str, WorkerState] = field(default_factory=dict)
    running: set[WorkerState] = field(default_factory=set)
    tasks: dict[str, TaskState] = field(default_factory=dict)
    replicated_tasks: set[TaskState] = field(default_factory=set)
    handlers: dict[str, Any] = field(default_factory=dict)
    periodic_callbacks: dict[str, Any] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)
    validate: bool = True
    plugins: dict[str, Any] = field(default_factory=dict)
    #: request_remove_replicas removes the replicas at once, as the real scheduler.
    apply_drops: bool = False
    memory: MemoryState = field(
        default_factory=lambda: MemoryState(process=0, unmanaged_old=0, managed=0, spilled=0)
    )
    #: (op, worker address, key) for every enacted replication/drop.
    enacted: list[tuple[str, str, str]] = field(default_factory=list)

    def request_acquire_replicas(self, addr: str, keys: list, *, stimulus_id: str) -> None:
        self.enacted.extend(("replicate", addr, k) for k in keys)

    def request_remove_replicas(self, addr: str, keys: list, *, stimulus_id: str) -> None:
        self.enacted.extend(("drop", addr, k) for k in keys)
        if self.apply_drops:
            for k in keys:
                self.remove_replica(self.tasks[k], self.workers[addr])

    # The replica bookkeeping of ``distributed.scheduler.SchedulerState``.
    def add_replica(self, ts: TaskState, ws: WorkerState) -> None:
        if ts.who_has is None:
            ts.who_has = set()
        if ws in ts.who_has:
            return
        ts.who_has.add(ws)
        ws._has_what[ts] = None
        if len(ts.who_has) == 2:
            self.replicated_tasks.add(ts)

    def remove_replica(self, ts: TaskState, ws: WorkerState) -> None:
        del ws._has_what[ts]
        ts.who_has.remove(ws)  # type: ignore[union-attr]
        if not ts.who_has:
            ts.who_has = None
        if len(ts.who_has or ()) == 1:
            self.replicated_tasks.remove(ts)

    def remove_all_replicas(self, ts: TaskState) -> None:
        if not ts.who_has:
            return
        for ws in ts.who_has:
            del ws._has_what[ts]
        if len(ts.who_has) > 1:
            self.replicated_tasks.remove(ts)
        ts.who_has = None

    def send_task_to_worker(self, worker: str, ts: TaskState) -> None:
        pass

    def add_plugin(self, plugin: Any, *, idempotent: bool = False, name: str | None = None) -> None:
        self.plugins[name or plugin.name] = plugin

    def transition(self, key: str, start: str, finish: str) -> None:
        """Tell the plugins, as ``Scheduler._transition`` does."""
        for plugin in list(self.plugins.values()):
            plugin.transition(key, start, finish, stimulus_id="fake")

    def take(self) -> set[tuple[str, str, str]]:
        """The enacted decisions so far, as a set; clears the record."""
        out = set(self.enacted)
        self.enacted.clear()
        return out

    def add_worker(self, name: str, memory: int, status: Status = Status.running) -> WorkerState:
        ws = WorkerState(
            address=f"tcp://127.0.0.1:{10000 + len(self.workers)}",
            status=status,
            pid=0,
            name=name,
            memory_limit=2**40,
            local_directory="",
            nanny=None,
            server_id=name,
        )
        ws.metrics = {"memory": memory, "spilled_bytes": {"memory": 0, "disk": 0}}
        ws._memory_unmanaged_old = memory
        self.workers[ws.address] = ws
        if status == Status.running:
            self.running.add(ws)
        return ws

    def add_task(self, key: str, nbytes: int, holders: list[WorkerState]) -> TaskState:
        ts = TaskState(key, None, "memory", _GROUP, validate=False)  # type: ignore[arg-type]
        ts.nbytes = nbytes
        self.tasks[key] = ts
        for ws in holders:
            self.add_replica(ts, ws)
        return ts

    def add_waiter(self, ts: TaskState, key: str, processing_on: WorkerState | None) -> TaskState:
        """A dependent of ``ts`` waiting for it, processing on ``processing_on``
        (or not yet assigned), made known through a transition."""
        state = "processing" if processing_on is not None else "waiting"
        waiter = TaskState(key, None, state, _GROUP, validate=False)  # type: ignore[arg-type]
        waiter.processing_on = processing_on
        waiter.dependencies.add(ts)
        ts.dependents.add(waiter)
        if ts.waiters is None:
            ts.waiters = set()
        ts.waiters.add(waiter)
        self.tasks[key] = waiter
        self.transition(key, "released", state)
        return waiter

    def finish_waiter(self, waiter: TaskState) -> None:
        """``waiter`` completes: it no longer waits for its dependencies."""
        start = waiter.state
        waiter.processing_on = None
        waiter.state = "memory"
        for dts in waiter.dependencies:
            if dts.waiters:
                dts.waiters.discard(waiter)
        self.transition(waiter.key, start, "memory")

    def steal(self, waiter: TaskState, thief: WorkerState) -> None:
        """Work stealing moves ``waiter``: no transition (as in distributed)."""
        waiter.processing_on = thief
        self.send_task_to_worker(thief.address, waiter)


_GROUP = TaskGroup("x", TaskPrefix("x"))


def random_state(
    rng: random.Random,
    nworkers: int,
    ntasks: int,
    *,
    max_replicas: int = 4,
    p_not_running: float = 0.25,
    p_waiters: float = 0.3,
) -> FakeScheduler:
    """A random cluster where every worker's memory is distinct and stays distinct
    through any sequence of accepted actions (memory = big * k + worker number, task
    sizes are multiples of ``big``), so stock's choices are always unique."""
    big = 1 << 20
    s = FakeScheduler()
    base = ntasks * max_replicas * 1000 + 1
    workers = []
    for i in range(nworkers):
        status = Status.running if rng.random() >= p_not_running else rng.choice(STATUSES[1:])
        mem = (base + rng.randrange(1000 * nworkers)) * big + i
        workers.append(s.add_worker(f"w{i}", mem, status))
    for t in range(ntasks):
        holders = rng.sample(workers, rng.randint(1, min(max_replicas, nworkers)))
        ts = s.add_task(f"t{t}", rng.randint(1, 1000) * big, holders)
        if rng.random() < p_waiters:
            for j in range(rng.randint(1, 4)):
                on = rng.choice([*workers, None])
                s.add_waiter(ts, f"t{t}-dep{j}", on)
    return s
