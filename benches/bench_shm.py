"""Shared-memory mode on a LocalCluster: stock distributed vs dask-shm, in one run.

Run: ``pytest benches/bench_shm.py`` (time ratios, and ours/stock ratios of the
memory figures recorded in ``extra_info``, are printed at the end by
benches/conftest.py).

- ``test_demo_workload``: ``dask-shm demo``'s workload at the size of issue #3,
  ``(x @ x.T).sum()`` with x 2 GiB of random floats in 64 MiB row blocks, on
  2 and on 4 worker processes x 1 thread x 4 GiB (stock reference with 2
  workers: host memory +4.0 GiB at peak, 57 s). Run once each; the time is
  the computation's (submit to result), not the cluster's start.
- ``test_transfer``: one 1 GiB numpy array computed on worker A, then needed
  by a task on worker B on the same host. Times the transfer (submit of B's
  task to its result) and records the host memory increase at its peak
  (largest over the rounds) and right after it (median), and how much B's
  private memory grew. ``ours`` starts from a value in A's private memory,
  so the transfer includes copying it into shared memory once;
  ``ours-preshared`` starts from a value already in a shared file (A spilled
  it, received it from a peer, or runs with target 0), so only a link moves.

Memory figures (``extra_info``): ``host_peak_increase_bytes`` is the peak of
``MemTotal - MemAvailable`` minus its value at the start (before the cluster
for the workload, after A holds the array for the transfer), so it counts a
shared page once; ``worker_peak_private_bytes`` is the largest private memory
(RSS without shared pages) of any worker process. On a busy host the host
figure includes what other programs allocated meanwhile.

``DASK_SHM_BENCH_SCALE`` (default 1) multiplies every size (arrays, chunks and
memory limits, the latter at least 512 MiB), e.g. ``DASK_SHM_BENCH_SCALE=0.05``
for a smoke run of a few seconds per test.
"""

from __future__ import annotations

import logging
import operator
import os
import sys
from typing import Any

import numpy as np
import pytest
from distributed import wait

from dask_shm.demo import DemoConfig, DemoRun
from dask_shm.demo.runner import CLUSTER_CONFIG, shared_memory_plugin
from dask_shm.demo.table import results_match
from dask_shm.procmem import MemorySampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from clusters import process_cluster  # noqa: E402

GiB = 2**30
MiB = 2**20
#: The demo's cluster config with distributed's default Active Memory Manager
#: (process_cluster turns it off unless told), as ``DemoRun``'s clusters have it.
BENCH_CONFIG = {**CLUSTER_CONFIG, "distributed.scheduler.active-memory-manager.start": True}


def _scale() -> float:
    text = os.environ.get("DASK_SHM_BENCH_SCALE", "1")
    try:
        scale = float(text)
    except ValueError:
        scale = float("nan")
    if not scale > 0:
        raise ValueError(f"DASK_SHM_BENCH_SCALE must be a positive number; got {text!r}")
    return scale


SCALE = _scale()


def scaled(nbytes: int, minimum: int = 1) -> int:
    return max(minimum, int(nbytes * SCALE))


#: Issue #3: x 2 GiB in 64 MiB chunks, workers x 1 thread x 4 GiB each.
DEMO_SIZE = scaled(2 * GiB)
DEMO_CHUNK = scaled(64 * MiB)
MEMORY_LIMIT = scaled(4 * GiB, minimum=512 * MiB)
TRANSFER_BYTES = scaled(GiB)

#: Results of the workload per number of workers and impl, to check that
#: stock and ours agree.
RESULTS: dict[int, dict[str, float]] = {}


@pytest.mark.parametrize("impl", ["stock", "ours"])
@pytest.mark.parametrize("workers", [2, 4])
def test_demo_workload(benchmark: Any, impl: str, workers: int) -> None:
    benchmark.group = "demo: (x @ x.T).sum()"
    config = DemoConfig(
        size=DEMO_SIZE,
        chunk=DEMO_CHUNK,
        workers=workers,
        threads=1,
        memory_limit=MEMORY_LIMIT,
    )
    with DemoRun(config, ours=impl == "ours", show_progress=False) as run:
        benchmark.pedantic(run.compute, rounds=1, iterations=1)
    result = run.result()
    benchmark.extra_info.update(
        {
            "config": config.describe(),
            "wall_seconds": result.wall_seconds,
            "host_peak_increase_bytes": result.host_peak_increase,
            "worker_peak_private_bytes": result.worker_peak_private,
            "spilled_peak_bytes": result.spilled_peak,
            "tcp_transfer_bytes": result.tcp_bytes,
            "link_transfer_bytes": result.link_bytes,
            "result": result.result,
        }
    )
    RESULTS.setdefault(workers, {})[impl] = result.result
    others = [v for k, v in RESULTS[workers].items() if k != impl]
    for other in others:
        assert results_match(result.result, other), (result.result, other)


