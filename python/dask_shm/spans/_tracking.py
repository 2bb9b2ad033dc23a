"""Incremental per-span counters fed by the scheduler's own TaskGroup updates.

Stock ``distributed.spans.Span`` answers ``states``, ``done``, ``nbytes_total``,
``duration`` ... by walking every TaskGroup of the span tree on each call. Here,
when a TaskGroup is attached to a span, it is instrumented so that every change the
scheduler makes to it is pushed, as a delta, to the span and all its ancestors:

- ``tg.states`` (a plain dict mutated in place by ``TaskState.state``'s setter) is
  replaced by :class:`GroupStates`, a dict subclass with the same contents whose
  ``__setitem__`` forwards the change;
- ``tg`` itself is re-classed to a slot-compatible subclass of its class (see
  :func:`tracked_class`) whose ``update_nbytes`` and ``add_duration`` forward the
  change after running the stock method.

The scheduler sees the same values and types it always did (``GroupStates`` is a
``dict``; the re-classed group is an instance of its original class), so nothing
else changes behaviour. Every forwarded value is read back from the group after the
stock method ran, so the counters equal what a full walk would compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed.scheduler import TaskGroup

    from dask_shm.spans.span import Span

#: Task states in which a TaskGroup with tasks is *not* done (see ``TaskGroup.done``).
ACTIVE_STATES = frozenset({"waiting", "no-worker", "queued", "processing"})


class GroupStates(dict):  # type: ignore[type-arg]
    """``TaskGroup.states`` that forwards every change to the spans in ``lineage``.

    ``active`` is the number of states in :data:`ACTIVE_STATES` with a non-zero count,
    so the group is done (by ``TaskGroup.done``'s definition) iff ``active == 0``.
    """

    __slots__ = ("lineage", "trees", "active")

    lineage: tuple[Span, ...]
    #: ``_tree_states`` of every span in ``lineage`` (saves attribute lookups)
    trees: tuple[dict[str, int], ...]
    active: int

    def __init__(self, states: Mapping[Any, int], lineage: tuple[Span, ...]):
        super().__init__(states)
        self.lineage = lineage
        self.trees = tuple(sp._tree_states for sp in lineage)
        self.active = sum(1 for s, n in states.items() if n != 0 and s in ACTIVE_STATES)

    # This runs twice per task transition on the scheduler: keep it lean.
    def __setitem__(
        self,
        state: str,
        value: int,
        _set: Any = dict.__setitem__,
        _active_states: frozenset[str] = ACTIVE_STATES,
    ) -> None:
        try:
            old = self[state]
        except KeyError:
            old = 0
        _set(self, state, value)
        delta = value - old
        if not delta:
            return
        for tree in self.trees:
            try:
                tree[state] += delta
            except KeyError:
                tree[state] = delta
        if state in _active_states and (old == 0) is not (value == 0):
            was_done = not self.active
            self.active += 1 if value else -1
            if was_done is not (not self.active):
                step = 1 if was_done else -1
                for sp in self.lineage:
                    sp._tree_not_done += step

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies and pickles are plain dicts: the forwarding is tied to one group.
        return (dict, (dict(self),))


_TRACKED_CLASSES: dict[type, type] = {}


def _lineage_of(tg: TaskGroup) -> tuple[Span, ...]:
    # A copy of a tracked group has plain-dict states (see GroupStates.__reduce__):
    # it forwards nothing.
    return getattr(tg.states, "lineage", ())


def _update_nbytes(self: TaskGroup, diff: int) -> None:
    type(self).__mro__[1].update_nbytes(self, diff)  # type: ignore[attr-defined]
    if diff:
        for sp in _lineage_of(self):
            sp._tree_nbytes += diff


def _add_duration(self: TaskGroup, action: str, start: float, stop: float) -> None:
    before_total = self._duration_us
    before_action = self._all_durations_us.get(action, 0)
    type(self).__mro__[1].add_duration(self, action, start, stop)  # type: ignore[attr-defined]
    d_total = self._duration_us - before_total
    d_action = self._all_durations_us[action] - before_action
    tg_start, tg_stop = self.start, self.stop
    for sp in _lineage_of(self):
        sp._tree_duration_us += d_total
        durations = sp._tree_all_durations_us
        durations[action] = durations.get(action, 0) + d_action
        if tg_start and (not sp._tree_start or tg_start < sp._tree_start):
            sp._tree_start = tg_start
        if tg_stop > sp._tree_stop:
            sp._tree_stop = tg_stop


def tracked_class(cls: type) -> type:
    """Slot-compatible subclass of a TaskGroup class that forwards nbytes and
    duration updates to the spans of the group (cached per class)."""
    try:
        return _TRACKED_CLASSES[cls]
    except KeyError:
        pass
    name = f"Tracked{cls.__name__}_{len(_TRACKED_CLASSES)}"
    sub = type(
        name,
        (cls,),
        {
            "__slots__": (),
            # Importable under this name, so that instances can be pickled
            "__module__": __name__,
            "__qualname__": name,
            "update_nbytes": _update_nbytes,
            "add_duration": _add_duration,
            "_dask_shm_tracked": True,
        },
    )
    _TRACKED_CLASSES[cls] = sub
    globals()[name] = sub
    return sub


def attach_group(tg: TaskGroup, span: Span) -> None:
    """Add ``tg`` to ``span.groups``, add its current figures to ``span`` and its
    ancestors, and instrument it so later changes follow.

    Raises
    ------
    ValueError
        ``tg`` is already attached to a span (a TaskGroup belongs to one span).
    """
    if isinstance(tg.states, GroupStates):
        raise ValueError(f"{tg!r} is already attached to a span")
    lineage = span._lineage
    states = GroupStates(tg.states, lineage)
    start, stop = tg.start, tg.stop
    for sp in lineage:
        sp._n_groups += 1
        tree = sp._tree_states
        for state, n in states.items():
            tree[state] = tree.get(state, 0) + n
        if states.active:
            sp._tree_not_done += 1
        sp._tree_nbytes += tg.nbytes_total
        sp._tree_duration_us += tg._duration_us
        durations = sp._tree_all_durations_us
        for action, us in tg._all_durations_us.items():
            durations[action] = durations.get(action, 0) + us
        if start and (not sp._tree_start or start < sp._tree_start):
            sp._tree_start = start
        if stop > sp._tree_stop:
            sp._tree_stop = stop
    tg.states = states  # type: ignore[assignment]
    if not getattr(type(tg), "_dask_shm_tracked", False):
        tg.__class__ = tracked_class(type(tg))
    span.groups.add(tg)
