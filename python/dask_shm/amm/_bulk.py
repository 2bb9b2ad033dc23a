"""Bulk execution of the policies whose contract we know.

Each runner issues exactly the suggestions the policy's generator would yield, in the
same order and with the same dependence on earlier choices, but walks the scheduler's
objects and decides every suggestion in one Rust pass (``AmmRun.reduce_replicas`` /
``AmmRun.retire_worker``) instead of one generator round trip per suggestion.
ReduceReplicas looks only at the tasks the manager's ``ReplicaTracker`` says may
have drops to suggest (see :mod:`dask_shm.amm.tracking`), where the scheduler allows
hooks. Side
effects on the policy (``no_recipients``, removal from ``manager.policies``) and log
records are the stock ones.

``pending`` is filled as stock fills it, except by the last policy of a run: nothing
reads ``pending`` after it, so its new actions stay in the Rust run, which enacts them
with the rest.

Only exact classes are run in bulk: a subclass that overrides ``run`` goes through the
generator protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import distributed.active_memory_manager as stock

from dask_shm._core import AmmRun, ReplicaTracker
from dask_shm.amm.policies import ReduceReplicas, RetireWorker, replica_targets

#: Stock's policy logger: our runners emit its messages for parity.
policy_logger = stock.logger


class RunningManager(Protocol):
    """What a runner uses of the manager in the middle of ``run_once``
    (:class:`~dask_shm.amm.extension.ActiveMemoryManagerExtension` satisfies
    it); named here so that this module does not import the extension that
    calls it."""

    scheduler: Any
    policies: set[Any]
    pending: dict[Any, tuple[set[Any], set[Any]]]
    _run: AmmRun

    def _replica_tracker(self) -> ReplicaTracker | None: ...


Runner = Callable[[RunningManager, Any, bool], None]


def run_reduce_replicas(manager: RunningManager, policy: Any, last: bool = False) -> None:
    """Bulk equivalent of ``ReduceReplicas.run`` (KeepReplicas targets honoured).
    ``last``: no policy runs after this one in the current run."""
    targets = replica_targets(manager) or None
    scheduler = manager.scheduler
    tracker = manager._replica_tracker()
    if tracker is None:
        nkeys, ndrop = manager._run.reduce_replicas(
            scheduler.replicated_tasks, manager.pending, targets, last
        )
    else:
        nkeys, ndrop = manager._run.reduce_replicas_tracked(
            tracker,
            scheduler.replicated_tasks,
            manager.pending,
            targets,
            last,
            bool(getattr(scheduler, "validate", False)),
        )
    if ndrop:
        policy_logger.debug(
            "ReduceReplicas: Dropping %d superfluous replicas of %d tasks", ndrop, nkeys
        )


def run_retire_worker(manager: RunningManager, policy: Any, last: bool = False) -> None:
    """Bulk equivalent of ``RetireWorker.run``, with its side effects on ``policy``.
    ``last``: no policy runs after this one in the current run."""
    ws = manager.scheduler.workers.get(policy.address)
    if ws is None or ws not in manager._run:
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
    nrepl, nno_rec = manager._run.retire_worker(ws, manager.pending, last)
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