def _make_array(nbytes: int) -> np.ndarray:
    """A fresh array of random floats (incompressible, every page touched)."""
    return np.random.default_rng(0).random(nbytes // 8)


def _spill_everything(dask_worker: Any) -> None:
    while dask_worker.data.fast:
        dask_worker.data.evict()


@pytest.mark.parametrize("impl", ["stock", "ours", "ours-preshared"])
def test_transfer(benchmark: Any, impl: str) -> None:
    benchmark.group = f"transfer one {TRANSFER_BYTES / GiB:.3g} GiB array, worker A -> B"
    pids: set[int] = set()
    peaks: list[int] = []
    after: list[int] = []
    b_private: list[int] = []
    with process_cluster(
        2,
        max(MEMORY_LIMIT, 3 * TRANSFER_BYTES),
        BENCH_CONFIG,
        silence_logs=logging.ERROR,
    ) as client:
        if impl.startswith("ours"):
            client.register_plugin(shared_memory_plugin())
        worker_pids = client.run(os.getpid)
        a, b = sorted(worker_pids)
        pids.update(worker_pids.values())

        def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
            on_a = client.submit(_make_array, TRANSFER_BYTES, workers=[a], pure=False)
            wait(on_a)
            if impl == "ours-preshared":
                client.run(_spill_everything, workers=[a])
            sampler = MemorySampler(pids, interval=0.02).start()
            return (on_a, sampler), {}

        def transfer(on_a: Any, sampler: MemorySampler) -> None:
            on_b = client.submit(operator.getitem, on_a, 0, workers=[b], pure=False)
            on_b.result()

        def teardown(on_a: Any, sampler: MemorySampler) -> None:
            sampler.stop()
            peaks.append(sampler.peak_host_increase())
            after.append(sampler.samples[-1].host_used - (sampler.baseline or 0))
            b_private.append(
                max(s.processes[worker_pids[b]].private for s in sampler.samples)
                - sampler.samples[0].processes[worker_pids[b]].private
            )
            client.cancel([on_a])

        benchmark.pedantic(transfer, setup=setup, teardown=teardown, rounds=3, iterations=1)
    benchmark.extra_info.update(
        {
            "bytes": TRANSFER_BYTES,
            "host_peak_increase_bytes": max(peaks),
            "host_increase_after_bytes": int(np.median(after)),
            "receiver_private_increase_bytes": max(b_private),
        }
    )


#: Issue 11's re-measure: x of 1 GiB (fits a machine shared with others).
ALL_TO_ALL_SIZE = scaled(GiB)
ALL_TO_ALL_LIMIT = scaled(3 * GiB, minimum=512 * MiB)


@pytest.mark.parametrize("impl", ["stock", "ours"])
def test_all_to_all_config_only(benchmark: Any, impl: str) -> None:
    """``(x @ x.T).sum()``, x 1 GiB of random floats in 64 MiB row blocks, 2
    workers x 1 thread x 3 GiB; ours enabled by config alone (preload +
    ``shm.shared-memory.enabled``). Host memory (``MemTotal -
    MemAvailable``) sampled every 50 ms; timed: the computation only."""
    import dask.array as da

    benchmark.group = "all-to-all (x @ x.T).sum(), x 1 GiB, 2 workers, config-only"
    config = {**BENCH_CONFIG}
    if impl == "ours":
        config.update(
            {
                "distributed.worker.preload": ["dask_shm"],
                "distributed.nanny.preload": ["dask_shm"],
                "shm.shared-memory.enabled": True,
            }
        )
    shape = DemoConfig(
        size=ALL_TO_ALL_SIZE, chunk=DEMO_CHUNK, workers=2, threads=1, memory_limit=ALL_TO_ALL_LIMIT
    )
    results: list[float] = []
    with process_cluster(2, ALL_TO_ALL_LIMIT, config, silence_logs=logging.ERROR) as client:
        kinds = client.run(lambda dask_worker: type(dask_worker.data).__name__)
        assert set(kinds.values()) == {"SharedSpillBuffer" if impl == "ours" else "SpillBuffer"}
        pids = set(client.run(os.getpid).values())
        sampler = MemorySampler(pids, interval=0.05).start()
        cluster_sampler = _ClusterMemorySampler(pids)

        def compute() -> None:
            x = da.random.default_rng(0).random(shape.shape, chunks=shape.chunks)
            results.append(float((x @ x.T).sum().compute()))

        try:
            benchmark.pedantic(compute, rounds=1, iterations=1)
        finally:
            sampler.stop()
            cluster_sampler.stop()
    benchmark.extra_info.update(
        {
            "host_peak_increase_bytes": sampler.peak_host_increase(),
            "worker_peak_private_bytes": max(
                p.private for s in sampler.samples for p in s.processes.values()
            ),
            "anon_shmem_peak_increase_bytes": cluster_sampler.anon_shmem_peak,
            "workers_private_plus_shmem_peak_increase_bytes": cluster_sampler.cluster_peak,
            "compute_seconds": benchmark.stats.stats.median,
            "samples": len(sampler.samples),
            "worker_kinds": sorted(kinds.values()),
            "result": results[0],
        }
    )
    RESULTS.setdefault(-2, {})[impl] = results[0]
    for other in (v for k, v in RESULTS[-2].items() if k != impl):
        assert results_match(results[0], other), (results[0], other)


def _meminfo() -> dict[str, int]:
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields


class _ClusterMemorySampler:
    """Every 50 ms in a thread: host AnonPages + Shmem, and the cluster's own
    figure, the workers' private memory (RssAnon + RssFile) summed plus the
    growth of the host's Shmem (tmpfs: shared files counted once). The host
    figures include whatever other programs on the machine do meanwhile; the
    cluster figure mostly does not. Peaks are increases over the start."""

    def __init__(self, pids: set[int]) -> None:
        import threading

        self.pids = pids
        info = _meminfo()
        self.shmem0 = info["Shmem"]
        self.anon_shmem0 = info["AnonPages"] + info["Shmem"]
        self.cluster0 = self._private()
        self.anon_shmem_peak = 0
        self.cluster_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _private(self) -> int:
        from dask_shm.procmem import process_memory

        total = 0
        for pid in self.pids:
            try:
                total += process_memory(pid).private
            except ProcessLookupError:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            info = _meminfo()
            self.anon_shmem_peak = max(
                self.anon_shmem_peak, info["AnonPages"] + info["Shmem"] - self.anon_shmem0
            )
            cluster = self._private() - self.cluster0 + info["Shmem"] - self.shmem0
            self.cluster_peak = max(self.cluster_peak, cluster)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
