"""Arrays born shared (issue 16): stock distributed vs dask-shm, in one run.

Run: ``pytest benches/bench_born.py`` (ours/stock ratios printed at the end by
benches/conftest.py). Implementations:

- ``stock``: stock distributed (and numpy's ordinary memory);
- ``ours``: dask-shm's shared-memory mode without born-shared arrays;
- ``ours-born``: shared-memory mode, arrays born shared, root ``/dev/shm``
  (on this host a tmpfs without huge pages: ``huge=never``);
- ``ours-born-huge``: the same with the root on a tmpfs the bench mounts with
  ``huge=within_size`` (skipped when it cannot mount: needs root);
- ``ray`` (hand-off benchmarks, skipped unless ``ray`` is installed): Ray
  tasks, the array going through Ray's object store (``ray.init`` with 2
  CPUs and a 3 GiB object store, started before the timing).

Benchmarks:

- ``test_numpy_fresh``: ``(x + y) * 2.0`` on 64 MiB float arrays, two fresh
  64 MiB results per call (numpy's ordinary allocations get transparent huge
  pages; blocks born shared get whatever the tmpfs serves);
- ``test_spill``: spilling one 64 MiB array (``evict()`` of a buffer holding
  only it): stock's ``SpillBuffer`` into a directory on ``/dev/shm`` (its
  fastest case), ours a born-shared array in a shared-mode buffer;
- ``test_handoff``: a 1 GiB array made on worker A a moment ago, needed by a
  task on worker B of the same host (2 worker processes); the time is B's
  task, submit to result;
- ``test_handoff_floor``: ``test_handoff`` with a 64-byte array on stock:
  distributed's own round trip, the floor of every hand-off;
- ``test_make_handoff_use``: make the array on A, use it (``sum``) on B, one
  timed round trip.

``DASK_SHM_BENCH_SCALE`` (default 1) multiplies the sizes, e.g. 0.05 for a
smoke run.
"""

from __future__ import annotations

import logging
import operator
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait
from distributed.spill import SpillBuffer as StockSpillBuffer

from dask_shm import SharedMemoryPlugin
from dask_shm.shared import born, born_worker, paths

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from clusters import worker_addresses  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SCALE = float(os.environ.get("DASK_SHM_BENCH_SCALE", "1"))
ARRAY = max(2 * MiB, int(64 * MiB * SCALE))
HANDOFF = max(4 * MiB, int(GiB * SCALE))
CLUSTER_CONFIG = {
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
    "distributed.scheduler.active-memory-manager.start": False,
}


@pytest.fixture(scope="module")
def huge_root() -> Iterator[str | None]:
    """A tmpfs mounted with huge=within_size, or None when mounting is refused."""
    mount_point = tempfile.mkdtemp(prefix="dask-shm-bench-huge-")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4g,huge=within_size,mode=1777", "tmpfs", mount_point],
        capture_output=True,
    )
    if done.returncode:
        os.rmdir(mount_point)
        yield None
        return
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", mount_point])
        os.rmdir(mount_point)


def _root_for(impl: str, huge_root: str | None) -> str:
    if impl == "ours-born-huge":
        if huge_root is None:
            pytest.skip("cannot mount a tmpfs with huge pages here (not root?)")
        return huge_root
    return "/dev/shm"


@pytest.fixture
def arena_dir(request: Any, huge_root: str | None) -> Iterator[str]:
    impl = request.node.callspec.params["impl"]
    # Under the per-user directory, as a worker's: a store adopts only files there.
    root = paths.user_root(_root_for(impl, huge_root))
    directory = tempfile.mkdtemp(prefix="bench-born-", dir=root)
    born.start(directory, budget=4 * GiB)
    try:
        yield directory
    finally:
        born.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("impl", ["stock", "ours-born", "ours-born-huge"])
