"""P2P shuffles and rechunks in shared-memory mode: same-host batches go by
file on the shared root, results equal stock, and no file outlives a run
(finished, failed, cancelled or restarted after a worker died)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, futures_of, wait
from hosts import two_hosts
from namespaces import unavailable_reason as unshare_unavailable
from p2p_workload import (
    ARRAY_SIDE,
    PARTITIONS,
    part,
    rechunked_checksum,
    shared_config,
    shuffled_checksum,
)
from tmpfs import small_tmpfs

HERE = os.path.dirname(os.path.abspath(__file__))


def run_workload(mode: str, root: str) -> dict[str, dict]:
    """p2p_workload.py in a network namespace of its own: its ``lo`` counts
    only this cluster's traffic."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [
            "unshare",
            "--net",
            "sh",
            "-c",
            f'ip link set lo up && exec "$0" p2p_workload.py {mode} {root}',
            sys.executable,
        ],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["workload"]: r for r in results}


def test_shuffle_and_rechunk_go_by_file_with_stock_results():
    reason = unshare_unavailable("--net")
    if reason:
        pytest.skip(reason)
    with small_tmpfs("1g") as root:
        stock = run_workload("stock", root)
        ours = run_workload("shared", root)
        assert leftovers(root) == []
    for name in ("shuffle", "rechunk"):
        assert ours[name]["checksum"] == stock[name]["checksum"], name
        counters = ours[name]["counters"]
        # every batch went by file (the two workers share the root)
        assert counters["p2p_file_batches"] > 0, (name, counters)
        assert counters["p2p_file_bytes"] >= 32 * 2**20, (name, counters)
        assert counters.get("p2p_tcp_bytes", 0) == 0, (name, counters)
        assert ours[name]["files_left"] == []
        # The dashboard's P2P breakdown has the same entries as stock's
        # ("serialize" and "compress" of the batches sent included), but for
        # "offload": stock serializes a message over distributed.comm.offload
        # (10 MiB) in a thread, we write every batch file in the event loop.
        stock_keys = [k for k in stock[name]["p2p_metric_keys"] if k[2] != "offload"]
        assert ours[name]["p2p_metric_keys"] == stock_keys, name
        # stock moves every batch over loopback; we move handles
        assert ours[name]["loopback"] < 0.3 * stock[name]["loopback"], (
            name,
            ours[name]["loopback"],
            stock[name]["loopback"],
        )


def leftovers(root: str) -> list[str]:
    """Batch files, and run directories of live workers, under ``root``."""
    user = os.path.join(root, f"dask-shm-{os.geteuid()}")
    return sorted(
        glob.glob(os.path.join(user, "**", "*.p2p"), recursive=True)
        + glob.glob(os.path.join(user, "*", "p2p", "*", "*"))
    )


