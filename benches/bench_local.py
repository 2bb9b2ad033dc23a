"""dask's local process-pool scheduler vs ``dask_shm.get`` vs Ray's dask
scheduler, side by side in one run.

Run: ``pytest benches/bench_local.py`` (median time ratios are printed at the
end by benches/conftest.py; best-of-3 times, their ratios to stock and to Ray,
and peak memory ratios by this module).

``impl`` is "stock" for the stock scheduler the group compares against
(``scheduler="processes"``, or ``"threads"`` for the GIL-bound group), "ours"
for ``dask_shm.get`` with its warm pool, "ours-cold" for ``dask_shm.get(...,
warm=False)`` (a pool per computation, as stock), and "ray" for
``ray.util.dask.ray_dask_get`` (Ray started once for the module with
``num_cpus=2`` and a 2 GB object store for each of its tests, shut down
after it; the rows are
skipped with a message when ``ray`` is not installed: ``pip install ray``).
Schedulers that keep their processes ("ours", "ray") get one untimed warm-up
round, as Ray's ``ray.init`` is done beforehand; the others create their pool
in every round, as a real ``compute`` call does.

Peak memory is measured in one extra, untimed run: the largest value, sampled
every 20 ms, of: the proportional set size (PSS) of this process and all its
children, excluding their shared-memory pages, plus the growth of the host's
shared memory (``Shmem`` in /proc/meminfo) since the start, minus that same
measure just before the run (so what earlier benchmarks left in this process's
heap does not count; the pool processes, created by the run, count in full).
Shared-memory files and mappings are therefore counted once, wherever mapped.
The files ``dask_shm.get``'s warm pool keeps between computations
(``shm.local.idle-file-timeout``) are released before that run, so it
allocates all of its files anew and they count in full; the timed rounds, run
back to back, overwrite the files the previous round left, as a user's loop of
computations would.
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

from dask_shm.local import get, release_idle_files, shutdown_pool

pytestmark = pytest.mark.timeout(1800)  # minutes per row on a busy 2-core host

WORKERS = 2
N = 6000  # 6000 x 6000 float64: 288 MB
CHUNK = 1500  # 1500 x 1500 float64: 18 MB
ROUNDS = 3

try:
    import ray
    from ray.util.dask import ray_dask_get
except ImportError:  # the optional bench extra
    ray = None
    ray_dask_get = None


def _cold(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    return get(dsk, keys, warm=False, **kwargs)


SCHEDULERS: dict[str, Any] = {
    "ours": get,
    "ours-cold": _cold,
    "ray": ray_dask_get,
    "processes": "processes",
    "threads": "threads",
    "sync": "sync",
}
WARM = {"ours", "ray"}


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
BEST: dict[str, dict[str, float]] = {}


class _MemoryReport:
    """pytest plugin printing the peak memory table at the end of the run."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if BEST:
            terminalreporter.write_sep("=", f"dask_shm.get: best of {ROUNDS} (wall time)")
            for group, by_impl in sorted(BEST.items()):
                stock, ray_best = by_impl.get("stock"), by_impl.get("ray")
                for impl, best in sorted(by_impl.items()):
                    vs_stock = f"{stock / best:6.2f}x faster than stock" if stock else ""
                    vs_ray = f"{ray_best / best:6.2f}x Ray's speed" if ray_best else ""
                    terminalreporter.write_line(
                        f"{group:<40} {impl:<10} {best:8.2f} s  {vs_stock}  {vs_ray}"
                    )
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