def test_numpy_fresh(benchmark: Any, impl: str, arena_dir: str) -> None:
    benchmark.group = f"numpy (x + y) * 2 on fresh {ARRAY // MiB} MiB arrays"
    x = np.random.default_rng(0).random(ARRAY // 8)
    y = np.random.default_rng(1).random(ARRAY // 8)

    def work() -> None:
        (x + y) * 2.0

    if impl == "stock":
        benchmark.pedantic(work, rounds=30, iterations=1, warmup_rounds=2)
    else:
        with born.allocating():
            out = (x + y) * 2.0
            assert born.whole_block(out) is not None
            del out
            benchmark.pedantic(work, rounds=30, iterations=1, warmup_rounds=2)
    benchmark.extra_info["bytes"] = 2 * ARRAY


@pytest.mark.parametrize("impl", ["stock", "ours-born", "ours-born-huge"])
def test_spill(benchmark: Any, impl: str, arena_dir: str, huge_root: str | None) -> None:
    from dask_shm.shared.buffer import SharedSpillBuffer

    benchmark.group = f"spill one {ARRAY // MiB} MiB array"
    root = _root_for(impl, huge_root)
    buffers: list[Any] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if impl == "stock":
            directory = tempfile.mkdtemp(prefix="dask-shm-bench-stock-", dir="/dev/shm")
            buffer: Any = StockSpillBuffer(directory, target=4 * GiB)
            buffers.append((buffer, directory))
            buffer["x"] = np.random.default_rng(0).random(ARRAY // 8)
        else:
            disk = tempfile.mkdtemp(prefix="dask-shm-bench-disk-")
            buffer = SharedSpillBuffer.create(
                4 * GiB,
                root=root,
                disk_root=disk,
                budget=4 * GiB,
                min_size=64 * 1024,
                min_shared_fraction=0.5,
            )
            buffers.append((buffer, disk))
            with born.allocating():
                value = np.random.default_rng(0).random(ARRAY // 8)
            assert born.whole_block(value) is not None
            buffer["x"] = value
            del value
        return (buffer,), {}

    def spill(buffer: Any) -> None:
        assert buffer.evict() > 0

    benchmark.pedantic(spill, setup=setup, rounds=10, iterations=1)
    for buffer, directory in buffers:
        assert "x" in buffer.slow
        buffer.clear()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    benchmark.extra_info["bytes"] = ARRAY


def _make(nbytes: int) -> np.ndarray:
    return np.full(nbytes // 8, 1.5)


def _sum(x: np.ndarray) -> float:
    return float(x.sum())


def _is_born(x: np.ndarray) -> bool:
    return born.whole_block(x) is not None or born.block_of(x) is not None


def _settle(client: Client) -> None:
    """Wait until the workers hold no keys (the previous round's are released)."""
    for _ in range(200):
        if not any(client.run(lambda dask_worker: len(dask_worker.data)).values()):
            return
        time.sleep(0.02)


def _cluster(impl: str, root: str) -> tuple[LocalCluster, Client, str, str]:
    cluster = LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        memory_limit=max(4 * GiB, 3 * HANDOFF),
        dashboard_address=":0",
        silence_logs=logging.ERROR,
    )
    client = Client(cluster)
    if impl != "stock":
        client.register_plugin(SharedMemoryPlugin(root=root))
    if impl.startswith("ours-born"):
        client.register_plugin(born_worker.BornSharedPlugin(born_worker.BornSettings(mode=True)))
    a, b = worker_addresses(client)
    return cluster, client, a, b


IMPLS = ["stock", "ours", "ours-born", "ours-born-huge", "ray"]


@pytest.fixture
def ray_session(request: Any) -> Iterator[Any]:
    """Ray started (2 CPUs, 3 GiB object store) for the ``ray`` impl, else None."""
    if request.node.callspec.params["impl"] != "ray":
        yield None
        return
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        object_store_memory=3 * GiB,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _ray_tasks(ray: Any) -> tuple[Any, Any, Any]:
    """make / first / sum as Ray tasks (defined here so that Ray pickles them
    by value: its workers cannot import this bench module)."""

    def make(nbytes: int) -> Any:
        import numpy

        return numpy.full(nbytes // 8, 1.5)

    def first(x: Any) -> float:
        return float(x[0])

    def total(x: Any) -> float:
        return float(x.sum())

    return ray.remote(make), ray.remote(first), ray.remote(total)


def _ray_handoff(benchmark: Any, ray: Any) -> None:
    make, first, _ = _ray_tasks(ray)

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        ref = make.remote(HANDOFF)
        ray.wait([ref], fetch_local=False)
        return (ref,), {}

    def handoff(ref: Any) -> None:
        ray.get(first.remote(ref))

    ray.get(first.remote(make.remote(8 * MiB)))  # warm the workers
    benchmark.pedantic(handoff, setup=setup, rounds=5, iterations=1)


def _ray_round_trip(benchmark: Any, ray: Any) -> None:
    make, _, total = _ray_tasks(ray)

    def round_trip() -> None:
        assert ray.get(total.remote(make.remote(HANDOFF))) == 1.5 * (HANDOFF // 8)

    benchmark.pedantic(round_trip, rounds=5, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("impl", IMPLS)
def test_handoff(benchmark: Any, impl: str, huge_root: str | None, ray_session: Any) -> None:
    benchmark.group = f"hand-off of a fresh {HANDOFF / GiB:.3g} GiB array, worker A -> B"
    benchmark.extra_info["bytes"] = HANDOFF
    if ray_session is not None:
        return _ray_handoff(benchmark, ray_session)
    root = _root_for(impl, huge_root)
    with dask.config.set(CLUSTER_CONFIG):
        cluster, client, a, b = _cluster(impl, root)
        with cluster, client:
            probe = client.submit(_make, 8 * MiB, workers=[a], pure=False)
            benchmark.extra_info["born_on_a"] = client.submit(_is_born, probe).result()
            client.cancel([probe])
            _time_handoff(benchmark, client, a, b, HANDOFF, rounds=5)


def _time_handoff(benchmark: Any, client: Client, a: str, b: str, nbytes: int, rounds: int) -> None:
    """Time B's task on an array of ``nbytes`` made on A a moment before
    (untimed), submit to result; the array is released after each round."""

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        on_a = client.submit(_make, nbytes, workers=[a], pure=False)
        wait(on_a)
        return (on_a,), {}

    def handoff(on_a: Any) -> None:
        client.submit(operator.getitem, on_a, 0, workers=[b], pure=False).result()

    def teardown(on_a: Any) -> None:
        client.cancel([on_a])
        _settle(client)

    benchmark.pedantic(handoff, setup=setup, teardown=teardown, rounds=rounds, iterations=1)


def test_handoff_floor(benchmark: Any) -> None:
    """What ``test_handoff`` measures with a 64-byte array on stock: the
    scheduler round trip of a task with one dependency on the other worker,
    which no hand-off can go below (hence the ratio it bounds)."""
    benchmark.group = "hand-off floor: the same task with a 64-byte dependency (stock)"
    with dask.config.set(CLUSTER_CONFIG):
        cluster, client, a, b = _cluster("stock", "/dev/shm")
        with cluster, client:
            _time_handoff(benchmark, client, a, b, 64, rounds=9)


@pytest.mark.parametrize("impl", IMPLS)
def test_make_handoff_use(
    benchmark: Any, impl: str, huge_root: str | None, ray_session: Any
) -> None:
    benchmark.group = f"make {HANDOFF / GiB:.3g} GiB on A + hand-off + use on B"
    benchmark.extra_info["bytes"] = HANDOFF
    if ray_session is not None:
        return _ray_round_trip(benchmark, ray_session)
    root = _root_for(impl, huge_root)
    with dask.config.set(CLUSTER_CONFIG):
        cluster, client, a, b = _cluster(impl, root)
        with cluster, client:

            def round_trip() -> None:
                on_a = client.submit(_make, HANDOFF, workers=[a], pure=False)
                on_b = client.submit(_sum, on_a, workers=[b], pure=False)
                assert on_b.result() == 1.5 * (HANDOFF // 8)
                client.cancel([on_a, on_b])

            benchmark.pedantic(
                round_trip, setup=lambda: _settle(client), rounds=5, iterations=1, warmup_rounds=1
            )
    benchmark.extra_info["bytes"] = HANDOFF
