"""Bulk execution of the policies whose contract we know.

Each runner issues exactly the suggestions the policy's generator would yield, in the
same order and with the same dependence on earlier choices, but decides them in one
Rust call per batch instead of one generator round trip per suggestion. Side effects
on the policy (``no_recipients``, removal from ``manager.policies``) and log records
are the stock ones.

Only exact classes are run in bulk: a subclass that overrides ``run`` goes through the
generator protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import distributed.active_memory_manager as stock

from dask_shm.amm.policies import (
    ReduceReplicas,
    RetireWorker,
    excess_replicas,
    replica_targets,
)

if TYPE_CHECKING:
    from distributed.scheduler import TaskState

    from dask_shm.amm.extension import ActiveMemoryManagerExtension

#: Stock's policy logger: our runners emit its messages for parity.
policy_logger = stock.logger

Runner = Callable[["ActiveMemoryManagerExtension", Any], None]


def run_reduce_replicas(manager: ActiveMemoryManagerExtension, policy: Any) -> None:
    """Bulk equivalent of ``ReduceReplicas.run`` (KeepReplicas targets honoured)."""
    targets = replica_targets(manager)
    pending = manager.pending
    tasks: list[TaskState] = []
    counts: list[int] = []
    for ts in manager.scheduler.replicated_tasks:
        ndrop = excess_replicas(pending, ts, targets.get(ts, 1) if targets else 1)
        if ndrop > 0:
            tasks.append(ts)
            counts.append(ndrop)
    if tasks:
        manager._drop_many(tasks, counts)
        policy_logger.debug(
            "ReduceReplicas: Dropping %d superfluous replicas of %d tasks",
            sum(counts),
            len(tasks),
        )


def run_retire_worker(manager: ActiveMemoryManagerExtension, policy: Any) -> None:
    """Bulk equivalent of ``RetireWorker.run``.

    The drops of already-replicated keys are decided before the replications of unique
    keys. This is the same outcome as stock's interleaving: every drop targets the
    retiring worker, which never receives these keys, and each key is suggested once.
    """
    scheduler = manager.scheduler
    ws = scheduler.workers.get(policy.address)
    if ws is None:
        policy_logger.debug("Removing policy %s: Worker no longer in cluster", policy)
        manager.policies.remove(policy)
        return
    if ws.actors:
        policy_logger.warning(
            f"Tried retiring worker {policy.address}, but it holds actor(s) "
            f"{set(ws.actors)}, which can't be moved."
            "The worker will not be retired."
        )
        policy.no_recipients = True
        manager.policies.remove(policy)
        return

    policy_logger.debug("Retiring %s", ws)
    tasks = [ts for ts in ws.has_what if not ts.actor]
    shared = [ts for ts in tasks if ts.who_has and len(ts.who_has) > 1]
    dropped: set[TaskState] = set()
    if shared:
        accepted = manager._drop_many(shared, [1] * len(shared), candidate=ws)
        dropped = {ts for ts, n in zip(shared, accepted, strict=True) if n}

    running = scheduler.running
    pending = manager.pending
    nrepl = 0
    to_replicate: list[TaskState] = []
    for ts in tasks:
        if ts.who_has and len(ts.who_has) > 1:
            if ts in dropped or not running.isdisjoint(ts.who_has):
                continue
        nrepl += 1
        entry = pending.get(ts)
        if entry is None or not entry[0]:
            to_replicate.append(ts)
    nno_rec = 0
    if to_replicate:
        nno_rec = sum(r is None for r in manager._replicate_many(to_replicate))

    if nno_rec:
        policy.no_recipients = True
        policy_logger.warning(
            f"Tried retiring worker {policy.address}, but {nno_rec} tasks could not "
            "be moved as there are no suitable workers to receive them. "
            "The worker will not be retired."
        )
        manager.policies.remove(policy)
    elif nrepl:
        policy_logger.info(
            f"Retiring worker {policy.address}; {nrepl} keys are being moved away.",
        )
    else:
        policy_logger.info(
            f"Retiring worker {policy.address}; no unique keys need to be moved away."
        )
        manager.policies.remove(policy)


_RUNNERS: dict[type, Runner] = {
    stock.ReduceReplicas: run_reduce_replicas,
    ReduceReplicas: run_reduce_replicas,
    stock.RetireWorker: run_retire_worker,
    RetireWorker: run_retire_worker,
}


def bulk_runner(policy: object) -> Runner | None:
    """The bulk runner for ``policy``'s exact class, or None (use the generator)."""
    return _RUNNERS.get(type(policy))
