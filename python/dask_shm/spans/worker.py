"""Worker extension: drop-in for ``distributed.spans.SpansWorkerExtension`` that also
reports how many bytes each span holds on the worker.

The figures travel in the worker's heartbeat *metrics* (``Worker.metrics`` entry
:data:`METRIC_NAME`), not in the extension's own heartbeat payload, so a worker with
this extension still talks to a scheduler running the stock spans extension (which
ignores the entry), and vice versa.

Per key, bytes are read from ``worker.data``:

- a SpillBuffer (stock ``distributed.spill.SpillBuffer`` or ``dask_shm.SpillBuffer``):
  ``data.fast.weights[key]`` is in memory, ``data.store.weight_by_key[key]``
  (stock: ``data._slow_uncached``) is the ``SpilledSize(memory, disk)`` of a spilled key;
- any other mapping: every key is in memory, sized by the worker's own measurement
  (``TaskState.nbytes``) or ``sizeof`` when there is none.

Shared-memory hook: if the data mapping has a method ``shared_bytes(key) -> int``, it
is called for every key (in memory or spilled) and reported as the span's ``shared``
bytes; otherwise shared bytes are 0. A call that raises counts as 0. A mapping that
also has ``shared_bytes_by_key() -> Mapping[Key, int]`` (the keys with shared bytes;
any other key has none) is asked once per report instead, so that a worker holding
100,000 keys, few of them shared, does not pay a call per key. ``shared`` is
reported next to ``memory`` / ``spilled``, not subtracted from them.

Each key is attributed to the span of its task on the worker (``TaskState.span_id``,
set when the worker computes it). Keys the worker only holds as a replica have no
span on the worker; they are reported by key, the scheduler attributes them and
tells the worker their span (see :class:`SpansWorkerExtension`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.sizeof import safe_sizeof
from distributed.spans import SpansWorkerExtension as _StockWorkerExtension

from dask_shm.spans.prometheus import register_worker_extension
from dask_shm.spans.protocol import HINTS_OP, METRIC_NAME, as_key
from dask_shm.spans.span import SPILL_METRICS, spill_metrics_into

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

MEMORY, SPILLED, SPILLED_DISK, SHARED = range(4)

#: A span id learned from the scheduler for a key that has no span on the worker,
#: valid for as long as the worker keeps the same TaskState for the key.
SpanHint = tuple[str, object]


def _shared_bytes_of(data: Any) -> Callable[[Key], int] | None:
    """The data mapping's ``shared_bytes`` hook, made safe: a key it fails on (e.g.
    released meanwhile) counts as 0 shared bytes. From ``shared_bytes_by_key``
    where the mapping has it (one call; a failure counts every key as 0)."""
    bulk = getattr(data, "shared_bytes_by_key", None)
    if callable(bulk):
        try:
            by_key: Mapping[Key, int] = bulk()
        except Exception:
            logger.debug("shared_bytes_by_key() failed", exc_info=True)
            by_key = {}
        return lambda key: by_key.get(key, 0)
    hook = getattr(data, "shared_bytes", None)
    if not callable(hook):
        return None

    def shared_bytes(key: Key) -> int:
        try:
            return int(hook(key))
        except Exception:
            logger.debug("shared_bytes(%r) failed", key, exc_info=True)
            return 0

    return shared_bytes


def _sources(worker: Worker) -> tuple[list[tuple[Key, int]], list[tuple[Key, Any]]]:
    """Snapshot of ``(key, bytes in memory)`` and ``(key, SpilledSize)`` pairs of
    worker.data (the second list is empty when data doesn't spill)."""
    data: Any = worker.data
    weights: Mapping[Key, int] | None = getattr(getattr(data, "fast", None), "weights", None)
    # ``store``: dask-shm's buffers; ``_slow_uncached``: stock's SpillBuffer.
    store = getattr(data, "store", None)
    if store is None:
        store = getattr(data, "_slow_uncached", None)
    spilled: Mapping[Key, Any] | None = getattr(store, "weight_by_key", None)
    if weights is not None and spilled is not None:
        in_memory = list(weights.items())  # atomic for a dict
        on_disk = []
        for key in list(spilled):
            try:
                on_disk.append((key, spilled[key]))
            except KeyError:  # unspilled or released meanwhile
                pass
        return in_memory, on_disk

    tasks = worker.state.tasks
    in_memory = []
    for key in list(data):
        ts = tasks.get(key)
        nbytes = ts.nbytes if ts is not None else None
        if nbytes is None:
            try:
                nbytes = safe_sizeof(data[key])
            except KeyError:  # released meanwhile
                continue
        in_memory.append((key, nbytes))
    return in_memory, []


def memory_by_span(
    worker: Worker, hints: dict[Key, SpanHint] | None = None
) -> tuple[dict[str, list[int]], list[tuple[Key, list[int]]], dict[Key, SpanHint]]:
    """Bytes held by the worker per span id, as ``{span_id: [memory, spilled,
    spilled_disk, shared]}``; the per-key figures of the keys that have no span on
    this worker nor in ``hints``; and the hints that were used (the others are stale).

    Costs about half a microsecond per key held (plus the ``shared_bytes`` hook).
    """
    in_memory, on_disk = _sources(worker)
    shared_bytes = _shared_bytes_of(worker.data)
    tasks_get = worker.state.tasks.get
    hints = hints or {}
    by_span: dict[str, list[int]] = {}
    by_key: list[tuple[Key, list[int]]] = []
    used: dict[Key, SpanHint] = {}
    # One pass per source; the loop body is inlined because it runs once per key.
    for key, nbytes in in_memory:
        ts = tasks_get(key)
        span_id = ts.span_id if ts is not None else None
        if span_id is None:
            hint = hints.get(key)
            if hint is None or hint[1] is not ts:
                shared = shared_bytes(key) if shared_bytes else 0
                by_key.append((key, [int(nbytes), 0, 0, shared]))
                continue
            span_id = hint[0]
            used[key] = hint
        acc = by_span.get(span_id)
        if acc is None:
            acc = by_span[span_id] = [0, 0, 0, 0]
        acc[MEMORY] += nbytes
        if shared_bytes:
            acc[SHARED] += shared_bytes(key)
    for key, size in on_disk:
        ts = tasks_get(key)
        span_id = ts.span_id if ts is not None else None
        if span_id is None:
            hint = hints.get(key)
            if hint is None or hint[1] is not ts:
                shared = shared_bytes(key) if shared_bytes else 0
                by_key.append((key, [0, int(size.memory), int(size.disk), shared]))
                continue
            span_id = hint[0]
            used[key] = hint
        acc = by_span.get(span_id)
        if acc is None:
            acc = by_span[span_id] = [0, 0, 0, 0]
        acc[SPILLED] += size.memory
        acc[SPILLED_DISK] += size.disk
        if shared_bytes:
            acc[SHARED] += shared_bytes(key)
    return by_span, by_key, used


class SpansWorkerExtension(_StockWorkerExtension):
    """Drop-in for :class:`distributed.spans.SpansWorkerExtension`
    (``collect_digests`` and ``heartbeat`` unchanged) that adds the per-span memory
    report (:meth:`memory_report`) to the worker's heartbeat metrics.

    Keys held without a span on this worker (replicas fetched from other workers) are
    reported by key once; the scheduler answers with their span ids
    (:data:`HINTS_OP` stream message), which are then used for as long as the worker
    keeps the key, so later reports aggregate them by span too.
    """

    #: {key: (span id, the worker's TaskState for the key when the hint arrived)}
    span_hints: dict[Key, SpanHint]

    #: Reports that take longer than this to compute are reused by the following
    #: heartbeats, so that reporting takes at most MAX_LOOP_SHARE of the event loop
    SLOW_REPORT_SECONDS = 0.01
    MAX_LOOP_SHARE = 0.05

    _cached_report: dict[str, Any] | None
    _cached_until: float

    def __init__(self, worker: Worker):
        super().__init__(worker)
        self.span_hints = {}
        self._cached_report = None
        self._cached_until = 0.0
        worker.metrics[METRIC_NAME] = self.memory_report
        worker.stream_handlers[HINTS_OP] = self._receive_hints
        register_worker_extension(self)

    def memory_report(self, worker: Worker) -> dict[str, Any]:
        """The heartbeat payload: ``{"by_span": {span_id: [memory, spilled,
        spilled_disk, shared]}, "by_key": [(key, [memory, spilled, spilled_disk,
        shared]), ...], "hints": True}``; ``hints`` tells the scheduler it may answer
        with span ids for the keys in ``by_key``.

        Computed afresh on every call, except on workers holding so many keys that
        it takes more than :attr:`SLOW_REPORT_SECONDS` (roughly 10k keys or more):
        there the last report is reused until ``cost / MAX_LOOP_SHARE`` seconds have
        passed.
        """
        start = monotonic()
        if self._cached_report is not None and start < self._cached_until:
            return self._cached_report
        by_span, by_key, self.span_hints = memory_by_span(worker, self.span_hints)
        report = {"by_span": by_span, "by_key": by_key, "hints": True}
        cost = monotonic() - start
        if cost > self.SLOW_REPORT_SECONDS:
            self._cached_report = report
            self._cached_until = start + cost / self.MAX_LOOP_SHARE
        else:
            self._cached_report = None
        return report

    def _receive_hints(self, spans: Iterable[tuple[Key, str]]) -> None:
        tasks = self.worker.state.tasks
        for key, span_id in spans:
            key = as_key(key)
            ts = tasks.get(key)
            if ts is not None and ts.span_id is None:
                self.span_hints[key] = (span_id, ts)

    def close(self) -> None:
        """Stop reporting memory (called by ``Worker.close``). The hints handler stays
        registered, so that a message already on its way is not an unknown op."""
        if self.worker.metrics.get(METRIC_NAME) == self.memory_report:
            del self.worker.metrics[METRIC_NAME]
        self.span_hints = {}

    def memory_by_span(
        self,
    ) -> tuple[dict[str, list[int]], list[tuple[Key, list[int]]], dict[Key, SpanHint]]:
        """:func:`memory_by_span` of this worker now, with the span ids learned
        so far; reads :attr:`span_hints` without updating it."""
        return memory_by_span(self.worker, self.span_hints)

    def cumulative_spill_by_span(self) -> dict[str, dict[str, float]]:
        """``{span_id: spill metrics}`` accumulated by this worker since it started
        (see :attr:`dask_shm.spans.Span.spill_metrics`)."""
        per_span: dict[str, dict[tuple[Hashable, ...], float]] = {}
        for key, value in list(self.worker.digests_total.items()):
            if isinstance(key, tuple) and len(key) >= 4 and key[0] in ("execute", "p2p"):
                span_id = key[1]
                if isinstance(span_id, str):
                    per_span.setdefault(span_id, {})[key] = value
        out = {}
        for span_id, metrics in per_span.items():
            figures = dict.fromkeys(SPILL_METRICS, 0.0)
            spill_metrics_into(figures, metrics)
            if any(figures.values()):
                out[span_id] = figures
        return out


def install_worker_extension(worker: Worker) -> SpansWorkerExtension:
    """Make :class:`SpansWorkerExtension` the worker's ``"spans"`` extension and
    return it, carrying over metrics the previous extension collected but hasn't
    sent yet. Idempotent. Call it on the worker's event loop (e.g. from a preload or
    worker plugin)."""
    current = worker.extensions.get("spans")
    if isinstance(current, SpansWorkerExtension):
        return current
    ext = SpansWorkerExtension(worker)
    pending = getattr(current, "digests_total_since_heartbeat", None)
    if pending:
        ext.digests_total_since_heartbeat = dict(pending)
    worker.extensions["spans"] = ext
    return ext
