"""Scheduler hooks that tell :class:`dask_shm._core.ReplicaTracker` what changed.

A task's count of replicas to drop (stock ``ReduceReplicas``) depends on its
``who_has``, its ``waiters`` and where those are processing. In ``distributed``:

- ``who_has`` grows only through ``Scheduler.add_replica`` (task completion,
  ``add-keys`` from workers after a fetch or a refused drop). A scheduler plugin
  would not see the ``add-keys`` ones (they are not transitions), so that method
  is wrapped on the scheduler instance (by :class:`dask_shm._core.ReplicaHook`, in
  Rust: it runs on every new replica). Removals (``remove_replica``,
  ``remove_all_replicas``) are not watched: a task with fewer replicas has fewer
  drops to suggest, never more, and the tracker re-reads the replica count of the
  tasks it decided drops for.
- ``waiters`` of a task change when one of its dependents transitions, and a
  dependent's ``processing_on`` changes on its transitions or when work stealing
  moves it (``send_task_to_worker`` without a transition). So a
  ``SchedulerPlugin.transition`` and a wrapped ``send_task_to_worker`` touch the
  task and its dependencies (stock puts a forgotten task's dependencies back for
  plugins).

A scheduler that lacks any of these methods gets no hooks; its managers then scan
every replicated task on every run, as stock does. With ``scheduler.validate``,
every tracked run is checked against a full scan (see
``AmmRun.reduce_replicas_tracked``), so distributed's own tests check the hooks.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_shm._core import ReplicaHook, ReplicaTracker, TrackerHub

#: Attribute of the scheduler holding its :class:`ReplicaHooks`.
HOOKS_ATTRIBUTE = "_dask_shm_replica_hooks"
#: The scheduler methods wrapped by a :class:`dask_shm._core.ReplicaHook`.
HOOKED = ("add_replica", "send_task_to_worker")
_NEEDED = (*HOOKED, "add_plugin")


class ReplicaHooks(SchedulerPlugin):
    """Forwards replica and waiter changes of one scheduler to its trackers.

    The scheduler methods are wrapped by :class:`dask_shm._core.ReplicaHook`
    objects (Rust: they run on every replica change) reporting to ``hub``, a
    :class:`dask_shm._core.TrackerHub` that holds the trackers weakly: a
    manager's tracker stops receiving changes when the manager is gone.
    """

    name = "dask-shm-amm-replica-hooks"

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.hub = TrackerHub()

    def add(self, tracker: ReplicaTracker) -> None:
        """Send changes to ``tracker`` for as long as it lives."""
        self.hub.add(tracker)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        ts = self.scheduler.tasks.get(key)
        if ts is not None:
            self.hub.touch_dependencies(ts)


def replica_hooks(scheduler: Any) -> ReplicaHooks | None:
    """The scheduler's :class:`ReplicaHooks`, installed on first call; None if the
    scheduler lacks a method they need (its managers then rescan every run)."""
    hooks = getattr(scheduler, HOOKS_ATTRIBUTE, None)
    if isinstance(hooks, ReplicaHooks):
        return hooks
    if not all(callable(getattr(scheduler, name, None)) for name in _NEEDED):
        return None
    hooks = ReplicaHooks(scheduler)
    for name in HOOKED:
        setattr(scheduler, name, ReplicaHook(name, getattr(scheduler, name), hooks.hub))
    scheduler.add_plugin(hooks, name=ReplicaHooks.name)
    setattr(scheduler, HOOKS_ATTRIBUTE, hooks)
    return hooks


def subscribe(scheduler: Any) -> ReplicaTracker | None:
    """A new tracker receiving the changes of ``scheduler``; None without hooks."""
    hooks = replica_hooks(scheduler)
    if hooks is None:
        return None
    tracker = ReplicaTracker()
    hooks.add(tracker)
    return tracker
