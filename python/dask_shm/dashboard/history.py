"""Every worker's shared-memory figures over time, kept on the scheduler.

The figures come from the workers' heartbeats: ``metrics["memory"]`` (the
process memory distributed measures; in shared-memory mode, private memory:
shared pages are left out) and ``metrics["shm"]``
(:func:`dask_shm.shared.metrics.shm_metrics`). :class:`ShmHistory` samples
them every ``interval`` seconds and keeps the last ``length`` samples of each
worker, so a page opened late still shows the recent past.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from dask_shm.shared.metrics import TierFigures, file_tiers

if TYPE_CHECKING:
    from distributed import Scheduler


class Sample(NamedTuple):
    """One worker's figures at one time (bytes; ``time`` in seconds since
    the epoch)."""

    time: float
    #: Process memory without shared pages (heartbeat ``memory``).
    private: float
    #: Private bytes of values in memory (tier 1).
    tier1: float
    #: Bytes sent to peers by hard link, and as bytes (TCP), since start.
    link: float
    tcp: float
    #: The worker's file tiers, fastest first (by default ``shared``, tier 2,
    #: the shared-memory files on the tmpfs, then ``disk``, tier 3): bytes,
    #: budget; none for a worker not in shared-memory mode.
    files: tuple[TierFigures, ...] = ()

    def figures(self) -> dict[str, float]:
        """The sample as the page's columns: ``private``, ``tier1``,
        ``tier<n>`` and ``tier<n>_budget`` of each file tier (the latter
        if it has a budget), ``link``, ``tcp``."""
        out = {"private": self.private, "tier1": self.tier1}
        for tier in self.files:
            out[f"tier{tier.number}"] = float(tier.bytes)
            if tier.budget is not None:
                out[f"tier{tier.number}_budget"] = float(tier.budget)
        out["link"], out["tcp"] = self.link, self.tcp
        return out


#: Sample field -> key of ``metrics["shm"]`` it comes from (the file tiers
#: are read by :func:`~dask_shm.shared.metrics.file_tiers`).
_SHM_KEYS = {"tier1": "memory_bytes", "link": "link_bytes", "tcp": "tcp_bytes"}


def sample_of(metrics: Mapping[str, Any], now: float) -> Sample:
    """The :class:`Sample` of a worker's last heartbeat ``metrics``; zeros
    for figures it does not carry (a worker not in shared-memory mode)."""
    shm = metrics.get("shm") or {}
    figures = {field: float(shm.get(key, 0.0)) for field, key in _SHM_KEYS.items()}
    return Sample(
        time=now,
        private=float(metrics.get("memory", 0.0)),
        files=tuple(file_tiers(shm)),
        **figures,
    )


class ShmHistory:
    """The last ``length`` samples of every worker of ``scheduler``, taken
    by :meth:`sample` (the dashboard page calls it every ``interval``
    seconds through a periodic callback of the scheduler). A worker that
    leaves the scheduler leaves the history at the next sample."""

    def __init__(self, scheduler: Scheduler, *, interval: float = 1.0, length: int = 600):
        if interval <= 0 or length < 1:
            raise ValueError(f"interval must be > 0 and length >= 1, not {interval}, {length}")
        self.scheduler = scheduler
        self.interval = interval
        self.length = length
        self._samples: dict[str, deque[Sample]] = {}

    def sample(self, now: float | None = None) -> None:
        """Record every worker's figures as of its last heartbeat."""
        now = time.time() if now is None else now
        workers = self.scheduler.workers
        for address in list(self._samples):
            if address not in workers:
                del self._samples[address]
        for address, ws in workers.items():
            series = self._samples.get(address)
            if series is None:
                series = self._samples[address] = deque(maxlen=self.length)
            series.append(sample_of(ws.metrics, now))

    def samples(self) -> dict[str, list[Sample]]:
        """Samples by worker address, oldest first, workers sorted."""
        return {address: list(self._samples[address]) for address in sorted(self._samples)}
