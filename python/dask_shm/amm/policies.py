"""AMM policies: the stock pair, plus :class:`KeepReplicas`.

:class:`ReduceReplicas` and :class:`RetireWorker` subclass the stock policies, so they
are accepted wherever stock ones are (``Scheduler.retire_workers`` reads
``no_recipients`` and calls ``done()``) and still run, as generators, under the stock
manager. Under :class:`dask_shm.amm.ActiveMemoryManagerExtension` they (and the stock
classes themselves) are executed in bulk with identical suggestions.

:class:`KeepReplicas` is new: it keeps a set of keys replicated. While it is
registered, ``ReduceReplicas`` (ours, and the stock one when run by our manager) treats
its target as the desired number of replicas of those keys instead of 1, so the two
policies do not undo each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import distributed.active_memory_manager as stock
from dask.typing import Key
from distributed.active_memory_manager import (
    ActiveMemoryManagerPolicy,
    Suggestion,
    SuggestionGenerator,
)

from dask_shm._core import replicas_to_keep

if TYPE_CHECKING:
    from distributed.scheduler import TaskState


class ReduceReplicas(stock.ReduceReplicas):
    """Drop replicas of in-memory keys beyond what is desired.

    Desired is 1 replica, or more when dependents not yet assigned to a worker (fewer
    than 20 of them) may need them, or a registered :class:`KeepReplicas` target.
    Drops prefer paused/retiring workers, then the most loaded ones; the last replica
    is never dropped.
    """

    def run(self) -> SuggestionGenerator:
        targets = replica_targets(self.manager)
        if not targets:
            yield from super().run()
            return
        for ts in self.manager.scheduler.replicated_tasks:
            for _ in range(excess_replicas(self.manager.pending, ts, targets.get(ts, 1))):
                yield Suggestion("drop", ts)


class RetireWorker(stock.RetireWorker):
    """Move every unique in-memory key off worker ``address`` so it can close.

    Same contract as ``distributed.active_memory_manager.RetireWorker``: keys with
    replicas elsewhere are dropped from the worker, unique keys are replicated to the
    least loaded running worker; ``no_recipients`` is set (and the policy removes
    itself) when some key has nowhere to go; :meth:`done` tells when the worker holds
    no unique key.
    """

    __slots__ = ()


class KeepReplicas(ActiveMemoryManagerPolicy):
    """Keep at least ``n`` replicas of each of ``keys`` on running workers.

    Contract:

    - ``n=None`` means one replica on every running worker (broadcast); otherwise
      ``n`` is an int >= 1 (capped at the number of running workers).
    - Each run, for each key that is in memory, the policy asks for as many
      replications as are missing, counting replicas on running workers plus pending
      replications minus pending drops on running workers. Recipients are the least
      loaded running workers without a replica. Keys not (yet) in memory are skipped
      and picked up by later runs once computed.
    - It never drops anything. While registered, ``ReduceReplicas`` keeps ``n`` (or
      the number of running workers) replicas of these keys in total instead of 1;
      as it drops from paused/retiring workers first, copies there are released once
      running workers hold the target.
    - Keeping the keys alive is the client's job (hold futures); the policy does not
      pin keys that the scheduler forgets.

    Usable from config:
    ``{"class": "dask_shm.amm.KeepReplicas", "keys": [...], "n": 2}``.

    Raises
    ------
    ValueError
        if ``n`` is not None or an int >= 1.
    TypeError
        if ``keys`` is a string/bytes (a single key must be wrapped in a list).
    """

    __slots__ = ("keys", "n")

    keys: frozenset[Key]
    n: int | None

    def __init__(self, keys: Iterable[Key], n: int | None = None):
        if isinstance(keys, str | bytes):
            raise TypeError("KeepReplicas keys must be an iterable of keys, not one key")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"KeepReplicas n must be None or an int >= 1; got {n!r}")
        self.keys = frozenset(keys)
        self.n = n

    def __repr__(self) -> str:
        return f"KeepReplicas({len(self.keys)} keys, n={self.n})"

    def target(self) -> int:
        """Number of replicas wanted per key right now."""
        nrunning = len(self.manager.scheduler.running)
        return nrunning if self.n is None else min(self.n, nrunning)

    def run(self) -> SuggestionGenerator:
        scheduler = self.manager.scheduler
        running = scheduler.running
        target = self.target()
        for key in self.keys:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state != "memory" or not ts.who_has or ts.actor:
                continue
            have = len(ts.who_has & running)
            entry = self.manager.pending.get(ts)
            if entry is not None:
                have += len(entry[0]) - len(entry[1] & running)
            for _ in range(target - have):
                if (yield Suggestion("replicate", ts)) is None:
                    break  # nowhere left to put it


def replica_targets(manager: Any) -> dict[TaskState, int]:
    """Desired replica count per task from the manager's :class:`KeepReplicas`
    policies (the highest target wins); empty if there are none."""
    out: dict[TaskState, int] = {}
    tasks = manager.scheduler.tasks
    for policy in manager.policies:
        if isinstance(policy, KeepReplicas):
            target = policy.target()
            for key in policy.keys:
                ts = tasks.get(key)
                if ts is not None and target > out.get(ts, 1):
                    out[ts] = target
    return out


def excess_replicas(pending: dict, ts: TaskState, desired: int) -> int:
    """How many replicas of ``ts`` ReduceReplicas asks to drop, given ``desired``.

    Same arithmetic as stock (the waiter rule is the Rust core's
    ``replicas_to_keep``), and pending replications/drops of this run are counted.
    """
    ndrop = len(ts.who_has or ()) - replicas_to_keep(desired, ts.waiters)
    entry = pending.get(ts)
    if entry is not None:
        ndrop += len(entry[0]) - len(entry[1])
    return ndrop
