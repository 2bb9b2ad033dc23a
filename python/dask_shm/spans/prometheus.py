"""Per-span memory and spilling in the scheduler's and workers' Prometheus metrics.

Stock distributed serves ``/metrics`` from the process-global
``prometheus_client.REGISTRY``, through one collector per server kind whose
``server`` is repointed at whichever server handles the request. We register one
extra collector per kind in the same registry (when ``prometheus_client`` is
installed) and report on the same server stock's collector points at, so the span
figures appear on that server's ``/metrics`` page:

Scheduler (own figures of each span, so that they add up over spans; spans with
nothing to report are left out):

- ``<ns>_shm_scheduler_span_memory_bytes{span, span_id, type}``: gauge, ``type`` one of
  ``memory``, ``spilled``, ``spilled_disk``, ``shared`` (see
  :class:`dask_shm.spans.SpanMemory`);
- ``<ns>_shm_scheduler_span_spill_bytes_total{span, span_id, direction}`` and
  ``<ns>_shm_scheduler_span_spill_seconds_total{...}``: counters, ``direction`` one of
  ``spill`` (written to disk) and ``unspill`` (read back).

Worker (what this worker holds / has spilled, per span id; keys that have no span on
the worker are reported with ``span_id=""``):

- ``<ns>_shm_worker_span_memory_bytes{span_id, type}``;
- ``<ns>_shm_worker_span_spill_bytes_total{span_id, direction}`` and
  ``<ns>_shm_worker_span_spill_seconds_total{...}``.

``<ns>`` is ``distributed.dashboard.prometheus.namespace`` (``dask`` by default),
as for distributed's own series.

Bounded: a long-lived cluster runs one span per computation, so finished spans
are folded. A span's spill counters move into one series with
``span_id="finished"`` (and ``span="finished"`` on the scheduler) once it is done
(scheduler: all its tasks finished; worker: it holds no keys and its counters have
not changed) for ``shm.prometheus.span-retention`` (5 minutes by default). The
folded series is the sum of the folded spans, so every counter stays monotone and
sums over spans still add up. Memory gauges are only exported for spans that hold
something, so they are bounded by the data held.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from dask_shm.config import prometheus_series_name, setting_duration
from dask_shm.spans.span import MEMORY_FIELDS, Span


# What the collectors read from the extensions (structural, so that the
# extension modules, which register here, are not imported back).
class SchedulerSpansSource(Protocol):
    @property
    def scheduler(self) -> Any: ...
    @property
    def spans(self) -> Mapping[str, Span]: ...


class WorkerSpansSource(Protocol):
    @property
    def worker(self) -> Any: ...

    def memory_by_span(self) -> tuple[dict[str, list[int]], list[Any], Any]: ...
    def cumulative_spill_by_span(self) -> dict[str, dict[str, float]]: ...


_scheduler_exts: weakref.WeakSet[SchedulerSpansSource] = weakref.WeakSet()
_worker_exts: weakref.WeakSet[WorkerSpansSource] = weakref.WeakSet()
_registered: set[str] = set()


def _stock_server(module: str, attr: str) -> Any:
    """The server stock's Prometheus collector of this kind currently reports on."""
    mod = sys.modules.get(module)
    collector = getattr(getattr(mod, "PrometheusHandler", None), attr, None)
    if isinstance(collector, tuple):
        collector = collector[0] if collector else None
    return getattr(collector, "server", None)


def _pick(exts: weakref.WeakSet[Any], server: Any, attr: str) -> Any:
    live = list(exts)
    for ext in live:
        if server is not None and getattr(ext, attr) is server:
            return ext
    if server is None and len(live) == 1:
        return live[0]
    return None


#: ``span_id`` (and ``span``) label of the series finished spans are folded into;
#: real span ids are UUIDs.
FOLDED = "finished"


def retention() -> float:
    """``shm.prometheus.span-retention`` in seconds: how long a finished span
    keeps series of its own. Raises ValueError naming the key."""
    return setting_duration("shm.prometheus.span-retention")


def _sum_into(total: dict[str, float], figures: dict[str, float]) -> None:
    for k, v in figures.items():
        total[k] = total.get(k, 0.0) + v


