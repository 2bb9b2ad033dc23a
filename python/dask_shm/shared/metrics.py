"""Shared-memory figures of a worker: ``shm_metrics``, the worker's
``get_metrics()`` (key ``"shm"``, which reaches the scheduler in heartbeats)
and Prometheus series ``<namespace>_shm_worker_*`` on the worker's
``/metrics`` page, named as distributed names its own (namespace from
``distributed.dashboard.prometheus.namespace``, ``dask`` by default):

- gauges ``..._shm_shared_bytes`` and ``..._shm_retained_keys``;
- counters (``_total``): ``..._shm_link_transfers_total``,
  ``..._shm_link_bytes_total``, ``..._shm_fallback_transfers_total``,
  ``..._shm_fallback_bytes_total``, ``..._shm_received_links_total``,
  ``..._shm_received_bytes_total``, ``..._shm_adopt_failures_total``,
  ``..._shm_receive_fallback_transfers_total``, ``..._shm_degraded_reads_total``,
  and for P2P shuffles and rechunks ``..._shm_p2p_file_batches_total``,
  ``..._shm_p2p_file_bytes_total`` (batches handed to same-host peers as
  files), ``..._shm_p2p_tcp_batches_total``, ``..._shm_p2p_tcp_bytes_total``
  (sent over the network, stock), ``..._shm_p2p_file_fallbacks_total``,
  and for values written out before a peer asked for them
  (:mod:`~dask_shm.shared.write_ahead`) ``..._shm_written_ahead_total`` and
  ``..._shm_written_ahead_unused_total`` (deleted without being handed over).

All carry a ``worker`` label (the worker's address): one process may hold
several workers (``LocalCluster(processes=False)``)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from dask_shm.config import prometheus_series_name

if TYPE_CHECKING:
    from distributed import Worker

    from dask_shm.shared.tiers import TieredFiles

#: Counters a shared-mode SpillBuffer keeps (``shm_counters``).
COUNTERS = (
    "link_transfers",
    "link_bytes",
    "fallback_transfers",
    "fallback_bytes",
    "received_links",
    "received_bytes",
    "adopt_failures",
    "p2p_file_batches",
    "p2p_file_bytes",
    "p2p_tcp_batches",
    "p2p_tcp_bytes",
    "p2p_file_fallbacks",
    "written_ahead",
    "written_ahead_unused",
)

_DESCRIPTIONS = {
    "memory_bytes": "Private bytes of this worker's values in memory (tier 1)",
    "shared_bytes": "Bytes of this worker's data in shared-memory files (1/k per holder)",
    "disk_bytes": "Bytes of this worker's files on a real file system (the disk tier)",
    "shared_budget": "Bytes of shared-memory files this worker keeps before moving them on",
    "disk_moves": "Files moved into the disk tier",
    # the two above under the names they had when tiers were numbered
    "tier2_budget": "Bytes of shared-memory files this worker keeps before moving them on",
    "tier3_moves": "Files moved into the disk tier",
    "pending_arrivals": "Files received from peers whose value is not stored yet",
    "retained_keys": "Keys in memory backed by a shared-memory file",
    "link_transfers": "Keys sent to same-host peers as hard-link handles",
    "link_bytes": "Bytes sent to same-host peers as hard-link handles",
    "fallback_transfers": "Keys sent to same-host shared-memory peers as bytes",
    "fallback_bytes": "Bytes sent to same-host shared-memory peers as bytes",
    "received_links": "Keys received by hard link and kept shared",
    "received_bytes": "Bytes received by hard link and kept shared",
    "adopt_failures": "Received files that could not be linked into the spill directory",
    "receive_fallback_transfers": "Handles received but read by copy",
    "degraded_reads": "Unspills read by copy because of mapping limits",
    "tcp_bytes": "Bytes of values sent to peers as bytes, not by hard link (distributed's "
    "transfer_outgoing_bytes_total less link_bytes)",
    "p2p_file_batches": "P2P shard batches handed to same-host peers as files",
    "p2p_file_bytes": "Bytes of P2P shard batches handed to same-host peers as files",
    "p2p_tcp_batches": "P2P shard batches sent over the network",
    "p2p_tcp_bytes": "Bytes of P2P shard batches sent over the network (sizeof estimate)",
    "p2p_file_fallbacks": "P2P shard batches meant to go by file but sent over the network",
    "written_ahead": "Fresh values written to shared memory before a peer asked for them",
    "written_ahead_unused": "Values written ahead and deleted without being handed to a peer",
}


def shm_metrics(dask_worker: Worker) -> dict[str, float]:
    """Shared-memory figures of a worker; all zeros when its data is not a
    shared-mode :class:`~dask_shm.SpillBuffer`. The argument's name lets
    ``client.run(shm_metrics)`` pass the worker."""
    from dask_shm.shared.buffer import SharedSpillBuffer

    out: dict[str, float] = dict.fromkeys(_DESCRIPTIONS, 0.0)
    data = dask_worker.data
    if not isinstance(data, SharedSpillBuffer):
        return out
    store = data.store
    out["memory_bytes"] = float(data.fast.total_weight)
    out.update(tier_figures(store.tiers))
    out["retained_keys"] = float(len(store.retained))
    out["degraded_reads"] = float(store.degraded_reads)
    for name in COUNTERS:
        out[name] = float(data.shm_counters[name])
    out["receive_fallback_transfers"] = float(data.shm_counters["receive_fallback_transfers"])
    out["pending_arrivals"] = float(data.pending_arrivals())
    # distributed counts every value get_data sends, links included, by its
    # nbytes; a link's file size may differ a little from that.
    sent = float(getattr(dask_worker, "transfer_outgoing_bytes_total", 0))
    out["tcp_bytes"] = max(sent - out["link_bytes"], 0.0)
    return out


#: Figures once named by tier number -> the figure they copy, named after
#: the tier: they keep meaning the shared-memory tier's budget and the moves
#: into the disk tier wherever those tiers are in the list.
NUMBERED_NAMES = {"tier2_budget": "shared_budget", "tier3_moves": "disk_moves"}


def tier_figures(files: TieredFiles) -> dict[str, float]:
    """Per file tier, named after it (:attr:`~dask_shm.shared.tiers.TierSpec.name`,
    so that inserting a tier renames no other tier's figures):
    ``<name>_tier`` (its number, 2 for the first file tier: what tells
    readers, see :func:`file_tiers`, which tiers there are and in which
    order), ``<name>_bytes`` (its files' bytes that count for this worker,
    1/k of a file with k links), ``<name>_budget`` for a tier with a budget
    and ``<name>_moves`` (files moved into it) for every tier after the
    first; plus :data:`NUMBERED_NAMES`."""
    out = {}
    for index, tier in enumerate(files.tiers):
        out[f"{tier.name}_tier"] = float(tier.number)
        out[f"{tier.name}_bytes"] = float(tier.store.total()[1])
        if tier.budget is not None:
            out[f"{tier.name}_budget"] = float(tier.budget.limit)
        if index > 0:
            out[f"{tier.name}_moves"] = float(files.moved_in[tier.name])
    out.update({old: out[new] for old, new in NUMBERED_NAMES.items() if new in out})
    return out


@dataclass(frozen=True)
class TierFigures:
    """One file tier's figures, as a worker publishes them (:func:`tier_figures`)."""

    name: str
    #: its place: 2 for the first file tier (tier 1 is private memory)
    number: int
    bytes: int
    #: None: the tier has no budget (the last one)
    budget: int | None = None
    #: files moved into it; None for the first file tier
    moves: int | None = None


def file_tiers(figures: Mapping[str, float]) -> list[TierFigures]:
    """The file tiers in a worker's ``figures`` (:func:`shm_metrics`, or what
    its heartbeats sent), fastest first: what ``dask shm info`` and the
    dashboard show, whatever the tiers are."""
    found = []
    for key, number in figures.items():
        if not key.endswith("_tier"):
            continue
        name = key.removesuffix("_tier")
        budget, moves = (figures.get(f"{name}_{what}") for what in ("budget", "moves"))
        found.append(
            TierFigures(
                name,
                int(number),
                int(figures.get(f"{name}_bytes", 0)),
                None if budget is None else int(budget),
                None if moves is None else int(moves),
            )
        )
    return sorted(found, key=lambda tier: tier.number)


_workers: weakref.WeakSet[Worker] = weakref.WeakSet()
_registered = False
_lock = threading.Lock()


class Series(NamedTuple):
    """How one figure of :func:`shm_metrics` is exported to Prometheus."""

    #: Name after ``<namespace>_shm_worker_``, without the unit and ``_total``.
    name: str
    kind: Literal["gauge", "counter"]
    #: Unit suffix as distributed uses them ("bytes", "seconds") or "".
    unit: str


#: Figure of :func:`shm_metrics` -> its Prometheus series.
SERIES: dict[str, Series] = {
    "shared_bytes": Series("shared", "gauge", "bytes"),
    "retained_keys": Series("retained_keys", "gauge", ""),
    "link_transfers": Series("link_transfers", "counter", ""),
    "link_bytes": Series("link", "counter", "bytes"),
    "fallback_transfers": Series("fallback_transfers", "counter", ""),
    "fallback_bytes": Series("fallback", "counter", "bytes"),
    "received_links": Series("received_links", "counter", ""),
    "received_bytes": Series("received", "counter", "bytes"),
    "adopt_failures": Series("adopt_failures", "counter", ""),
    "receive_fallback_transfers": Series("receive_fallback_transfers", "counter", ""),
    "degraded_reads": Series("degraded_reads", "counter", ""),
    "p2p_file_batches": Series("p2p_file_batches", "counter", ""),
    "p2p_file_bytes": Series("p2p_file", "counter", "bytes"),
    "p2p_tcp_batches": Series("p2p_tcp_batches", "counter", ""),
    "p2p_tcp_bytes": Series("p2p_tcp", "counter", "bytes"),
    "p2p_file_fallbacks": Series("p2p_file_fallbacks", "counter", ""),
    "written_ahead": Series("written_ahead", "counter", ""),
    "written_ahead_unused": Series("written_ahead_unused", "counter", ""),
}


def metric_name(series: Series) -> str:
    """``<namespace>_shm_worker_<name>`` (see
    :func:`~dask_shm.config.prometheus_series_name`)."""
    return prometheus_series_name("worker", series.name)


class _Collector:
    """Prometheus collector over the shared-memory workers of this process."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        figures = {w.address: shm_metrics(w) for w in list(_workers)}
        for figure, series in SERIES.items():
            family_type = CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily
            family = family_type(
                metric_name(series), _DESCRIPTIONS[figure], labels=["worker"], unit=series.unit
            )
            for address, values in figures.items():
                family.add_metric([address], values[figure])
            yield family


def install(worker: Worker) -> None:
    """Publish ``worker``'s figures in ``get_metrics()`` and Prometheus."""
    global _registered
    worker.metrics["shm"] = shm_metrics
    _workers.add(worker)
    with _lock:
        if _registered:
            return
        try:
            import prometheus_client
        except ImportError:
            return
        prometheus_client.REGISTRY.register(_Collector())  # type: ignore[arg-type]
        _registered = True


def uninstall(worker: Worker) -> None:
    worker.metrics.pop("shm", None)
    _workers.discard(worker)
