"""Scheduler extension: drop-in for ``distributed.spans.SpansSchedulerExtension``.

On top of the stock behaviour it:

- keeps the aggregates of every span up to date incrementally (see
  :mod:`dask_shm.spans._tracking`), so ``observe_tasks`` and ``Span.done`` /
  ``states`` / ``nbytes_total`` don't walk the span tree's TaskGroups;
- sums the per-span memory figures each worker sends with its heartbeat metrics
  (see :mod:`dask_shm.spans.worker`) into :attr:`Span.held` / :attr:`Span.own_held`,
  forgetting a worker's figures when it leaves;
- answers the ``dask_shm_span_memory`` RPC used by
  :func:`dask_shm.spans.span_memory`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.spans import Span as StockSpan
from distributed.spans import SpanMetadata
from distributed.spans import SpansSchedulerExtension as _StockSchedulerExtension

from dask_shm.spans._tracking import attach_group
from dask_shm.spans.prometheus import register_scheduler_extension
from dask_shm.spans.protocol import HINTS_OP, METRIC_NAME, RPC_NAME, as_key
from dask_shm.spans.span import MEMORY_FIELDS, Span

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed import scheduler as scheduler_module
    from distributed.client import SourceCode

logger = logging.getLogger(__name__)

_N = len(MEMORY_FIELDS)


class SpansSchedulerExtension(_StockSchedulerExtension):
    """Drop-in for :class:`distributed.spans.SpansSchedulerExtension` whose spans are
    :class:`dask_shm.spans.Span`.

    ``spans``, ``root_spans``, ``spans_search_by_name``, ``spans_search_by_tag``,
    ``observe_tasks``, ``find_by_tags``, ``merge_all``, ``merge_by_tags`` and
    ``heartbeat`` behave as in stock, except that a malformed span annotation raises
    ``ValueError`` (stock: ``AssertionError``) and heartbeat metrics for a span id
    the scheduler doesn't know are dropped (stock: ``KeyError``, failing the
    worker's heartbeat).

    The scheduler's TaskGroups are instrumented when they join a span (see
    :mod:`dask_shm.spans._tracking`); this costs about a microsecond per task
    state transition.
    """

    spans: dict[str, Span]  # type: ignore[assignment]
    root_spans: list[Span]  # type: ignore[assignment]
    #: {worker address: {span id: [memory, spilled, spilled_disk, shared]}}
    worker_held: dict[str, dict[str, list[int]]]

    def __init__(self, scheduler: Scheduler):
        super().__init__(scheduler)
        self.worker_held = {}
        scheduler.handlers[RPC_NAME] = self.span_memory_records
        register_scheduler_extension(self)

    # --- span tree ---------------------------------------------------------------

    def observe_tasks(
        self,
        tss: Iterable[scheduler_module.TaskState],
        code: tuple[SourceCode, ...],
        span_metadata: SpanMetadata,
    ) -> dict[Key, dict]:
        """Attach newly runnable tasks to their span, or to the current default span
        (opening a new one if the previous one is done), as stock does.

        Returns the updated 'span' annotations: ``{key: {"name": ..., "ids": ...}}``.
        """
        out: dict[Key, dict] = {}
        default_span: Span | None = None
        metadata_added: set[Span] = set()
        spans = self.spans
        for ts in tss:
            annotations = ts.annotations
            if annotations is None:
                annotations = ts.annotations = {}
            tg = ts.group
            if tg.span_id:
                span = spans[tg.span_id]
            else:
                ann = annotations.get("span")
                if ann:
                    span = self._ensure_span(ann["name"], ann["ids"])
                else:
                    if default_span is None:
                        default_span = self._ensure_default_span()
                    span = default_span
                tg.span_id = span.id
                attach_group(tg, span)

            if code:
                span._code[code] = None
            if span_metadata and span not in metadata_added:
                metadata_added.add(span)
                span.add_metadata(span_metadata)

            if span.name == ("default",):
                annotations.pop("span", None)
            else:
                annotations["span"] = out[ts.key] = {
                    "name": span.name,
                    "ids": span._annotation_ids,
                }
        return out

    def _ensure_default_span(self) -> Span:
        defaults = self.spans_search_by_name["default",]
        if defaults and not defaults[-1].done:
            return defaults[-1]  # type: ignore[return-value]
        return self._ensure_span(("default",), (str(uuid.uuid4()),))

    def _ensure_span(self, name: tuple[str, ...], ids: tuple[str, ...]) -> Span:
        """Return the span with id ``ids[-1]``, creating it and its missing
        ancestors.

        Raises
        ------
        ValueError
            ``name`` and ``ids`` are empty or of different lengths.
        """
        try:
            return self.spans[ids[-1]]
        except (KeyError, IndexError):
            pass
        if not name or len(name) != len(ids):
            raise ValueError(
                f"A span annotation needs as many ids as tags, at least one; "
                f"got name={name!r}, ids={ids!r}"
            )
        parent = self._ensure_span(name[:-1], ids[:-1]) if len(name) > 1 else None
        span = Span(
            name=tuple(name),
            id_=ids[-1],
            parent=parent,
            total_nthreads_history=self.scheduler.total_nthreads_history,
        )
        self._register(span)
        return span

    def _register(self, span: Span) -> None:
        # Spans carried over from a stock extension too: their figures must
        # drop departed workers before they are read.
        span._settle = self.forget_departed_workers
        self.spans[span.id] = span
        self.spans_search_by_name[span.name].append(span)
        for tag in span.name:
            self.spans_search_by_tag[tag].append(span)
        parent = span.parent
        if parent is not None:
            parent.children.append(span)
        else:
            self.root_spans.append(span)

    def merge_all(self) -> Span:
        """Synthetic span summing all spans.

        Raises
        ------
        ValueError
            There are no spans yet.
        """
        return Span.merge(*self.root_spans)

    def merge_by_tags(self, *tags: str) -> Span:
        """Synthetic span summing the spans that carry any of ``tags``.

        Raises
        ------
        ValueError
            No span carries any of ``tags``.
        """
        return Span.merge(*self.find_by_tags(*tags))

    # --- heartbeats --------------------------------------------------------------

    def heartbeat(
        self, ws: scheduler_module.WorkerState, data: dict[tuple[Hashable, ...], float]
    ) -> None:
        """Add the worker's span-level fine performance metrics to the spans (as stock
        does), then replace the worker's previous memory figures with the ones in its
        heartbeat metrics, if it sent any."""
        spans = self.spans
        for (context, span_id, *other), v in data.items():
            span = spans.get(span_id)  # type: ignore[call-overload]
            if span is None:
                logger.debug("Metrics for unknown span %r from %s", span_id, ws.address)
                continue
            span._cumulative_worker_metrics[(context, *other)] += v
        metrics = ws.metrics or {}
        report = metrics.get(METRIC_NAME)
        self.forget_departed_workers()
        if report is not None:
            try:
                self.update_worker_held(ws.address, report)
            except (TypeError, ValueError, AttributeError) as e:
                # Never fail the worker's heartbeat over a malformed report
                logger.warning("Ignoring malformed span memory report from %s: %s", ws.address, e)

    def update_worker_held(self, address: str, report: dict[str, Any]) -> None:
        """Make ``report`` (see :meth:`dask_shm.spans.SpansWorkerExtension.memory_report`)
        the current figures of worker ``address``.

        Keys the worker couldn't attribute to a span are looked up in the scheduler's
        task table; keys unknown to the scheduler, or in no span, are not counted.
        """
        new: dict[str, list[int]] = {}
        for span_id, figures in report.get("by_span", {}).items():
            if span_id in self.spans:
                _accumulate(new, span_id, figures)
        tasks = self.scheduler.tasks
        hints = []
        for key, figures in report.get("by_key", ()):
            key = as_key(key)
            ts = tasks.get(key)
            span_id = ts.group.span_id if ts is not None else None
            if span_id is not None and span_id in self.spans:
                _accumulate(new, span_id, figures)
                hints.append((key, span_id))
        if hints and report.get("hints"):
            # The worker's extension handles HINTS_OP (it said so): tell it the spans,
            # so that it aggregates these keys itself from now on.
            bcomm = self.scheduler.stream_comms.get(address)
            if bcomm is not None:
                bcomm.send({"op": HINTS_OP, "spans": hints})
        old = self.worker_held.get(address, {})
        self._apply_delta(old, new)
        self.worker_held[address] = new

    def forget_departed_workers(self) -> None:
        """Drop the memory figures of workers that left the scheduler.

        Called before figures are read or updated rather than from a
        ``remove_worker`` plugin, so that the scheduler's plugin list stays as
        stock's. Costs one set difference over the reporting workers."""
        held = self.worker_held
        if held and not held.keys() <= self.scheduler.workers.keys():
            for address in held.keys() - self.scheduler.workers.keys():
                self.forget_worker(address)

    def forget_worker(self, address: str) -> None:
        """Remove the memory figures of a worker that left the cluster."""
        old = self.worker_held.pop(address, None)
        if old:
            self._apply_delta(old, {})

    def _apply_delta(self, old: dict[str, list[int]], new: dict[str, list[int]]) -> None:
        zero = [0] * _N
        for span_id in old.keys() | new.keys():
            o = old.get(span_id, zero)
            n = new.get(span_id, zero)
            if o != n:
                self.spans[span_id]._add_held([b - a for a, b in zip(o, n, strict=True)])

    # --- client queries ----------------------------------------------------------

    def span_memory_records(self, own: bool = False) -> list[dict[str, Any]]:
        """Handler of the ``dask_shm_span_memory`` RPC: one record per span, in
        creation order, with its name (tags joined by ``" / "``), id, parent id,
        ``done``, held bytes (:class:`~dask_shm.spans.SpanMemory` fields) and spill
        metrics (:attr:`Span.spill_metrics` keys).

        Figures cover the span and its sub-spans, or the span alone if ``own``.
        """
        out = []
        for span in self.spans.values():
            held = span.own_held if own else span.held
            spill = span.own_spill_metrics if own else span.spill_metrics
            parent = span.parent
            out.append(
                {
                    "span": " / ".join(span.name),
                    "span_id": span.id,
                    "parent_id": parent.id if parent is not None else None,
                    "done": span.done,
                    **held._asdict(),
                    **spill,
                }
            )
        return out


