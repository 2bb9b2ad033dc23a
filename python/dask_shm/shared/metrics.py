"""Shared-memory figures of a worker: ``shm_metrics``, the worker's
``get_metrics()`` (key ``"shm"``, which reaches the scheduler in heartbeats)
and Prometheus gauges ``dask_worker_shm_*``."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Worker

#: Counters a shared-mode SpillBuffer keeps (``shm_counters``).
COUNTERS = (
    "link_transfers",
    "link_bytes",
    "fallback_transfers",
    "fallback_bytes",
    "received_links",
    "received_bytes",
    "adopt_failures",
)

_DESCRIPTIONS = {
    "shared_bytes": "Bytes of this worker's data in shared-memory files (1/k per holder)",
    "disk_bytes": "Bytes of this worker's files in tier 3 (a real file system)",
    "tier2_budget": "Bytes of shared-memory files this worker keeps before moving to disk",
    "tier3_moves": "Files moved from shared memory to disk (tier 3)",
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
    out["shared_bytes"] = float(data.tier2_bytes())
    out["disk_bytes"] = float(store.tiers.disk.total()[1])
    out["tier2_budget"] = float(store.tiers.budget.limit)
    out["tier3_moves"] = float(store.tiers.moves)
    out["retained_keys"] = float(len(store.retained))
    out["degraded_reads"] = float(store.degraded_reads)
    for name in COUNTERS:
        out[name] = float(data.shm_counters[name])
    out["receive_fallback_transfers"] = float(data.shm_counters["receive_fallback_transfers"])
    out["pending_arrivals"] = float(data.pending_arrivals())
    return out


_workers: weakref.WeakSet[Worker] = weakref.WeakSet()
_registered = False
_lock = threading.Lock()


class _Collector:
    """Prometheus collector over the shared-memory workers of this process."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        figures = {w.address: shm_metrics(w) for w in list(_workers)}
        for name, doc in _DESCRIPTIONS.items():
            family = GaugeMetricFamily(f"dask_worker_shm_{name}", doc, labels=["worker"])
            for address, values in figures.items():
                family.add_metric([address], values[name])
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
