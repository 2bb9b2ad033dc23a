"""Span: a drop-in for ``distributed.spans.Span`` with O(1) aggregate queries and
per-span memory figures."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, NamedTuple

from distributed.collections import sum_mappings
from distributed.metrics import time
from distributed.spans import Span as StockSpan

if TYPE_CHECKING:
    from distributed.scheduler import TaskStateState

MERGED_ID = "(merged)"

#: Fields of :class:`SpanMemory`, in order.
MEMORY_FIELDS = ("memory", "spilled", "spilled_disk", "shared")


class SpanMemory(NamedTuple):
    """Bytes held on the cluster by the keys of a span, as of the workers' last
    heartbeats.

    - ``memory``: ``sizeof`` of the values held in worker memory (managed memory);
    - ``spilled``: ``sizeof`` of the values spilled to disk;
    - ``spilled_disk``: bytes those spilled values take on disk;
    - ``shared``: bytes reported by the worker's data mapping as shared
      (mmap-backed), see :mod:`dask_shm.spans.worker`.
    """

    memory: int = 0
    spilled: int = 0
    spilled_disk: int = 0
    shared: int = 0


#: ``cumulative_worker_metrics`` activity -> prefix of the :meth:`Span.spill_metrics` keys
_SPILL_ACTIVITIES = {"disk-write": "spill", "disk-read": "unspill"}
SPILL_METRICS = tuple(
    f"{kind}_{unit}" for kind in ("spill", "unspill") for unit in ("bytes", "seconds", "count")
)


class Span(StockSpan):
    """Drop-in for :class:`distributed.spans.Span` (a subclass of it).

    Differences, all invisible to callers of the stock API:

    - ``states``, ``done``, ``nbytes_total``, ``duration``, ``all_durations``,
      ``start`` and ``stop`` are read from counters that the span's TaskGroups keep
      up to date (see :mod:`dask_shm.spans._tracking`) instead of walking every
      group of the span tree, so they cost O(1) (O(children) for a merged span).
      ``duration`` and ``all_durations`` are summed in integer microseconds before
      converting, so they may differ from stock's float sum in the last digits.
    - a span tree without any TaskGroup reports ``stop == enqueued`` where stock
      raises ``ValueError``.

    Additions: :attr:`held`, :attr:`own_held` (bytes held on the cluster) and
    :attr:`spill_metrics` (cumulative spill/unspill bytes, seconds and counts).
    """

    #: This span and its ancestors, innermost first (strong references)
    _lineage: tuple[Span, ...]
    #: Aggregates over the TaskGroups of this span tree
    _n_groups: int
    _tree_states: dict[str, int]
    _tree_not_done: int
    _tree_nbytes: int
    _tree_duration_us: int
    _tree_all_durations_us: dict[str, int]
    _tree_start: float
    _tree_stop: float
    #: Held bytes reported for this span alone / for its tree, in MEMORY_FIELDS order
    _own_held: list[int]
    _tree_held: list[int]
    _annotation_ids: tuple[str, ...]
    #: Brings the held figures up to date before they are read (the scheduler
    #: extension drops departed workers' figures there)
    _settle: Callable[[], None]

    __slots__ = (
        "_lineage",
        "_n_groups",
        "_tree_states",
        "_tree_not_done",
        "_tree_nbytes",
        "_tree_duration_us",
        "_tree_all_durations_us",
        "_tree_start",
        "_tree_stop",
        "_own_held",
        "_tree_held",
        "_annotation_ids",
        "_settle",
    )

    def __init__(
        self,
        name: tuple[str, ...],
        id_: str,
        parent: Span | None,
        total_nthreads_history: list[tuple[float, int]],
    ):
        super().__init__(name, id_, parent, total_nthreads_history)
        self._lineage = (self, *parent._lineage) if parent is not None else (self,)
        self._annotation_ids = tuple(sp.id for sp in reversed(self._lineage))
        self._n_groups = 0
        self._tree_states = {}
        self._tree_not_done = 0
        self._tree_nbytes = 0
        self._tree_duration_us = 0
        self._tree_all_durations_us = {}
        self._tree_start = 0.0
        self._tree_stop = 0.0
        self._own_held = [0] * len(MEMORY_FIELDS)
        self._tree_held = [0] * len(MEMORY_FIELDS)
        self._settle = _nothing_to_settle

    @property
    def _merged(self) -> bool:
        return self.id == MERGED_ID

    @property
    def annotation(self) -> dict[str, tuple[str, ...]] | None:
        if self.name == ("default",):
            return None
        return {"name": self.name, "ids": self._annotation_ids}

    @property
    def states(self) -> dict[TaskStateState, int]:
        if self._merged:
            return sum_mappings(child.states for child in self.children)
        return dict(self._tree_states) if self._n_groups else {}  # type: ignore[return-value]

    @property
    def done(self) -> bool:
        if self._merged:
            return all(child.done for child in self.children)
        return self._tree_not_done == 0

    @property
    def nbytes_total(self) -> int:
        if self._merged:
            return sum(child.nbytes_total for child in self.children)
        return self._tree_nbytes

    @property
    def duration(self) -> float:
        return self._duration_us() / 1e6

    def _duration_us(self) -> int:
        if self._merged:
            return sum(_as_ours(child)._duration_us() for child in self.children)
        return self._tree_duration_us

    @property
    def all_durations(self) -> dict[str, float]:
        return {action: us / 1e6 for action, us in self._all_durations_us().items()}

    def _all_durations_us(self) -> dict[str, int]:
        if self._merged:
            return sum_mappings(_as_ours(c)._all_durations_us() for c in self.children)
        return self._tree_all_durations_us

    def _first_start(self) -> float:
        """Earliest non-zero TaskGroup.start of the tree, 0.0 if none"""
        if self._merged:
            return min(
                (s for c in self.children if (s := _as_ours(c)._first_start())),
                default=0.0,
            )
        return self._tree_start

    def _last_stop(self) -> float:
        if self._merged:
            return max((_as_ours(c)._last_stop() for c in self.children), default=0.0)
        return self._tree_stop

    @property
    def start(self) -> float:
        out = self._first_start()
        return max(out, self.enqueued) if out else out

    @property
    def stop(self) -> float:
        out = self._last_stop() if self.done else time()
        return max(out, self.enqueued)

    @staticmethod
    def merge(*items: StockSpan) -> Span:
        """Merge multiple unrelated spans into a synthetic one (see stock
        ``Span.merge``).

        Raises
        ------
        ValueError
            No spans were given.
        """
        if not items:
            raise ValueError("Nothing to merge")
        out = Span(
            name=("(merged)",),
            id_=MERGED_ID,
            parent=None,
            total_nthreads_history=items[0]._total_nthreads_history,
        )
        out._total_nthreads_offset = min(child._total_nthreads_offset for child in items)
        out.children.extend(items)
        out.enqueued = min(child.enqueued for child in items)
        return out

    # --- memory and spilling ---------------------------------------------------

    @property
    def held(self) -> SpanMemory:
        """Bytes held on the cluster by the keys of this span tree, as of the last
        worker heartbeats."""
        self._settle()
        if self._merged:
            return SpanMemory(
                *(sum(v) for v in zip(*(_as_ours(c).held for c in self.children), strict=True))
            )
        return SpanMemory(*self._tree_held)

    @property
    def own_held(self) -> SpanMemory:
        """Like :attr:`held`, but only for the keys of this span, not its children.
        Summed over all spans, these equal the cluster-wide totals."""
        if self._merged:
            return SpanMemory()
        self._settle()
        return SpanMemory(*self._own_held)

    def _add_held(self, delta: list[int]) -> None:
        """Add ``delta`` (MEMORY_FIELDS order) to this span's own figures and to the
        tree figures of this span and its ancestors."""
        own = self._own_held
        for i, d in enumerate(delta):
            own[i] += d
        for sp in self._lineage:
            tree = sp._tree_held
            for i, d in enumerate(delta):
                tree[i] += d

    @property
    def spill_metrics(self) -> dict[str, float]:
        """Cumulative spilling caused by this span tree, from the fine performance
        metrics the workers report with their heartbeats: bytes written to/read from
        disk, seconds spent doing it and number of keys, as
        ``{"spill_bytes", "spill_seconds", "spill_count", "unspill_bytes",
        "unspill_seconds", "unspill_count"}``.

        Spilling is attributed to the span of the task running when it happened
        (e.g. the task whose output pushed older keys to disk), which answers
        "which part of my workflow causes spilling". Spilling outside of a task
        (memory monitor, transfers between workers) has no span and is not counted.
        """
        out = dict.fromkeys(SPILL_METRICS, 0.0)
        for sp in self.traverse_spans():
            spill_metrics_into(out, sp._cumulative_worker_metrics)
        return out

    @property
    def own_spill_metrics(self) -> dict[str, float]:
        """Like :attr:`spill_metrics`, but only for the tasks of this span, not its
        children."""
        out = dict.fromkeys(SPILL_METRICS, 0.0)
        spill_metrics_into(out, self._cumulative_worker_metrics)
        return out


def spill_metrics_into(out: dict[str, float], metrics: dict[tuple[Hashable, ...], float]) -> None:
    """Add the disk-write / disk-read entries of span-level fine performance metrics
    (keys ``(context, ..., activity, unit)``) to ``out``."""
    for key, value in metrics.items():
        if len(key) < 3:
            continue
        kind = _SPILL_ACTIVITIES.get(key[-2])  # type: ignore[call-overload]
        if kind is not None:
            name = f"{kind}_{key[-1]}"
            if name in out:
                out[name] += value


def _as_ours(span: StockSpan) -> Span:
    if not isinstance(span, Span):
        raise TypeError(f"Cannot merge a stock span with dask_shm spans: {span!r}")
    return span


def _nothing_to_settle() -> None:
    pass
