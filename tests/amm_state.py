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
    memory: MemoryState = field(
        default_factory=lambda: MemoryState(process=0, unmanaged_old=0, managed=0, spilled=0)
    )
    #: (op, worker address, key) for every enacted replication/drop.
    enacted: list[tuple[str, str, str]] = field(default_factory=list)

    def request_acquire_replicas(self, addr: str, keys: list, *, stimulus_id: str) -> None:
        self.enacted.extend(("replicate", addr, k) for k in keys)

    def request_remove_replicas(self, addr: str, keys: list, *, stimulus_id: str) -> None:
        self.enacted.extend(("drop", addr, k) for k in keys)

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
        for ws in holders:
            ws._has_what[ts] = None
            if ts.who_has is None:
                ts.who_has = set()
            ts.who_has.add(ws)
        if len(holders) > 1:
            self.replicated_tasks.add(ts)
        self.tasks[key] = ts
        return ts

    def add_waiter(self, ts: TaskState, key: str, processing_on: WorkerState | None) -> None:
        waiter = TaskState(key, None, "processing", _GROUP, validate=False)  # type: ignore[arg-type]
        waiter.processing_on = processing_on
        if ts.waiters is None:
            ts.waiters = set()
        ts.waiters.add(waiter)


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
