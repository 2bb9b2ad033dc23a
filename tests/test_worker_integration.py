"""dask_shm.SpillBuffer inside real workers and clusters."""

from __future__ import annotations

import os
import signal
import sys

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, Nanny, Worker, wait
from distributed.utils_test import gen_cluster

import dask_shm
from dask_shm import SpillBuffer, SpillBufferPlugin, spill_buffer_for_worker

# The memory monitor must not pause or kill these small workers for the
# unmanaged memory of the interpreter itself; we test spilling, not the monitor.
NO_MONITOR_KILL = {
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}


def spilling_cluster(n_workers: int, memory_limit: str) -> LocalCluster:
    """A LocalCluster of worker processes, each with our buffer sized from memory_limit."""
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        memory_limit=memory_limit,
        data=dask_shm.worker_data(memory_limit),
        dashboard_address=":0",
    )


def worker_summary(dask_worker: Worker) -> dict:
    data = dask_worker.data
    return {
        "type": f"{type(data).__module__}.{type(data).__qualname__}",
        "spilled": tuple(getattr(data, "spilled_total", (0, 0))),
        "n_slow": len(getattr(data, "slow", ())),
        "target": getattr(data, "n", None),
    }


def test_local_cluster_spilling_reduction_matches_in_memory_result():
    x = da.random.default_rng(42).random((4_000, 4_000), chunks=(500, 500))  # 128 MB
    expected = (x + 1).sum().compute(scheduler="threads")
    with dask.config.set(NO_MONITOR_KILL):
        with (
            spilling_cluster(2, "100MiB") as cluster,
            Client(cluster) as client,
        ):
            y = (x + 1).persist()
            wait(y)
            summaries = client.run(worker_summary)
            assert y.sum().compute() == pytest.approx(expected)
    for summary in summaries.values():
        assert summary["type"] == "dask_shm.spill.SpillBuffer"
        assert summary["target"] == int(100 * 2**20 * 0.6)
    # 128 MB of data across two workers with 60 MiB targets must spill.
    assert sum(s["spilled"][0] for s in summaries.values()) > 0
    assert sum(s["n_slow"] for s in summaries.values()) > 0


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    worker_kwargs={"memory_limit": "100 MiB", "data": dask_shm.worker_data("100 MiB")},
    config=NO_MONITOR_KILL,
)
async def test_worker_reports_our_spilled_totals(c, s, a):
    assert isinstance(a.data, SpillBuffer)
    futures = c.map(lambda i: np.full(2_000_000, i, dtype="u1"), range(40))  # 80 MB
    await wait(futures)
    metrics = await a.get_metrics()
    assert metrics["spilled_bytes"]["memory"] == a.data.spilled_total.memory > 0
    assert metrics["spilled_bytes"]["disk"] == a.data.spilled_total.disk
    results = await c.gather(futures)
    assert [int(r[0]) for r in results] == list(range(40))
    assert a.data.cumulative_metrics["disk-write", "count"] > 0


@gen_cluster(
    client=True,
    nthreads=[("", 1), ("", 1)],
    config=NO_MONITOR_KILL,  # in-process: the monitor would read the whole test process
    worker_kwargs={"memory_limit": "1 GiB"},
)
async def test_plugin_swaps_buffers_of_running_workers_keeping_their_data(c, s, a, b):
    futures = c.map(lambda i: np.full(1_000, i), range(20))
    await wait(futures)
    before = {k for w in (a, b) for k in w.data}
    await c.register_plugin(SpillBufferPlugin())
    for w in (a, b):
        assert isinstance(w.data, SpillBuffer)
        assert w.state.data is w.data
        assert w.data.n == int(2**30 * 0.6)
    assert {k for w in (a, b) for k in w.data} == before
    assert [int(r[0]) for r in await c.gather(futures)] == list(range(20))
    more = await c.submit(lambda x: x.sum(), futures[3])
    assert more == 3 * 1_000


def test_buffer_sized_from_worker_memory_config(tmp_path):
    with dask.config.set({"distributed.worker.memory.target": 0.5}):
        buf = spill_buffer_for_worker(str(tmp_path), memory_limit="1 GiB")
    assert isinstance(buf, SpillBuffer)
    assert buf.n == 2**29
    assert buf.spill_directory == str(tmp_path / "storage")
    with dask.config.set(
        {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False}
    ):
        assert spill_buffer_for_worker(str(tmp_path), memory_limit="1 GiB") == {}
    assert spill_buffer_for_worker(str(tmp_path), memory_limit=0) == {}
    with dask.config.set({"distributed.worker.memory.max-spill": "2 MiB"}):
        capped = spill_buffer_for_worker(str(tmp_path / "capped"), memory_limit="1 GiB")
    assert isinstance(capped, SpillBuffer)
    assert capped.store.max_weight == 2 * 2**20


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("distributed.worker.memory.target", "lots", "target must be False or a fraction"),
        ("distributed.worker.memory.max-spill", "many", "max-spill must be False or a byte"),
    ],
)
def test_bad_memory_config_fails_with_a_clear_message(tmp_path, key, value, match):
    with dask.config.set({key: value}), pytest.raises(ValueError, match=match):
        spill_buffer_for_worker(str(tmp_path), memory_limit="1 GiB")


def _spill_forever(n: int) -> None:
    """Task that keeps its worker spilling until it is killed."""
    from distributed import get_worker

    data = get_worker().data
    for i in range(n):
        data[f"junk-{i}"] = np.full(1_000_000, i % 256, dtype="u1")


@pytest.mark.skipif(sys.platform != "linux", reason="kills a process by pid")
def test_nanny_worker_killed_while_spilling_restarts_cleanly():
    with dask.config.set(NO_MONITOR_KILL):
        with (
            spilling_cluster(1, "64MiB") as cluster,
            Client(cluster) as client,
        ):
            nanny: Nanny = next(iter(cluster.workers.values()))
            first = client.run(lambda dask_worker: (os.getpid(), dask_worker.local_directory))
            (pid, old_dir) = next(iter(first.values()))
            storage = os.path.join(old_dir, "storage")
            client.submit(_spill_forever, 10_000, pure=False)
            # Wait until the worker is spilling, then kill it mid-write.
            _wait_for_files(storage, 5)
            os.kill(pid, signal.SIGKILL)
            client.wait_for_workers(1)
            new_pid = _wait_for_new_pid(client, pid)
            assert new_pid != pid
            # The restarted worker computes a spilling workload correctly.
            x = da.ones((2_000, 2_000), chunks=(250, 250))  # 32 MB > 38 MiB * ... spills
            y = (x * 2).persist()
            wait(y)
            assert y.sum().compute() == 2 * 4_000_000
            summary = next(iter(client.run(worker_summary).values()))
            assert summary["type"] == "dask_shm.spill.SpillBuffer"
            assert nanny.process is not None
    # The dead worker's spill files do not outlive the cluster.
    assert not os.path.exists(storage)


def _wait_for_files(directory: str, n: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.isdir(directory) and len(os.listdir(directory)) >= n:
            return
        time.sleep(0.01)
    raise TimeoutError(f"worker did not spill {n} files into {directory}")


def _wait_for_new_pid(client: Client, old_pid: int) -> int:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            pids = client.run(os.getpid)
        except Exception:
            pids = {}
        for pid in pids.values():
            if pid != old_pid:
                return pid
        time.sleep(0.2)
    raise TimeoutError("the nanny did not restart the worker")