def _accumulate(into: dict[str, list[int]], span_id: str, figures: Iterable[int]) -> None:
    """Add ``figures`` to ``into[span_id]``.

    Raises
    ------
    ValueError
        ``figures`` is not a sequence of len(MEMORY_FIELDS) integers.
    """
    values = list(figures)
    if len(values) != _N or not all(isinstance(v, int) for v in values):
        raise ValueError(f"Expected {_N} integers {MEMORY_FIELDS}; got {values!r}")
    acc = into.get(span_id)
    if acc is None:
        into[span_id] = values
    else:
        for i, v in enumerate(values):
            acc[i] += v


def _convert(old: StockSpan, parent: Span | None, history: list[tuple[float, int]]) -> Span:
    """Our Span with the same identity, timestamps and metrics as ``old``; groups are
    attached separately."""
    new = Span(old.name, old.id, parent, history)
    new.enqueued = old.enqueued
    new._total_nthreads_offset = old._total_nthreads_offset
    new._code = dict(old._code)
    new._metadata = old._metadata
    new._cumulative_worker_metrics.update(old._cumulative_worker_metrics)
    return new


def install_scheduler_extension(scheduler: Scheduler) -> SpansSchedulerExtension:
    """Make :class:`SpansSchedulerExtension` the scheduler's ``"spans"`` extension and
    return it.

    Spans already recorded by a previous (stock) extension are carried over with
    their ids, names, timestamps, code, metadata and metrics; their TaskGroups are
    attached to the new spans. Idempotent: an extension of ours is left in place.
    Call it on the scheduler's event loop (e.g. from a preload or scheduler plugin).
    """
    current = scheduler.extensions.get("spans")
    if isinstance(current, SpansSchedulerExtension):
        return current
    ext = SpansSchedulerExtension(scheduler)
    if current is not None and getattr(current, "spans", None):
        history = scheduler.total_nthreads_history
        # Parents are created before their children, so one pass in creation order
        # rebuilds the tree and keeps every by-name/by-tag list in creation order.
        for old in current.spans.values():
            parent = ext.spans[old.parent.id] if old.parent is not None else None
            ext._register(_convert(old, parent, history))
        for old in current.spans.values():
            for tg in old.groups:
                attach_group(tg, ext.spans[old.id])
    scheduler.extensions["spans"] = ext
    return ext