@pytest.fixture
def ray_cluster() -> Any:
    """Ray with 2 CPUs and a small object store (the host is shared), for one
    test, so that its processes do not run beside the other rows; None when
    ray is not installed."""
    if ray is None:
        yield None
        return
    ray.init(
        num_cpus=WORKERS,
        object_store_memory=int(2e9),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_warm_pool_left() -> Any:
    yield
    shutdown_pool()


def scheduler_for(impl: str, request: pytest.FixtureRequest) -> Any:
    if impl == "ray":
        if request.getfixturevalue("ray_cluster") is None:
            pytest.skip("ray is not installed (pip install ray): no Ray rows")
    return SCHEDULERS[impl]


def run(benchmark: Any, group: str, impl: str, scheduler: Any, make: Callable[[], Any]) -> Any:
    """Time ``dask.compute(make(), scheduler=...)`` (best of ``ROUNDS``), then
    measure its peak memory in one more, untimed, run (sampling costs CPU on a
    small host)."""
    benchmark.group = group

    def once() -> Any:
        (result,) = dask.compute(make(), scheduler=scheduler, num_workers=WORKERS)
        return result

    warmup = 1 if impl in WARM else 0
    benchmark.pedantic(once, rounds=ROUNDS, iterations=1, warmup_rounds=warmup)
    BEST.setdefault(group, {})[impl] = benchmark.stats.stats.min
    # Files the warm pool keeps for the next computation would be in the
    # baseline: let them go, so that the run allocates all its files anew.
    release_idle_files()
    with PeakMemory() as mem:
        result = once()
    benchmark.extra_info["peak_memory_bytes"] = mem.peak
    PEAKS.setdefault(group, {})[impl] = mem.peak
    return result


def base_array() -> da.Array:
    return da.random.RandomState(0).random((N, N), chunks=(CHUNK, CHUNK))


def all_to_all() -> da.Array:
    """``(y @ y.T).sum(0)`` with ``y = (x + x.T) * 2``: every output block
    needs every block of a row and of a column of ``y``."""
    x = base_array()
    y = (x + x.T) * 2
    return (y @ y.T).sum(0)


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


@pytest.mark.parametrize("impl", ["stock", "ours", "ours-cold", "ray", "threads"])
def test_all_to_all_matmul(benchmark: Any, impl: str, request: pytest.FixtureRequest) -> None:
    scheduler = scheduler_for("processes" if impl == "stock" else impl, request)
    result = run(benchmark, "(y @ y.T).sum(0) 288MB/18MB chunks", impl, scheduler, all_to_all)
    _check("all_to_all", all_to_all, result)


def test_all_to_all_matmul_compute_floor(benchmark: Any) -> None:
    """The matmul graph on the synchronous scheduler, in this process, with
    one BLAS thread: the work itself with no transport and no parallelism.
    Half of it is the least two processes could take; a scheduler cannot be
    more than stock's time over that faster than stock."""
    threadpoolctl = pytest.importorskip(
        "threadpoolctl", reason="pip install threadpoolctl: no compute-floor row"
    )
    benchmark.group = "(y @ y.T).sum(0): compute floor (sync, 1 BLAS thread)"

    def once() -> Any:
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            return dask.compute(all_to_all(), scheduler="sync")[0]

    result = benchmark.pedantic(once, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    _check("all_to_all", all_to_all, result)
    best = benchmark.stats.stats.min
    BEST.setdefault(benchmark.group, {})["sync"] = best
    BEST[benchmark.group]["sync / 2"] = best / 2


@pytest.mark.parametrize("impl", ["stock", "ours", "ray", "threads"])
def test_numpy_heavy(benchmark: Any, impl: str, request: pytest.FixtureRequest) -> None:
    scheduler = scheduler_for("processes" if impl == "stock" else impl, request)
    result = run(benchmark, "numpy-heavy 288MB/18MB chunks", impl, scheduler, numpy_heavy)
    _check("numpy_heavy", numpy_heavy, result)


@pytest.mark.parametrize("impl", ["stock", "ours", "processes"])
def test_gil_bound_python_vs_threads(
    benchmark: Any, impl: str, request: pytest.FixtureRequest
) -> None:
    scheduler = scheduler_for("threads" if impl == "stock" else impl, request)
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


# --- starting: what a pool process imports, and a pool's first task -----------

_IMPORTS = {
    # What a pool process of scheduler="processes" imports to run a task, and
    # what one of dask_shm.get imports (dask_shm's package face included).
    "stock": "import dask.multiprocessing",
    "ours": "import dask.multiprocessing, dask_shm.local.transport",
    "dask_shm": "import dask_shm",
}


@pytest.mark.parametrize("impl", sorted(_IMPORTS))
def test_pool_process_imports(benchmark: Any, impl: str) -> None:
    """A fresh interpreter importing what a pool process needs (interpreter
    start included)."""
    import subprocess
    import sys

    benchmark.group = "pool process: fresh interpreter + imports"
    cmd = [sys.executable, "-c", _IMPORTS[impl]]
    benchmark.pedantic(
        lambda: subprocess.run(cmd, check=True), rounds=5, iterations=1, warmup_rounds=1
    )
    BEST.setdefault(benchmark.group, {})[impl] = benchmark.stats.stats.min


def _one_task() -> Any:
    return dask.delayed(sum)([1, 2, 3])


@pytest.mark.parametrize("impl", ["stock", "ours", "ours-cold"])
def test_one_small_task(benchmark: Any, impl: str) -> None:
    """``compute`` of one tiny task: a pool start for "stock" and "ours-cold",
    a round trip to the warm pool for "ours"."""
    scheduler = SCHEDULERS["processes" if impl == "stock" else impl]
    benchmark.group = "one small task (pool start unless warm)"

    def once() -> Any:
        return dask.compute(_one_task(), scheduler=scheduler, num_workers=WORKERS)[0]

    assert benchmark.pedantic(once, rounds=5, iterations=1, warmup_rounds=1) == 6
    BEST.setdefault(benchmark.group, {})[impl] = benchmark.stats.stats.min