def wait_for_no_leftovers(root: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while left := leftovers(root):
        assert time.monotonic() < deadline, left
        time.sleep(0.2)


@pytest.fixture(scope="module")
def shm_root():
    with small_tmpfs("1g") as root:
        yield root


@pytest.fixture(scope="module")
def shared_client(shm_root):
    """One shared-mode cluster for the module's tests (a cluster start each
    cost more than their shuffles): each test counts batches from where the
    one before left them and leaves no file behind."""
    with process_cluster(2, "2GiB", shared_config(shm_root)) as client:
        yield client
    assert leftovers(shm_root) == []


def file_batches(client: Client) -> int:
    figures = client.run(lambda dask_worker: dask_worker.data.shm_counters["p2p_file_batches"])
    return sum(figures.values())


def expected_checksum() -> float:
    total = pd.concat([part(i) for i in range(PARTITIONS)], ignore_index=True)
    return round(float((total["v"] * total["k"]).sum()), 3)


def bad_part(i: int) -> pd.DataFrame:
    """Partition 7's key column is text: the shuffle fails on it."""
    df = part(i)
    if i == 7:
        time.sleep(1)  # after the other transfers sent batches
        df["k"] = df["k"].astype(str) + "x"
    return df


def test_no_file_left_after_a_failed_shuffle(shared_client, shm_root):
    client = shared_client
    out = dd.from_map(bad_part, range(PARTITIONS)).shuffle("k", shuffle_method="p2p")
    with pytest.raises(Exception):  # noqa: B017 - whatever error distributed reports
        out.compute()
    wait_for_no_leftovers(shm_root)
    # the cluster shuffles again, by file
    before = file_batches(client)
    assert shuffled_checksum(client) == pytest.approx(expected_checksum(), rel=1e-12)
    assert file_batches(client) > before
    wait_for_no_leftovers(shm_root)


def slow_part(i: int) -> pd.DataFrame:
    time.sleep(0.5)
    return part(i)


def test_no_file_left_after_a_cancelled_shuffle(shared_client, shm_root):
    client = shared_client
    out = dd.from_map(slow_part, range(PARTITIONS)).shuffle("k", shuffle_method="p2p")
    before = file_batches(client)
    futures = futures_of(out.persist())
    deadline = time.monotonic() + 60
    while file_batches(client) == before:
        assert time.monotonic() < deadline, "no batch went by file"
        time.sleep(0.05)
    client.cancel(futures)
    del futures, out
    wait_for_no_leftovers(shm_root)


def test_a_worker_killed_mid_shuffle_recovers_as_stock(shared_client, shm_root):
    client = shared_client
    a, _ = worker_addresses(client)
    before = file_batches(client)
    result = client.compute(
        dd.from_map(slow_part, range(PARTITIONS))
        .shuffle("k", shuffle_method="p2p")
        .map_partitions(lambda p: float((p["v"] * p["k"]).sum()), meta=("s", "f8"))
        .sum()
    )
    deadline = time.monotonic() + 60
    while file_batches(client) == before:
        assert time.monotonic() < deadline, "no batch went by file"
        time.sleep(0.05)
    pid = client.run(os.getpid, workers=[a])[a]
    os.kill(pid, signal.SIGKILL)
    # distributed restarts the shuffle on the surviving and restarted workers
    assert result.result(timeout=240) == pytest.approx(expected_checksum(), rel=1e-12)
    wait(result)
    del result
    wait_for_no_leftovers(shm_root)


def test_batches_that_do_not_fit_the_root_go_by_tcp():
    # 64 MiB rechunk batches on a 24 MiB root: writing them fails (ENOSPC),
    # and the same batches are sent the stock way.
    with small_tmpfs("24m") as root, process_cluster(2, "2GiB", shared_config(root)) as client:
        got = rechunked_checksum(client)
        x = da.random.default_rng(0).random((ARRAY_SIDE, ARRAY_SIDE), chunks=(ARRAY_SIDE, 256))
        weights = np.arange(ARRAY_SIDE, dtype=float)
        assert got == pytest.approx(float((x * weights).sum().compute(scheduler="sync")), rel=1e-12)
        counters = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
        assert sum(c["p2p_file_fallbacks"] for c in counters.values()) >= 1, counters
        assert sum(c["p2p_tcp_bytes"] for c in counters.values()) >= 64 * 2**20, counters
        assert leftovers(root) == []


def test_cross_host_batches_go_by_tcp_same_host_ones_by_file():
    # Two workers on host A share its tmpfs; host B's worker sees its own
    # tmpfs under the same path (a separate machine): A<->A by file, A<->B by TCP.
    tag = uuid.uuid4().hex[:8]
    shm = tempfile.mkdtemp(prefix=f"dask-shm-p2p-{tag}-", dir="/dev/shm")
    b_shm = tempfile.mkdtemp(prefix=f"dask-shm-p2p-{tag}-bshm-")
    mounted = False
    try:
        with two_hosts() as hosts:
            proc = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=512m,mode=1777", "tmpfs", b_shm],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
            mounted = True
            hosts.binds_b.append((b_shm, shm))
            env = {
                "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
                "DASK_SHM__SHARED_MEMORY__ROOT": shm,
                "DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False",
                # the workers unpickle p2p_workload's functions
                "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
            }
            workers = [("a", "a1"), ("a", "a2"), ("b", "b1")]
            with hosts.cluster(workers, env) as (client, names):
                assert shuffled_checksum(client) == pytest.approx(expected_checksum(), rel=1e-12)
                counters = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
                on = {name: counters[address] for name, address in names.items()}
                for name in ("a1", "a2"):
                    # to the other host-A worker (and itself) by file, to b1 by TCP
                    assert on[name]["p2p_file_batches"] > 0, on
                    assert on[name]["p2p_tcp_batches"] > 0, on
                    assert on[name]["p2p_file_fallbacks"] == 0, on
                # b1 shares a root with no one but itself
                assert on["b1"]["p2p_tcp_batches"] > 0, on
        assert leftovers(shm) == [] and leftovers(b_shm) == []
    finally:
        if mounted:
            subprocess.run(["umount", "-l", b_shm], check=False)
        for d in (shm, b_shm):
            shutil.rmtree(d, ignore_errors=True)


def test_a_worker_that_cannot_take_shard_files_gets_bytes(tmp_path):
    # One worker cannot make its batch directory (an injected ENOSPC): it
    # publishes that it takes no shard files, so its peer sends it bytes, and
    # the shuffle finishes (a handle sent there would fail the run).
    with small_tmpfs("1g") as root:
        preload = os.path.join(HERE, "p2p_refusing_preload.py")
        config = {
            **shared_config(root),
            "distributed.worker.preload": [preload, "dask_shm"],
            "tests.p2p-refusing-flag": str(tmp_path / "refusing"),
        }
        with process_cluster(2, "2GiB", config) as client:
            from dask_shm.shared import p2p

            by_file = client.run(lambda dask_worker: p2p.by_file(dask_worker.address))
            assert sorted(by_file.values()) == [False, True], by_file
            assert shuffled_checksum(client) == pytest.approx(expected_checksum(), rel=1e-12)
            counters = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
            taking = next(a for a, on in by_file.items() if on)
            # to itself by file, to the other worker by TCP, none refused
            assert counters[taking]["p2p_file_batches"] > 0, counters
            assert counters[taking]["p2p_tcp_batches"] > 0, counters
            assert counters[taking]["p2p_file_fallbacks"] == 0, counters
            received = sum(c.get("p2p_received_file_batches", 0) for c in counters.values())
            assert received == counters[taking]["p2p_file_batches"], counters
        assert leftovers(root) == []


def test_rechunk_with_shards_kept_in_memory(shared_client, shm_root):
    client = shared_client
    before = file_batches(client)
    with dask.config.set({"distributed.p2p.storage.disk": False}):
        got = rechunked_checksum(client)
    x = da.random.default_rng(0).random((ARRAY_SIDE, ARRAY_SIDE), chunks=(ARRAY_SIDE, 256))
    weights = np.arange(ARRAY_SIDE, dtype=float)
    assert got == pytest.approx(float((x * weights).sum().compute(scheduler="sync")), rel=1e-12)
    assert file_batches(client) > before
    wait_for_no_leftovers(shm_root)


def test_a_handle_reaching_a_worker_that_no_longer_takes_files_asks_for_bytes():
    # A peer may have read our registry entry just before the worker stopped
    # taking shard files (its plugin torn down): stock's receive would take
    # the handle for shards and fail the run, so that wrapper stays.
    import asyncio
    import types

    from distributed.shuffle._core import ShuffleRun

    from dask_shm.shared import p2p

    # This process may have shared-mode workers of earlier tests: the state
    # found here is put back as it was.
    names = ("_send", "receive", "close")
    before = {name: getattr(ShuffleRun, name) for name in names}
    originals = dict(p2p._originals)
    stock_send = originals.get("_send", ShuffleRun._send)
    p2p.install()
    p2p.uninstall()
    try:
        assert ShuffleRun._send is stock_send
        run = types.SimpleNamespace(local_address="tcp://127.0.0.1:1")
        handle = {"relpath": "x/y.p2p", "token": "t", "size": 1, "nonce": "n"}
        reply = asyncio.run(ShuffleRun.receive(run, {p2p.HANDLE_KEY: handle}))
        assert reply[p2p.RESEND] is True
        assert reply["status"] == "error"
    finally:
        for name, method in before.items():
            setattr(ShuffleRun, name, method)
        p2p._originals.clear()
        p2p._originals.update(originals)
