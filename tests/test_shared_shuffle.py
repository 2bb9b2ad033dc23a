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
    """Batch files, and run directories of live workers, under ``root``
    (not a live worker's directory of idle batch files)."""
    user = os.path.join(root, f"dask-shm-{os.geteuid()}")
    return sorted(
        glob.glob(os.path.join(user, "**", "*.p2p"), recursive=True)
        + [
            path
            for path in glob.glob(os.path.join(user, "*", "p2p", "*", "*"))
            if os.path.basename(path) != "idle"
        ]
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


def refuse_every_third_batch(dask_worker) -> None:
    """Make this worker refuse every third batch file it is handed (as a
    receiver that cannot read it would: the sender resends the batch as
    bytes) and log, for each, the file's inode and when it was read or
    refused. Undone by :func:`take_batch_log`."""
    from dask_shm.shared import shard_file

    original = shard_file.read_copy
    log: list[tuple[str, int, float]] = []

    def read_copy(path: str, size: int, nonce: str):
        inode = os.stat(path).st_ino
        if len(log) % 3 == 2:
            log.append(("refused", inode, time.monotonic()))
            raise shard_file.ShardFileError("refused by the test")
        batch = original(path, size, nonce)
        log.append(("read", inode, time.monotonic()))
        return batch

    shard_file.read_copy = read_copy
    dask_worker._test_batch_log = (original, log)


def take_batch_log(dask_worker) -> list[tuple[str, int, float]]:
    from dask_shm.shared import shard_file

    original, log = dask_worker._test_batch_log
    shard_file.read_copy = original
    del dask_worker._test_batch_log
    return log


def test_a_batch_file_is_written_again_only_after_its_receiver_answered_ok(shared_client, shm_root):
    # The sender writes its next batch into a file its receiver answered OK
    # for (the pages stay allocated); a file whose call ended otherwise is
    # unlinked, since its receiver may still be reading it. On the machine's
    # one monotonic clock: an inode refused is never handed over again.
    client = shared_client
    counters_before = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
    # The bench's rechunk_p2p, smaller: 2 MiB squares into 256 KiB columns,
    # 64 batches of ~1 MiB from each worker.
    x = da.random.default_rng(1).random((4096, 4096), chunks=(512, 512))
    weights = np.arange(4096, dtype=float)
    with dask.config.set({"array.rechunk.method": "p2p", "array.chunk-size": "256KiB"}):
        rows = x.rechunk((-1, "auto"))
    client.run(refuse_every_third_batch)
    try:
        got = float((rows * weights).sum().compute())
    finally:
        logs = client.run(take_batch_log)
    assert got == pytest.approx(float((x * weights).sum().compute(scheduler="sync")), rel=1e-12)
    events = sorted((t, what, inode) for log in logs.values() for what, inode, t in log)
    refused = {inode: t for t, what, inode in events if what == "refused"}
    assert refused, events
    assert [e for e in events if e[2] in refused and e[0] > refused[e[2]]] == []
    reads = [inode for _, what, inode in events if what == "read"]
    assert len(set(reads)) < len(reads), "no batch file was written twice"
    counters = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
    reused = sum(
        c["p2p_reused_file_batches"] - counters_before[a].get("p2p_reused_file_batches", 0)
        for a, c in counters.items()
    )
    fallbacks = sum(
        c["p2p_file_fallbacks"] - counters_before[a]["p2p_file_fallbacks"]
        for a, c in counters.items()
    )
    assert reused > 0 and fallbacks == len(refused), counters
    wait_for_no_leftovers(shm_root)


def hold_outputs(dask_worker) -> None:
    """Make this worker's P2P output tasks wait until :func:`release_outputs`."""
    import threading

    from distributed.shuffle._core import ShuffleRun

    entered, release = threading.Event(), threading.Event()
    original = ShuffleRun.get_output_partition

    def get_output_partition(self, *args, **kwargs):
        entered.set()
        release.wait(120)
        return original(self, *args, **kwargs)

    ShuffleRun.get_output_partition = get_output_partition
    dask_worker._test_held_outputs = (original, entered, release)


def outputs_held(dask_worker) -> bool:
    """Whether an output task of this worker waits in :func:`hold_outputs`."""
    return dask_worker._test_held_outputs[1].is_set()


def release_outputs(dask_worker) -> None:
    from distributed.shuffle._core import ShuffleRun

    original, _, release = dask_worker._test_held_outputs
    ShuffleRun.get_output_partition = original
    release.set()
    del dask_worker._test_held_outputs


def barriers_passed(dask_scheduler) -> bool:
    barriers = [ts for ts in dask_scheduler.tasks.values() if ts.prefix.name == "shuffle-barrier"]
    return bool(barriers) and all(ts.state == "memory" for ts in barriers)


def test_a_run_that_sent_its_last_batch_keeps_no_idle_batch_file(shared_client, shm_root):
    # While its outputs are read a run sends nothing: once no run of the
    # worker sends, the files kept for later batches go, not when runs close.
    client = shared_client
    # rows into columns: 64 batches of ~1 MiB from each worker
    x = da.random.default_rng(2).random((4096, 4096), chunks=(64, 4096))
    with dask.config.set({"array.rechunk.method": "p2p", "array.chunk-size": "2MiB"}):
        total = x.rechunk((4096, 64)).sum()
    client.run(hold_outputs)
    try:
        future = client.compute(total)
        deadline = time.monotonic() + 120
        # Every run past its barrier (each worker's inputs_done has returned),
        # output tasks waiting on each worker.
        while not (
            all(client.run(outputs_held).values()) and client.run_on_scheduler(barriers_passed)
        ):
            assert not future.done(), future
            assert time.monotonic() < deadline, "the rechunk never reached its outputs"
            time.sleep(0.05)
        reused = client.run(
            lambda dask_worker: dask_worker.data.shm_counters["p2p_reused_file_batches"]
        )
        assert sum(reused.values()) > 0, reused
        runs = glob.glob(os.path.join(shm_root, "dask-shm-*", "*", "p2p", "*", "*"))
        assert runs, "the run's directories are gone: it closed early"
        assert glob.glob(os.path.join(shm_root, "**", "*.p2p"), recursive=True) == []
    finally:
        client.run(release_outputs)
    assert future.result(timeout=120) == pytest.approx(
        float(x.sum().compute(scheduler="sync")), rel=1e-12
    )
    del future
    wait_for_no_leftovers(shm_root)


def test_a_worker_keeps_few_idle_batch_files(tmp_path):
    from dask_shm.shared.p2p import POOL_BYTES, POOL_FILES, BatchFilePool

    idle = tmp_path / "idle"
    idle.mkdir()

    def batch_file(name: str) -> str:
        path = tmp_path / name
        path.write_bytes(b"x")
        return str(path)

    pool = BatchFilePool(str(idle))
    assert pool.take() is None
    assert all(pool.give(batch_file(f"f{i}"), 1) for i in range(POOL_FILES))
    assert not pool.give(batch_file("one-too-many"), 1)
    assert len(os.listdir(idle)) == POOL_FILES  # moved out of their run's directory
    path, size = pool.take()  # the last given, its pages warmest
    assert os.path.dirname(path) == str(idle) and size == 1 and pool.nbytes == POOL_FILES - 1
    pool.drain()
    assert os.listdir(idle) == [path.rsplit("/", 1)[1]] and pool.take() is None
    assert pool.give(batch_file("a"), POOL_BYTES // 2) and pool.give(
        batch_file("b"), POOL_BYTES // 2
    )
    assert not pool.give(batch_file("c"), 1) and pool.nbytes == POOL_BYTES
    assert not BatchFilePool(str(idle)).give(batch_file("huge"), POOL_BYTES + 1)
    assert not pool.give(str(tmp_path / "gone"), 0)  # a file that cannot be moved


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
    names = ("_send", "receive", "inputs_done", "close")
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
