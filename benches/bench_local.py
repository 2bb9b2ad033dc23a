"""dask's local process-pool scheduler vs ``dask_shm.get``, side by side in one run.

Run: ``pytest benches/bench_local.py`` (time ratios are printed at the end by
benches/conftest.py; peak memory ratios by this module).

``impl`` is "stock" for the stock scheduler the group compares against
(``scheduler="processes"``, or ``"threads"`` for the GIL-bound group) and
"ours" for ``dask_shm.get``; other stock schedulers run as extra rows for
context. Every round creates its pool, as a real ``compute`` call does.

Peak memory is measured in one extra, untimed run: the largest value, sampled
every 20 ms, of: the proportional set size (PSS) of this process and all its
children, excluding their shared-memory pages, plus the growth of the host's
shared memory (``Shmem`` in /proc/meminfo) since the start, minus that same
measure just before the run (so what earlier benchmarks left in this process's
heap does not count; the pool processes, created by the run, count in full).
Shared-memory files and mappings are therefore counted once, wherever mapped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import dask.bag as db
import numpy as np
import psutil
import pytest

from dask_shm.local import get

WORKERS = 2
N = 6144  # 6144 x 6144 float64: 302 MB
CHUNK = 1536  # 1536 x 1536 float64: 18.9 MB

SCHEDULERS: dict[str, Any] = {
    "ours": get,
    "processes": "processes",
    "threads": "threads",
    "sync": "sync",
}


def _meminfo_shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def _pss_without_shmem(proc: psutil.Process) -> int:
    fields = {}
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:  # the process exited meanwhile
        return 0
    return fields.get("Pss", 0) - fields.get("Pss_Shmem", 0)


class PeakMemory:
    """Samples the process tree and host shared memory in a thread; ``peak``
    is the largest growth over the value measured on entering."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._me = psutil.Process()
        self._shmem0 = _meminfo_shmem()

    def sample(self) -> int:
        procs = [self._me, *self._me.children(recursive=True)]
        tree = sum(_pss_without_shmem(p) for p in procs)
        return tree + max(0, _meminfo_shmem() - self._shmem0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample() - self.baseline)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self.baseline = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


PEAKS: dict[str, dict[str, int]] = {}


class _MemoryReport:
    """pytest plugin printing the peak memory table at the end of the run."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not PEAKS:
            return
        terminalreporter.write_sep(
            "=", "dask_shm.get: peak memory growth (process tree PSS + host Shmem)"
        )
        for group, by_impl in sorted(PEAKS.items()):
            stock = by_impl.get("stock")
            for impl, peak in sorted(by_impl.items()):
                ratio = f"{peak / stock:6.2f}x stock" if stock and stock > 2**20 else ""
                terminalreporter.write_line(
                    f"{group:<40} {impl:<10} {peak / 2**20:9.0f} MiB  {ratio}"
                )


@pytest.fixture(scope="module", autouse=True)
def memory_report(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("dask-shm-local-memory"):
        manager.register(_MemoryReport(), "dask-shm-local-memory")


def run(benchmark: Any, group: str, impl: str, scheduler: Any, make: Callable[[], Any]) -> Any:
    """Time ``dask.compute(make(), scheduler=...)``, then measure its peak
    memory in one more, untimed, run (sampling costs CPU on a small host)."""
    benchmark.group = group

    def once() -> Any:
        (result,) = dask.compute(make(), scheduler=scheduler, num_workers=WORKERS)
        return result

    benchmark.pedantic(once, rounds=3, iterations=1, warmup_rounds=0)
    with PeakMemory() as mem:
        result = once()
    benchmark.extra_info["peak_memory_bytes"] = mem.peak
    PEAKS.setdefault(group, {})[impl] = mem.peak
    return result


def base_array() -> da.Array:
    return da.random.RandomState(0).random((N, N), chunks=(CHUNK, CHUNK))


def all_to_all() -> da.Array:
    """Every output chunk needs a chunk from every row and column of blocks."""
    x = base_array()
    return (x + x.T).mean(axis=0)


def numpy_heavy() -> da.Array:
    """Elementwise work and reductions where big chunks move between tasks:
    the centred, rechunked (all-to-all) array is reduced along both axes."""
    x = base_array()
    y = da.sqrt(x) * 2 + x.T
    z = (y - y.mean(axis=0)).rechunk((N, CHUNK // 4))
    return (z**2).sum(axis=0) + z.std(axis=0)


def python_heavy() -> db.Bag:
    """GIL-bound: pure-Python loops on small inputs."""

    def spin(i: int) -> int:
        total = 0
        for j in range(6_000_000):
            total += (i * j) % 7
        return total

    return db.from_sequence(range(16), npartitions=16).map(spin).sum()


_EXPECTED: dict[str, Any] = {}


def _check(name: str, make: Callable[[], Any], result: Any) -> None:
    if name not in _EXPECTED:
        (_EXPECTED[name],) = dask.compute(make(), scheduler="threads")
    np.testing.assert_allclose(result, _EXPECTED[name], rtol=1e-9)


@pytest.mark.parametrize("impl", ["stock", "ours", "threads"])
def test_all_to_all_array(benchmark: Any, impl: str) -> None:
    scheduler = SCHEDULERS["processes" if impl == "stock" else impl]
    result = run(benchmark, "all-to-all 302MB/19MB chunks", impl, scheduler, all_to_all)
    _check("all_to_all", all_to_all, result)


@pytest.mark.parametrize("impl", ["stock", "ours", "threads"])
def test_numpy_heavy(benchmark: Any, impl: str) -> None:
    scheduler = SCHEDULERS["processes" if impl == "stock" else impl]
    result = run(benchmark, "numpy-heavy 302MB/19MB chunks", impl, scheduler, numpy_heavy)
    _check("numpy_heavy", numpy_heavy, result)


@pytest.mark.parametrize("impl", ["stock", "ours", "processes"])
def test_gil_bound_python_vs_threads(benchmark: Any, impl: str) -> None:
    scheduler = SCHEDULERS["threads" if impl == "stock" else impl]
    result = run(benchmark, "GIL-bound python (stock=threads)", impl, scheduler, python_heavy)
    _check("python_heavy", python_heavy, result)


def test_peak_memory_sampler_sees_shared_memory() -> None:
    """Sanity check of the memory metric: a 64 MiB shared-memory file counts."""
    import os
    import tempfile

    with PeakMemory() as mem:
        assert mem.baseline > 10 * 2**20  # this Python process alone
        fd, path = tempfile.mkstemp(dir="/dev/shm")
        try:
            os.write(fd, b"\1" * 64 * 2**20)
            time.sleep(0.1)
        finally:
            os.close(fd)
            os.unlink(path)
    assert mem.peak >= 60 * 2**20  # minus whatever this process freed meanwhile