class IdleSpans:
    """Which span ids' spill counters have not changed for a while (the worker
    does not know when a span finishes). Keeps state for live spans and the set
    of folded ids (as long-lived as the worker's own ``digests_total``, which
    holds several entries per span)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[tuple[float, ...], float]] = {}
        self.folded: set[str] = set()

    def split(
        self,
        figures: dict[str, dict[str, float]],
        holding: Iterable[str],
        now: float,
        retention: float,
    ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """(live spans' figures, the sum of folded spans' figures). A span is
        folded once it holds no keys (not in ``holding``) and its figures have
        not changed for ``retention`` seconds; a folded span never comes back."""
        holding = set(holding)
        live: dict[str, dict[str, float]] = {}
        folded: dict[str, float] = {}
        for span_id, values in figures.items():
            if span_id in self.folded:
                _sum_into(folded, values)
                continue
            snapshot = tuple(values[k] for k in sorted(values))
            last = self._last.get(span_id)
            if last is None or last[0] != snapshot or span_id in holding:
                self._last[span_id] = (snapshot, now)
                live[span_id] = values
            elif now - last[1] >= retention:
                del self._last[span_id]
                self.folded.add(span_id)
                _sum_into(folded, values)
            else:
                live[span_id] = values
        return live, folded


def _spill_families(subsystem: str, labels: list[str]) -> tuple[Any, Any]:
    from prometheus_client.core import CounterMetricFamily

    nbytes = CounterMetricFamily(
        prometheus_series_name(subsystem, "span_spill"),
        "Bytes spilled to / unspilled from disk while tasks of the span ran",
        labels=[*labels, "direction"],
        unit="bytes",
    )
    seconds = CounterMetricFamily(
        prometheus_series_name(subsystem, "span_spill"),
        "Seconds spent spilling to / unspilling from disk while tasks of the span ran",
        labels=[*labels, "direction"],
        unit="seconds",
    )
    return nbytes, seconds


def _add_spill(nbytes: Any, seconds: Any, labels: list[str], figures: dict[str, float]) -> None:
    for direction in ("spill", "unspill"):
        nbytes.add_metric([*labels, direction], figures[f"{direction}_bytes"])
        seconds.add_metric([*labels, direction], figures[f"{direction}_seconds"])


class SchedulerSpansCollector:
    """prometheus_client collector for the scheduler's spans (see module doc)."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        server = _stock_server("distributed.http.scheduler.prometheus.core", "_collectors")
        ext = _pick(_scheduler_exts, server, "scheduler")
        if ext is None:
            return
        memory = GaugeMetricFamily(
            prometheus_series_name("scheduler", "span_memory"),
            "Bytes held on the cluster by the keys of the span (not its children)",
            labels=["span", "span_id", "type"],
            unit="bytes",
        )
        nbytes, seconds = _spill_families("scheduler", ["span", "span_id"])
        cutoff = time.time() - retention()
        folded: dict[str, float] = {}
        for span in list(ext.spans.values()):
            labels = [" / ".join(span.name), span.id]
            held = span.own_held
            if any(held):
                for field, value in zip(MEMORY_FIELDS, held, strict=True):
                    memory.add_metric([*labels, field], value)
            spill = span.own_spill_metrics
            if not any(spill.values()):
                continue
            if not any(held) and span.done and span.stop < cutoff:
                _sum_into(folded, spill)
            else:
                _add_spill(nbytes, seconds, labels, spill)
        if folded:
            _add_spill(nbytes, seconds, [FOLDED, FOLDED], folded)
        yield memory
        yield nbytes
        yield seconds


class WorkerSpansCollector:
    """prometheus_client collector for a worker's spans (see module doc)."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        server = _stock_server("distributed.http.worker.prometheus.core", "_collector")
        ext = _pick(_worker_exts, server, "worker")
        if ext is None:
            return
        by_span, by_key, _ = ext.memory_by_span()
        if by_key:
            unattributed = [0] * len(MEMORY_FIELDS)
            for _, figures in by_key:
                for i, v in enumerate(figures):
                    unattributed[i] += v
            by_span[""] = unattributed
        memory = GaugeMetricFamily(
            prometheus_series_name("worker", "span_memory"),
            "Bytes held by this worker for the keys of the span",
            labels=["span_id", "type"],
            unit="bytes",
        )
        for span_id, figures in by_span.items():
            for field, value in zip(MEMORY_FIELDS, figures, strict=True):
                memory.add_metric([span_id, field], value)
        yield memory
        nbytes, seconds = _spill_families("worker", ["span_id"])
        live, folded = _idle_worker_spans(ext).split(
            ext.cumulative_spill_by_span(), by_span, time.monotonic(), retention()
        )
        for span_id, spill in live.items():
            _add_spill(nbytes, seconds, [span_id], spill)
        if folded:
            _add_spill(nbytes, seconds, [FOLDED], folded)
        yield nbytes
        yield seconds


_idle: weakref.WeakKeyDictionary[WorkerSpansSource, IdleSpans] = weakref.WeakKeyDictionary()


def _idle_worker_spans(ext: WorkerSpansSource) -> IdleSpans:
    idle = _idle.get(ext)
    if idle is None:
        idle = _idle[ext] = IdleSpans()
    return idle


def _register(kind: str, collector: Any) -> None:
    if kind in _registered:
        return
    try:
        import prometheus_client
    except ImportError:
        return
    prometheus_client.REGISTRY.register(collector)
    _registered.add(kind)


def register_scheduler_extension(ext: SchedulerSpansSource) -> None:
    """Make ``ext`` reportable on its scheduler's ``/metrics`` page."""
    _scheduler_exts.add(ext)
    _register("scheduler", SchedulerSpansCollector())


def register_worker_extension(ext: WorkerSpansSource) -> None:
    """Make ``ext`` reportable on its worker's ``/metrics`` page."""
    _worker_exts.add(ext)
    _register("worker", WorkerSpansCollector())
