"""Per-span memory and spilling in the scheduler's and workers' Prometheus metrics.

Stock distributed serves ``/metrics`` from the process-global
``prometheus_client.REGISTRY``, through one collector per server kind whose
``server`` is repointed at whichever server handles the request. We register one
extra collector per kind in the same registry (when ``prometheus_client`` is
installed) and report on the same server stock's collector points at, so the span
figures appear on that server's ``/metrics`` page:

Scheduler (own figures of each span, so that they add up over spans; spans with
nothing to report are left out):

- ``<ns>_scheduler_span_memory_bytes{span, span_id, type}``: gauge, ``type`` one of
  ``memory``, ``spilled``, ``spilled_disk``, ``shared`` (see
  :class:`dask_shm.spans.SpanMemory`);
- ``<ns>_scheduler_span_spill_bytes_total{span, span_id, direction}`` and
  ``<ns>_scheduler_span_spill_seconds_total{...}``: counters, ``direction`` one of
  ``spill`` (written to disk) and ``unspill`` (read back).

Worker (what this worker holds / has spilled, per span id; keys that have no span on
the worker are reported with ``span_id=""``):

- ``<ns>_worker_span_memory_bytes{span_id, type}``;
- ``<ns>_worker_span_spill_bytes_total{span_id, direction}`` and
  ``<ns>_worker_span_spill_seconds_total{...}``.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import dask.config

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


def _name(subsystem: str, name: str) -> str:
    namespace = dask.config.get("distributed.dashboard.prometheus.namespace")
    return "_".join(p for p in (namespace, subsystem, name) if p)


def _spill_families(subsystem: str, labels: list[str]) -> tuple[Any, Any]:
    from prometheus_client.core import CounterMetricFamily

    nbytes = CounterMetricFamily(
        _name(subsystem, "span_spill_bytes"),
        "Bytes spilled to / unspilled from disk while tasks of the span ran",
        labels=[*labels, "direction"],
    )
    seconds = CounterMetricFamily(
        _name(subsystem, "span_spill_seconds"),
        "Seconds spent spilling to / unspilling from disk while tasks of the span ran",
        labels=[*labels, "direction"],
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
            _name("scheduler", "span_memory_bytes"),
            "Bytes held on the cluster by the keys of the span (not its children)",
            labels=["span", "span_id", "type"],
        )
        nbytes, seconds = _spill_families("scheduler", ["span", "span_id"])
        for span in list(ext.spans.values()):
            labels = [" / ".join(span.name), span.id]
            held = span.own_held
            if any(held):
                for field, value in zip(MEMORY_FIELDS, held, strict=True):
                    memory.add_metric([*labels, field], value)
            spill = span.own_spill_metrics
            if any(spill.values()):
                _add_spill(nbytes, seconds, labels, spill)
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
            _name("worker", "span_memory_bytes"),
            "Bytes held by this worker for the keys of the span",
            labels=["span_id", "type"],
        )
        for span_id, figures in by_span.items():
            for field, value in zip(MEMORY_FIELDS, figures, strict=True):
                memory.add_metric([span_id, field], value)
        yield memory
        nbytes, seconds = _spill_families("worker", ["span_id"])
        for span_id, spill in ext.cumulative_spill_by_span().items():
            _add_spill(nbytes, seconds, [span_id], spill)
        yield nbytes
        yield seconds


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
