"""Issue 24: what cannot be read never hangs a computation.

- a spilled file that vanished or was tampered with: a task needing its key,
  on another worker or on the holder itself, fails within seconds with
  :class:`dask_shm.SpillFileError` naming the key (stock distributed leaves a
  consumer on another worker waiting forever);
- a handle that cannot be resolved (forged, not found, no receiving buffer)
  never raises while a message is deserialized: it is a key missing on that
  peer, fetched again as bytes, and the result is correct.

Real worker processes, real files on /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import dask
import numpy as np
import pytest
from distributed import wait
from distributed.protocol import deserialize, serialize

from dask_shm import SharedMemoryPlugin, SpillFileError
from dask_shm._core import flush_deletes
from dask_shm.shared import SharedSpillBuffer, transfer
from dask_shm.shared.store import Handle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clusters import process_cluster, worker_addresses  # noqa: E402
from test_shared_buffer import forged_handles  # noqa: E402

MB = 2**20


@pytest.fixture
def root(shm_dir):
    with dask.config.set({"shm.shared-memory.root": shm_dir}):
        yield shm_dir


def _spill_and_damage(dask_worker, key: str, damage: str) -> str:
    """Spill ``key`` (the worker's only value) to its file and damage the file."""
    buf = dask_worker.data
    buf.evict()
    path = buf.store.path(key)
    assert key in buf.store.filenames, "spilled, not held in memory"
    if damage == "vanished":
        os.unlink(path)
        return path
    os.chmod(path, 0o600)  # (the file is 0400: as root we write anyway)
    time.sleep(0.02)  # past the file system's timestamp granularity
    with open(path, "r+b") as f:
        if damage == "truncated":
            f.truncate(os.fstat(f.fileno()).st_size // 2)
        else:
            f.seek(-4096, os.SEEK_END)
            f.write(b"\xff" * 4096)
    return path


def _total(v: np.ndarray) -> float:
    return float(v.sum())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("damage", ["vanished", "truncated", "overwritten"])
def test_an_unreadable_spilled_value_fails_its_consumers_naming_the_key(root, damage) -> None:
    with process_cluster(2, "1 GiB") as client:
        client.register_plugin(SharedMemoryPlugin(root=root))
        a, b = worker_addresses(client)
        x = client.submit(np.full, 2 * MB // 8, 1.0, workers=[a], key="x")
        wait(x)
        client.run(_spill_and_damage, key="x", damage=damage, workers=[a])
        remote = client.submit(_total, x, workers=[b], key="on-the-other-worker")
        with pytest.raises(SpillFileError, match="'x'"):
            remote.result(timeout=20)
        local = client.submit(_total, x, workers=[a], key="on-the-holder")
        with pytest.raises(SpillFileError, match="'x'"):
            local.result(timeout=20)
        # The holder still answers: a healthy value crosses as before.
        z = client.submit(np.full, 2 * MB // 8, 2.0, workers=[a], key="z")
        assert client.submit(_total, z, workers=[b]).result(timeout=20) == 2 * MB // 4


def test_unresolvable_handles_deserialize_without_raising(root) -> None:
    """Every forgery, a vanished file and a handle arriving where no buffer
    receives: deserialization returns a marker, links nothing, raises nothing."""
    sender = SharedSpillBuffer.from_config(2**30)
    receiver = SharedSpillBuffer.from_config(2**30)
    outside = tempfile.mkdtemp(dir="/dev/shm", prefix="dask-shm-outside-")
    try:
        sender["x"] = np.ones(MB // 8)
        genuine = sender.export("x")
        assert genuine is not None
        cases = {
            why: Handle(path, size, MB, MB)
            for why, (path, size) in forged_handles(root, genuine, outside).items()
        }
        cases["vanished"] = Handle(genuine.path + "-gone", genuine.size, MB, MB)
        for why, handle in cases.items():
            with transfer.receiving_into(receiver):
                got = deserialize(*serialize(handle, serializers=["dask"]))
            assert isinstance(got, transfer.Unresolved), why
            assert receiver.pending_arrivals() == 0, why
        transfer.enable_receiving(None)
        assert isinstance(
            deserialize(*serialize(genuine, serializers=["dask"])), transfer.Unresolved
        )
        flush_deletes()
        assert os.listdir(receiver.store.directory) == []
    finally:
        sender.close()
        receiver.close()
        shutil.rmtree(outside, ignore_errors=True)


def _forge_exports(dask_worker, outside: str, forgery: str = "copy") -> None:
    """Make this worker hand out forged handles (what a buggy or hostile peer
    would send): to copies of its files outside the shared-memory directory
    (``copy``), or to paths with a NUL byte in a directory (``nul``)."""
    buf = dask_worker.data
    genuine = buf.hand_over  # what the sender calls

    def forged(key, tiers=(2, 3)):
        handle = genuine(key, tiers)
        if not isinstance(handle, Handle):
            return handle
        if forgery == "nul":
            directory, name = os.path.split(handle.path)
            path = os.path.join(directory + "\x00", name)
        else:
            path = os.path.join(outside, os.path.basename(handle.path))
            shutil.copyfile(handle.path, path)
        return Handle(path, handle.size, handle.memory, handle.shareable, handle.stem)

    buf.hand_over = forged


FORGERIES = ["copy", "nul"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_handle_is_a_failed_fetch_then_bytes(root, forgery) -> None:
    # (A NUL byte once raised again after deserialization, while the peer
    # was asked for bytes: the fetch never ended.)
    outside = tempfile.mkdtemp(dir="/dev/shm", prefix="dask-shm-outside-")
    try:
        with process_cluster(2, "1 GiB") as client:
            client.register_plugin(SharedMemoryPlugin(root=root))
            a, b = worker_addresses(client)
            client.run(_forge_exports, outside=outside, forgery=forgery, workers=[a])
            x = client.submit(np.full, 2 * MB // 8, 3.0, workers=[a], key="x")
            y = client.submit(_total, x, workers=[b], key="y")
            assert y.result(timeout=30) == 3.0 * (2 * MB // 8)
            counters = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
            # refused until the sender's view of the registry expires (2 s), then bytes
            assert counters[b]["unresolved_handles"] >= 1, counters
            assert counters[b]["received_links"] == 0, counters
            assert counters[a]["fallback_transfers"] == 1, counters
    finally:
        shutil.rmtree(outside, ignore_errors=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_handle_in_replicate_is_left_out_then_bytes(root, forgery) -> None:
    """The scheduler's replicate fetches through Worker.gather, not
    gather_dep: the unresolvable key is not stored, and the retry gets bytes."""
    outside = tempfile.mkdtemp(dir="/dev/shm", prefix="dask-shm-outside-")
    try:
        with process_cluster(2, "1 GiB") as client:
            client.register_plugin(SharedMemoryPlugin(root=root))
            a, b = worker_addresses(client)
            client.run(_forge_exports, outside=outside, forgery=forgery, workers=[a])
            x = client.submit(np.full, 2 * MB // 8, 4.0, workers=[a], key="x")
            wait(x)
            client.replicate([x], n=2)
            held = client.run(lambda dask_worker: float(dask_worker.data["x"].sum()))
            assert held == {a: 4.0 * (2 * MB // 8), b: 4.0 * (2 * MB // 8)}
            counters = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
            assert counters[b]["received_links"] == 0, counters
            assert counters[b]["unresolved_handles"] >= 1, counters
    finally:
        shutil.rmtree(outside, ignore_errors=True)
