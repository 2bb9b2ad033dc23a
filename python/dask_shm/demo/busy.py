"""Is the host busy? Other processes using CPU while the demo runs make its
timings, and so its ratios, unreliable: the two runs do not get the same
machine.

:func:`busy_warning` judges readings (pure, for tests); :func:`read_cpu_load`
takes them with psutil: the CPU that processes other than the given ones
used, in cores, over a short interval.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Collection, Sequence

import psutil

#: Other processes using more than this many cores (median of the readings)
#: make the host busy. A desktop or a shell idles far below it.
BUSY_CORES = 0.25


def busy_warning(
    readings: Sequence[float], cores: int, threshold: float = BUSY_CORES
) -> str | None:
    """A warning when other processes used more than ``threshold`` cores
    (median of ``readings``, each the cores in use by others over an
    interval) of this host's ``cores``; None when quiet or without readings."""
    if not readings:
        return None
    used = statistics.median(readings)
    if used <= threshold:
        return None
    return (
        f"the host is busy: other processes used {used:.1f} of {cores} cores "
        f"({used / max(cores, 1):.0%}) while the demo ran; its times and ratios are "
        "unreliable (run it on an idle host to compare)"
    )


def read_cpu_load(ours: Collection[int] = (), interval: float = 0.5) -> float:
    """Cores used by processes other than this one and ``ours`` (pids) over
    ``interval`` seconds: the whole host's CPU time minus ours."""
    own = {os.getpid(), *ours}

    def own_cpu() -> float:
        total = 0.0
        for pid in own:
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def host_cpu() -> float:
        t = psutil.cpu_times()
        return (
            t.user
            + t.system
            + getattr(t, "nice", 0.0)
            + getattr(t, "irq", 0.0)
            + getattr(t, "softirq", 0.0)
        )

    start_wall, start_host, start_own = time.monotonic(), host_cpu(), own_cpu()
    time.sleep(interval)
    wall = time.monotonic() - start_wall
    others = (host_cpu() - start_host) - (own_cpu() - start_own)
    return max(0.0, others / wall)


class LoadSampler:
    """A daemon thread that appends :func:`read_cpu_load` readings (other
    processes' cores, every ``interval`` seconds) to :attr:`readings` until
    stopped. ``ours`` (a set of pids) may grow while it runs."""

    def __init__(self, ours: set[int], interval: float = 1.0) -> None:
        self.ours = ours
        self.interval = interval
        self.readings: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dask-shm-demo-load", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.readings.append(read_cpu_load(set(self.ours), self.interval))
            except psutil.Error:
                pass

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
