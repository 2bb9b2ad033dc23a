"""Shared-memory mode across real worker processes and real files on /dev/shm."""

from __future__ import annotations

import os
import signal
import time

import dask
import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, LocalCluster, Worker, wait

from dask_shm import SharedMemoryNannyPlugin, SharedMemoryPlugin
from dask_shm.procmem import host_memory_used, process_memory
from dask_shm.shared import shm_metrics
from dask_shm.shared.published_share import read_published_share

MB = 2**20
GB = 2**30


def make_array(nbytes: int, fill: float = 1.0) -> np.ndarray:
    return np.full(nbytes // 8, fill)


def inode_of(dask_worker: Worker, key: str) -> int | None:
    store = dask_worker.data.store
    name = store.file_of(key)
    return None if name is None else os.stat(store.files.path(name)).st_ino


def bytes_read(dask_worker: Worker) -> int:
    """Bytes this process has read through read-like system calls (sockets included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def process_dir_of(dask_worker: Worker) -> str:
    return os.path.dirname(dask_worker.data.spill_directory)


@pytest.fixture(scope="module")
def shm_cluster():
    # No Active Memory Manager: it would drop the replicas these tests count.
    with process_cluster(2, "6GiB") as client:
        client.register_plugin(SharedMemoryPlugin())
        client.register_plugin(SharedMemoryNannyPlugin())
        yield client


def two_workers(client: Client) -> tuple[str, str]:
    a, b = worker_addresses(client)
    return a, b


def test_a_key_reaches_a_sibling_by_hard_link(shm_cluster):
    client = shm_cluster
    a, b = two_workers(client)
    before = client.run(bytes_read, workers=[b])[b]
    x = client.submit(make_array, 64 * MB, 3.0, workers=[a], key="link-x")
    total = client.submit(lambda v: float(v.sum()), x, workers=[b], key="link-sum")
    assert total.result() == 3.0 * 8 * MB  # what numpy gives without any plugin
    read = client.run(bytes_read, workers=[b])[b] - before
    assert read < 8 * MB, f"{read} bytes read by the receiver: the array crossed a socket"
    inodes = client.run(inode_of, key="link-x")
    assert inodes[a] is not None and inodes[a] == inodes[b]
    figures = client.run(shm_metrics)
    assert figures[a]["link_transfers"] >= 1 and figures[a]["link_bytes"] >= 64 * MB
    assert figures[b]["received_links"] >= 1
    assert figures[a]["fallback_transfers"] == 0
    # each holder accounts half of the file
    assert figures[a]["shared_bytes"] == pytest.approx(32 * MB, rel=0.01)
    del x, total


def reduction_part(i: int) -> dict[str, np.ndarray]:
    """What dask's ``mean_chunk`` returns: a dict (not weak-referenceable)."""
    return {"n": np.full(1, 1.0), "total": np.full(MB // 8, float(i))}


def combined(*parts: dict[str, np.ndarray]) -> float:
    return float(sum(float(p["total"].sum()) for p in parts))


def test_reduction_parts_received_by_link_are_kept_by_their_link(shm_cluster):
    """Dicts of arrays made on one worker and combined on the other (a
    reduction's intermediates) arrive by hard link and stay backed by it:
    every link sent is kept by the receiver, none falls back to a private
    copy over a mapping that nobody's share would count."""
    client = shm_cluster
    a, b = two_workers(client)
    before = client.run(shm_metrics)
    parts = [client.submit(reduction_part, i, workers=[a], key=f"part-{i}") for i in range(8)]
    total = client.submit(combined, *parts, workers=[b], key="part-total")
    assert total.result() == sum(float(i) * (MB // 8) for i in range(8))
    after = client.run(shm_metrics)
    sent = after[a]["link_transfers"] - before[a]["link_transfers"]
    kept = after[b]["received_links"] - before[b]["received_links"]
    assert sent == 8 and kept == 8, (before, after)
    held = client.run(
        lambda dask_worker: [
            k for k in dask_worker.data.store.retained if str(k).startswith("part-")
        ],
        workers=[b],
    )[b]
    assert sorted(held) == sorted(p.key for p in parts)
    del parts, total


def test_a_client_on_the_same_host_gets_real_values(shm_cluster):
    client = shm_cluster
    a, _ = two_workers(client)
    x = client.submit(make_array, 8 * MB, 2.0, workers=[a], key="client-x")
    wait(x)
    client.run(lambda dask_worker: dask_worker.data.evict(), workers=[a])
    got = x.result()
    assert isinstance(got, np.ndarray) and got.shape == (MB,) and (got == 2.0).all()
    assert client.gather(client.scatter(np.arange(10))).tolist() == list(range(10))


def test_host_memory_holds_one_copy_for_two_holders(shm_cluster):
    client = shm_cluster
    a, b = two_workers(client)
    baseline = host_memory_used()
    x = client.submit(make_array, GB, 1.0, workers=[a], key="big-x")
    y = client.submit(lambda v: float(v[::4096].sum() + v.sum()), x, workers=[b], key="big-y")
    y.result()
    held = client.run(lambda dask_worker: "big-x" in dask_worker.data)
    assert held == {a: True, b: True}
    grown = host_memory_used() - baseline
    # stock: two private copies (+2 GiB); here one shared file
    assert grown < 1.5 * GB, f"host memory grew by {grown / GB:.2f} GiB"
    mem_b = client.run(lambda: process_memory(), workers=[b])[b]
    assert mem_b.shmem > 0.9 * GB  # b touched every page of the shared file
    assert mem_b.private < 0.5 * GB
    # The monitor counts b's private memory plus its 1/2 share of the file
    # (two holders), not the whole mapped file: summed over a and b, one copy.
    # (The handle's link, gone after the hand-over, is seen once the workers
    # refresh their link counts: within a few seconds.)
    deadline = time.monotonic() + 15
    while True:
        shares = client.run(lambda dask_worker: dask_worker.data.tier2_bytes())
        if all(abs(v - GB / 2) < 0.01 * GB for v in shares.values()):
            break
        assert time.monotonic() < deadline, shares
        time.sleep(0.2)
    monitored = client.run(lambda dask_worker: dask_worker.monitor.get_process_memory())
    assert monitored[b] < mem_b.rss - 0.4 * GB
    assert abs(monitored[b] - (mem_b.private + GB / 2)) < 0.1 * GB
    assert sum(monitored.values()) < 1.5 * GB
    # The nanny reads the same share from outside the worker.
    pid_b = client.run(os.getpid, workers=[b])[b]
    share = client.run(lambda dask_worker: dask_worker.data.tier2_bytes(), workers=[b])[b]
    assert abs(share - GB / 2) < 0.01 * GB
    deadline = time.monotonic() + 5
    while abs(read_published_share("/dev/shm", pid_b) - share) >= 0.01 * GB:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    managed = client.run(lambda dask_worker: dask_worker.data.fast.total_weight, workers=[b])[b]
    assert managed < 0.1 * GB
    del x, y
    deadline = time.monotonic() + 30
    while any(client.run(lambda dask_worker: "big-x" in dask_worker.data).values()):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_metrics_reach_get_metrics_and_prometheus(shm_cluster):
    client = shm_cluster
    a, _ = two_workers(client)

    def heartbeat_metrics(dask_scheduler):
        return {w: ws.metrics.get("shm") for w, ws in dask_scheduler.workers.items()}

    # get_metrics() output reaches the scheduler with each heartbeat
    deadline = time.monotonic() + 30
    while not (shm := client.run_on_scheduler(heartbeat_metrics)[a]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert set(shm) >= {"shared_bytes", "link_transfers", "fallback_bytes"}

    def exposition() -> str:
        import prometheus_client

        return prometheus_client.generate_latest().decode()

    assert "dask_shm_worker_link_bytes" in client.run(exposition)[a]


def test_a_killed_worker_leaves_no_files_after_the_nanny_restarts_it(shm_cluster):
    client = shm_cluster
    a, b = two_workers(client)
    x = client.submit(make_array, 16 * MB, workers=[a], key="doomed")
    wait(x)
    client.run(lambda dask_worker: dask_worker.data.evict(), workers=[a])
    directory = client.run(process_dir_of, workers=[a])[a]
    assert os.listdir(directory)
    pid = client.run(os.getpid, workers=[a])[a]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        workers = worker_addresses(client)
        if len(workers) == 2 and a not in workers:
            break
        assert time.monotonic() < deadline, "the nanny did not restart the worker"
        time.sleep(0.2)
    client.wait_for_workers(2)
    # The plugin is set up on the new worker once it has registered; its
    # setup removes the dead worker's directory before the buffer exists.
    while True:
        kinds = client.run(lambda dask_worker: getattr(dask_worker.data, "shared", False))
        if list(kinds.values()) == [True, True]:
            break
        assert time.monotonic() < deadline, "the new worker did not get shared memory"
        time.sleep(0.2)
    assert not os.path.exists(directory)


def test_config_alone_turns_it_on_in_worker_processes():
    config = {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
    }
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=2, processes=True, memory_limit="1GiB", dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        a, b = two_workers(client)
        # On, yet not listed among the worker's plugins (as distributed's own
        # tests that count plugins expect); torn down by the preload on close.
        state = client.run(
            lambda dask_worker: (
                dask_worker.data.shared,
                "dask-shm-shared-memory" in dask_worker.plugins,
            )
        )
        assert list(state.values()) == [(True, False), (True, False)]
        directories = list(client.run(process_dir_of).values())
        assert all(os.path.isdir(d) for d in directories)
        x = client.submit(make_array, 4 * MB, workers=[a])
        assert client.submit(lambda v: v.size, x, workers=[b]).result() == MB // 2
        assert client.run(shm_metrics, workers=[a])[a]["link_transfers"] == 1
    assert [d for d in directories if os.path.exists(d)] == []  # a clean close leaves nothing


@pytest.mark.parametrize("transfer_min_size", [None, "64 KiB"], ids=["default", "min-size"])
def test_values_in_memory_under_transfer_min_size_travel_as_bytes(transfer_min_size):
    """At the default ``transfer-min-size`` (1 MiB), a value fresh in the
    sender's memory below it reaches the peer as bytes (as in stock: nothing
    written), one above it by hard link; lowered to ``min-size``, the small
    one goes by link too. Every value arrives whole."""
    config = {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
    }
    if transfer_min_size is not None:
        config["shm.shared-memory.transfer-min-size"] = transfer_min_size
    linked_small = transfer_min_size is not None
    with process_cluster(2, "1GiB", config) as client:
        a, b = two_workers(client)
        small = client.submit(make_array, 256 * 1024, 2.0, workers=[a], key="small")
        total = client.submit(lambda v: float(v.sum()), small, workers=[b], key="small-sum")
        assert total.result() == 2.0 * 32 * 1024
        figures = client.run(shm_metrics, workers=[a])[a]
        expected = (1, 0) if linked_small else (0, 1)
        assert (figures["link_transfers"], figures["fallback_transfers"]) == expected
        if not linked_small:
            assert client.run(inode_of, key="small", workers=[a])[a] is None  # never written
        large = client.submit(make_array, 4 * MB, 3.0, workers=[a], key="large")
        total = client.submit(lambda v: float(v.sum()), large, workers=[b], key="large-sum")
        assert total.result() == 3.0 * MB // 2
        assert client.run(shm_metrics, workers=[a])[a]["link_transfers"] == 1 + linked_small
