"""What users do to a running cluster, in shared-memory mode and in stock:
retire a worker, rebalance, restart, and run over TLS. Real worker processes
(LocalCluster with nannies), shared mode switched on by config alone, a fresh
root on /dev/shm per test.

In shared mode the values these operations move between workers of one host
go by hard link (counted by the receivers' ``received_*`` figures), the
observable outcome (which worker holds which key, the values) is stock's, and
the root holds nothing of the cluster's once it is closed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, wait
from distributed.security import Security
from p2p_workload import shared_config

from dask_shm.shared import shm_metrics

MiB = 2**20
N_VALUES = 16
VALUE_BYTES = 8 * MiB


def files_under(root: str) -> list[str]:
    """Every file below ``root``, relative to it, sorted."""
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


def process_directories(root: str) -> set[str]:
    """Names of the per-process directories (``p-<pid>-<start>``) in the root."""
    return {
        part for path in files_under(root) for part in path.split(os.sep) if part.startswith("p-")
    }


def assert_nothing_left(root: str) -> None:
    """A closed shared-mode cluster leaves only the root's identity file."""
    leftovers = [p for p in files_under(root) if not p.endswith("root-id")]
    assert leftovers == [], "closed cluster left files in the shared-memory root"


def values_on(client: Client, worker: str) -> list:
    """N_VALUES futures of VALUE_BYTES arrays made on ``worker`` (value i is all i)."""
    futures = [
        client.submit(np.full, VALUE_BYTES // 8, float(i), workers=[worker], pure=False)
        for i in range(N_VALUES)
    ]
    wait(futures)
    return futures


def assert_intact(futures: list) -> None:
    for i, f in enumerate(futures):
        value = f.result()
        assert value.shape == (VALUE_BYTES // 8,)
        assert (value == float(i)).all(), f"value {i} changed"


def received(client: Client, workers: list[str]) -> tuple[float, float]:
    """Links and bytes received by ``workers`` so far, summed."""
    figures = client.run(shm_metrics, workers=workers)
    return (
        sum(f["received_links"] for f in figures.values()),
        sum(f["received_bytes"] for f in figures.values()),
    )


@pytest.fixture
def cluster(request, shm_dir: str) -> Iterator[tuple[Client, str]]:
    """A 2-worker cluster in the mode the test is parametrised with, and the
    shared-memory root (unused in stock). Shared mode must leave nothing of
    the cluster in the root once closed."""
    mode = request.param
    config = shared_config(shm_dir) if mode == "shared" else {}
    with process_cluster(2, "512MiB", config) as client:
        yield client, mode
    if mode == "shared":
        assert_nothing_left(shm_dir)


@pytest.mark.parametrize("cluster", ["stock", "shared"], indirect=True)
def test_retiring_a_worker_hands_its_values_over(cluster):
    client, mode = cluster
    a, b = worker_addresses(client)
    futures = values_on(client, a)
    links_before, bytes_before = received(client, [b])

    assert list(client.retire_workers([a])) == [a]

    assert worker_addresses(client) == [b]
    assert {k for k, ws in client.who_has(futures).items() if ws == (b,)} == {
        f.key for f in futures
    }
    assert_intact(futures)
    if mode == "shared":
        links, nbytes = received(client, [b])
        assert links - links_before >= N_VALUES
        assert nbytes - bytes_before >= N_VALUES * VALUE_BYTES


@pytest.mark.parametrize("cluster", ["stock", "shared"], indirect=True)
def test_rebalance_moves_values_to_the_idle_worker(cluster):
    client, mode = cluster
    a, b = worker_addresses(client)
    futures = values_on(client, a)
    # rebalance decides from the process memory the scheduler last heard of
    # (the values' sizes it knows at once): wait until a heartbeat has all
    # of them on top of an interpreter's own (60 MiB or more).
    deadline = time.monotonic() + 30
    while (
        client.run_on_scheduler(
            lambda dask_scheduler, a=a: dask_scheduler.workers[a].memory.process
        )
        < N_VALUES * VALUE_BYTES + 40 * MiB
    ):
        assert time.monotonic() < deadline, "the scheduler never heard of the values"
        time.sleep(0.1)
    links_before, bytes_before = received(client, [b])

    client.rebalance()

    on_b = client.has_what()[b]
    # Stock moves some of them (512 MiB workers); ours decides on the same figures.
    assert 0 < len(on_b) < N_VALUES
    assert len(client.has_what()[a]) == N_VALUES - len(on_b)
    assert_intact(futures)
    if mode == "shared":
        links, nbytes = received(client, [b])
        assert links - links_before >= len(on_b)
        assert nbytes - bytes_before >= len(on_b) * VALUE_BYTES


def test_restart_takes_the_old_workers_files_away(shm_dir):
    with process_cluster(2, "1.5GiB", shared_config(shm_dir)) as client:
        a, b = worker_addresses(client)
        futures = values_on(client, a)
        # b takes copies by link: files held by two processes.
        wait(client.submit(lambda *xs: sum(float(x[0]) for x in xs), *futures, workers=[b]))
        assert received(client, [b])[0] >= N_VALUES
        old = process_directories(shm_dir)
        assert len(old) >= 2

        client.restart()

        # The nannies' new workers are other processes with directories of their own.
        deadline = time.monotonic() + 30
        while process_directories(shm_dir) & old:
            assert time.monotonic() < deadline, (
                f"the old workers' files are still there: {files_under(shm_dir)}"
            )
            time.sleep(0.1)
        a, b = worker_addresses(client)
        futures = values_on(client, a)
        total = client.submit(lambda *xs: sum(float(x[0]) for x in xs), *futures, workers=[b])
        assert total.result() == sum(range(N_VALUES))
        assert received(client, [b])[0] >= N_VALUES
    assert_nothing_left(shm_dir)


def test_a_tls_cluster_moves_values_by_link(shm_dir):
    security = Security.temporary()
    with process_cluster(
        2, "1.5GiB", shared_config(shm_dir), security=security, protocol="tls"
    ) as client:
        a, b = worker_addresses(client)
        assert a.startswith("tls://") and b.startswith("tls://")
        futures = values_on(client, a)
        total = client.submit(lambda *xs: sum(float(x[0]) for x in xs), *futures, workers=[b])
        assert total.result() == sum(range(N_VALUES))
        links, nbytes = received(client, [b])
        assert links >= N_VALUES
        assert nbytes >= N_VALUES * VALUE_BYTES
    assert_nothing_left(shm_dir)


def _spill_everything(dask_worker) -> int:  # type: ignore[no-untyped-def]
    data = dask_worker.data
    while data.fast:
        data.evict()
    return len(data.slow)


def _data_kind(dask_worker) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    return type(dask_worker.data).__name__, len(dask_worker.data)


def test_shared_mode_removed_from_a_running_cluster_keeps_every_value(shm_dir):
    # Unregistering the plugin closed the buffer and deleted its files but
    # left it as the workers' data: spilled values could not be read back
    # (the gather hung), and nothing could be spilled any more.
    from dask_shm import SharedMemoryPlugin

    with process_cluster(2, "512MiB") as client:
        client.register_plugin(SharedMemoryPlugin(root=shm_dir))
        a, _ = worker_addresses(client)
        futures = values_on(client, a)
        assert client.run(_spill_everything, workers=[a])[a] == N_VALUES
        client.unregister_worker_plugin("dask-shm-shared-memory")
        assert set(client.run(_data_kind).values()) == {
            ("SpillBuffer", N_VALUES),
            ("SpillBuffer", 0),
        }
        assert_intact(futures)
        assert client.run(_spill_everything, workers=[a])[a] == N_VALUES  # spills privately
        assert_intact(futures)
        # and shared mode can come back
        client.register_plugin(SharedMemoryPlugin(root=shm_dir))
        assert client.run(lambda dask_worker: dask_worker.data.shared, workers=[a])[a]
        assert_intact(futures)
    assert_nothing_left(shm_dir)
