"""What the scheduler knows about each worker's memory, sampled over time.

Host memory and per-process memory come from :class:`dask_shm.procmem.MemorySampler`
(a background thread reading ``/proc``); this module adds the Dask view: each
worker's managed, unmanaged and spilled bytes as the scheduler sees them
(``WorkerState.memory``, refreshed by the workers' heartbeats).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from distributed.utils import sync
from tornado.ioloop import IOLoop, PeriodicCallback

if TYPE_CHECKING:
    from distributed import Scheduler


@dataclass
class WorkerSeries:
    """One worker's memory over time, as the scheduler saw it (bytes)."""

    times: list[float] = field(default_factory=list)
    #: Bytes of the worker's data held in its process memory (``sizeof``).
    managed: list[int] = field(default_factory=list)
    #: Process memory minus managed: interpreter, libraries, temporaries,
    #: fragmentation.
    unmanaged: list[int] = field(default_factory=list)
    #: Bytes of the worker's data in spill files: on disk for stock; in
    #: dask-shm's shared-memory mode on the tmpfs (tier 2) or, beyond its
    #: budget, on disk (tier 3).
    spilled: list[int] = field(default_factory=list)
    #: Of ``spilled``, the bytes in shared-memory files (tier 2, host RAM;
    #: the worker's ``shm.shared_bytes`` metric); 0 for stock.
    shared: list[int] = field(default_factory=list)

    @property
    def on_disk(self) -> list[int]:
        """Of ``spilled``, the bytes on disk (stock's spill, dask-shm's tier 3)."""
        return [s - t for s, t in zip(self.spilled, self.shared, strict=True)]


class ClusterMemorySampler:
    """Every ``interval`` seconds, records ``ws.memory`` of every worker of an
    in-process ``scheduler`` (a LocalCluster's), from a periodic callback on
    the scheduler's own event loop, so it reads a consistent state and costs
    no round trip.

    Times are seconds since ``t0`` (a :func:`time.monotonic` reading), so they
    line up with a :class:`~dask_shm.procmem.MemorySampler` started at ``t0``.
    """

    def __init__(
        self, scheduler: Scheduler, loop: IOLoop, t0: float, interval: float = 0.25
    ) -> None:
        self.scheduler = scheduler
        self.loop = loop
        self.t0 = t0
        self.interval = interval
        #: Worker name (as a string) -> its series.
        self.workers: dict[str, WorkerSeries] = {}
        #: Largest sum over workers of spilled bytes seen in one sample, and
        #: of those bytes the ones in shared-memory files (the workers'
        #: ``shm.shared_bytes`` heartbeat metric) and the others (on disk).
        self.peak_spilled = 0
        self.peak_shared = 0
        self.peak_disk_spilled = 0
        self._callback: PeriodicCallback | None = None

    def sample(self) -> None:
        """Take one sample (must run on the scheduler's event loop)."""
        now = time.monotonic() - self.t0
        total_spilled = total_shared = 0
        for ws in list(self.scheduler.workers.values()):
            memory = ws.memory
            series = self.workers.setdefault(str(ws.name), WorkerSeries())
            series.times.append(now)
            series.managed.append(memory.managed)
            series.unmanaged.append(memory.unmanaged)
            series.spilled.append(memory.spilled)
            total_spilled += memory.spilled
            shm = ws.metrics.get("shm")
            # From the same heartbeat as ws.memory; never more than spilled.
            shared = (
                min(memory.spilled, int(shm.get("shared_bytes", 0))) if isinstance(shm, dict) else 0
            )
            series.shared.append(shared)
            total_shared += shared
        self.peak_spilled = max(self.peak_spilled, total_spilled)
        self.peak_shared = max(self.peak_shared, total_shared)
        self.peak_disk_spilled = max(self.peak_disk_spilled, total_spilled - total_shared)

    async def _start(self) -> None:
        self.sample()
        self._callback = PeriodicCallback(self.sample, self.interval * 1000)
        self._callback.start()

    async def _stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None
        self.sample()

    def start(self) -> ClusterMemorySampler:
        """Take a first sample and start sampling (call from outside the loop)."""
        sync(self.loop, self._start)
        return self

    def stop(self) -> None:
        """Stop sampling after a last sample (call from outside the loop)."""
        sync(self.loop, self._stop)

    def __enter__(self) -> ClusterMemorySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
