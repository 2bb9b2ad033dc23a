"""SharedSpillBuffer in one process, on real files in /dev/shm."""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time

import dask
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dask_shm import SpillBuffer
from dask_shm._core import (
    ForgedHandleError,
    MappedFile,
    flush_deletes,
    live_mappings,
    read_peer_file,
)
from dask_shm.config import spill_compression
from dask_shm.shared import SharedSpillBuffer, paths, transfer
from dask_shm.shared.payload import read_tracking_mapping
from dask_shm.shared.store import Handle, SharedSpillStore

MB = 2**20


@pytest.fixture
def root(shm_dir, tmp_path):
    """A private shared-memory root on /dev/shm (and tier-3 root on a real
    file system) for one test."""
    settings = {"shm.shared-memory.root": shm_dir, "shm.shared-memory.disk-root": str(tmp_path)}
    with dask.config.set(settings):
        yield shm_dir
    transfer.enable_receiving(None)


def shared_buffer(target: int = 50 * MB, max_spill: int | bool = False) -> SharedSpillBuffer:
    buf = SharedSpillBuffer.from_config(target, max_spill)  # type: ignore[arg-type]
    assert buf.shared
    transfer.enable_receiving(buf)
    return buf


def store_of(buf: SharedSpillBuffer) -> SharedSpillStore:
    return buf.store


def backed_by_mapping(x: np.ndarray) -> bool:
    base = x
    while getattr(base, "base", None) is not None:
        base = base.base
        if isinstance(base, memoryview):
            base = base.obj
        if isinstance(base, MappedFile):
            return True
    return False


def test_files_live_under_the_root_and_unspill_maps_them(root):
    buf = shared_buffer()
    assert buf.spill_directory.startswith(os.path.join(root, f"dask-shm-{os.geteuid()}"))
    assert paths.filesystem_type(buf.spill_directory) == "tmpfs"
    buf["x"] = np.arange(4 * MB // 8, dtype=float)
    buf.evict()
    assert list(buf.slow) == ["x"]
    x = buf["x"]
    assert backed_by_mapping(x)
    assert x.flags.writeable and x.ctypes.data % 64 == 0
    np.testing.assert_array_equal(x, np.arange(4 * MB // 8, dtype=float))


def test_file_is_kept_while_held_and_only_private_bytes_count(root):
    buf = shared_buffer()
    buf["x"] = np.ones(8 * MB // 8)
    buf.evict()
    files_before = sorted(os.listdir(buf.spill_directory))
    x = buf["x"]
    assert "x" in buf.fast and "x" not in buf.slow
    assert sorted(os.listdir(buf.spill_directory)) == files_before  # kept
    assert buf.fast.weights["x"] == 0  # sizeof minus the mapped bytes
    # the shared bytes are reported as spilled, so nbytes - memory = private
    assert buf.spilled_total.memory == 8 * MB
    assert buf.spilled_total.disk == os.path.getsize(store_of(buf).path("x"))
    written = buf.cumulative_metrics["disk-write", "count"]
    buf.evict()  # nothing to write: the file is still there
    assert buf.cumulative_metrics["disk-write", "count"] == written
    assert list(buf.slow) == ["x"]
    del buf["x"]
    assert buf.spilled_total == (0, 0)
    flush_deletes()  # files are deleted off the caller's thread
    assert os.listdir(buf.spill_directory) == []
    np.testing.assert_array_equal(x, 1)  # a deleted file stays readable while mapped


def test_shared_bytes_by_key_names_every_key_with_shared_bytes(root):
    """The span extension's one-call hook agrees with ``shared_bytes`` on
    every key: spilled and retained keys with their files' bytes, private,
    small and pickled ones absent (0)."""
    buf = shared_buffer()
    buf["spilled"] = np.ones(2 * MB // 8)
    buf["retained"] = np.ones(4 * MB // 8)
    buf.evict()
    buf.evict()
    held = buf["retained"]  # mapped again: retained, file kept
    buf["private"] = np.ones(3 * MB // 8)
    buf["small"] = np.ones(10)
    buf["pickled"] = ["a"] * 1000
    by_key = buf.shared_bytes_by_key()
    assert by_key == {k: buf.shared_bytes(k) for k in buf if buf.shared_bytes(k)}
    assert by_key["spilled"] >= 2 * MB and by_key["retained"] >= 4 * MB
    assert "private" not in by_key and "small" not in by_key and "pickled" not in by_key
    assert all(buf.shared_bytes(k) == by_key.get(k, 0) for k in buf)
    del held


def test_writes_to_an_unspilled_array_stay_private(root):
    buf = shared_buffer()
    buf["x"] = np.zeros(MB // 8)
    buf.evict()
    path = store_of(buf).path("x")
    x = buf["x"]
    x[:] = 7  # copy-on-write: the file keeps zeros
    buf.evict()  # ... and the value, written in place, is spilled anew (as stock)
    del x
    assert (buf["x"] == 7).all()
    flush_deletes()
    assert not os.path.exists(path)


def test_replacing_a_retained_value_drops_its_file(root):
    buf = shared_buffer()
    buf["x"] = np.zeros(MB // 8)
    buf.evict()
    buf["x"]
    buf["x"] = np.ones(MB // 8)
    flush_deletes()
    assert os.listdir(buf.spill_directory) == []
    assert buf.fast.weights["x"] >= MB
    buf.evict()
    assert (buf["x"] == 1).all()


@pytest.mark.parametrize(
    "value",
    [
        pd.DataFrame({"a": np.arange(MB // 8), "b": np.ones(MB // 8)}),
        pa.table({"a": np.arange(MB // 8)}),
    ],
    ids=["pandas", "pyarrow"],
)
def test_pandas_and_arrow_data_come_back_shared(root, value):
    buf = shared_buffer()
    buf["v"] = value
    buf.evict()
    got = buf["v"]
    assert buf.fast.weights["v"] < 0.1 * MB
    if isinstance(value, pd.DataFrame):
        pd.testing.assert_frame_equal(got, value)
    else:
        assert got.equals(value)


def _collect_garbage_then(array: np.ndarray) -> np.ndarray:
    gc.collect()
    return array


class CollectsGarbageWhenLoaded:
    """Pickles as its array (an out-of-band buffer, so mapped when unspilled);
    unpickling it runs a garbage collection, in the middle of the read."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __reduce__(self):
        return _collect_garbage_then, (self.array,)


def test_a_mapping_freed_during_a_read_does_not_make_the_value_private(root):
    other = shared_buffer()
    other["w"] = np.ones(MB // 8)
    other.evict()
    garbage = [other["w"]]  # a mapped value, soon held only by a reference cycle
    del other["w"]
    buf = shared_buffer()
    buf["v"] = CollectsGarbageWhenLoaded(np.arange(MB // 8))
    buf.evict()
    was_enabled = gc.isenabled()
    gc.disable()  # the garbage goes in the read, not before it
    try:
        garbage.append(garbage)
        del garbage
        mappings = live_mappings()
        got = buf["v"]
        assert live_mappings() <= mappings  # it made one, and a collection freed ours
    finally:
        if was_enabled:
            gc.enable()
    assert backed_by_mapping(got)
    assert buf.fast.weights["v"] < 0.1 * MB  # weighed as mapped, not as a private copy
    np.testing.assert_array_equal(got, np.arange(MB // 8))


def test_a_mapping_made_by_another_thread_during_a_read_is_not_the_values(root):
    buf = shared_buffer()
    buf["x"] = np.ones(MB // 8)
    buf.evict()
    store, name = store_of(buf), store_of(buf).filenames["x"]
    held = []

    def read_a_private_copy() -> bytes:
        other = threading.Thread(target=lambda: held.append(store.map_file(name)))
        other.start()
        other.join()
        return bytes(100)

    _, backed = read_tracking_mapping(read_a_private_copy)
    assert held and not backed


def test_pickled_objects_and_small_values_stay_private(root):
    buf = shared_buffer()
    buf["strings"] = np.array(["abc"] * 100_000, dtype=object)
    buf["small"] = np.ones(10)
    buf.evict()
    buf.evict()
    assert store_of(buf).shareable == {}
    got = buf["strings"]
    assert "strings" in buf.fast and "strings" not in store_of(buf).retained
    flush_deletes()
    assert len(os.listdir(buf.spill_directory)) == 1  # its file was deleted
    assert got[0] == "abc"
    assert buf.export("strings") is None


@pytest.mark.parametrize("codec", ["zlib", "auto", False])
def test_values_read_back_by_copy_are_spilled_compressed_as_in_stock(root, tmp_path, codec):
    """``spill-compression`` applies to what shared mode reads back by copy
    (pickled objects): the same bytes spilled as stock's SpillBuffer, the
    same values back. Arrays are shared, so never compressed."""
    from distributed.spill import SpillBuffer as StockSpillBuffer

    values = {
        "text": "x" * (8 * MB),
        "objects": np.array([f"row {i % 100}" for i in range(100_000)], dtype=object),
        "array": np.zeros(MB // 8),
    }
    with dask.config.set({"distributed.worker.memory.spill-compression": codec}):
        ours = shared_buffer()
        stock = StockSpillBuffer(str(tmp_path / "stock"), target=50 * MB)
        compressing = bool(spill_compression())  # auto: lz4 if installed, else none
    for buf in (ours, stock):
        for key, value in values.items():
            buf[key] = value
        while buf.fast:
            buf.evict()
    for key in ("text", "objects"):
        assert ours.store.weight_by_key[key].disk == pytest.approx(
            stock.slow.data.weight_by_key[key].disk, rel=0.01, abs=1024
        ), key
    if compressing:
        assert ours.store.weight_by_key["text"].disk < MB
    assert ours.store.weight_by_key["array"].disk >= MB  # shared: written as it is
    assert store_of(ours).shareable.keys() == {ours.store.filenames["array"]}
    assert ours["text"] == values["text"]
    assert (ours["objects"] == values["objects"]).all()
    assert backed_by_mapping(ours["array"])
    ours.close()


def test_mapping_limit_degrades_to_copies(root):
    buf = shared_buffer()
    buf["x"] = np.ones(MB // 8)
    buf.evict()
    store_of(buf)._map_budget = 0  # as if vm.max_map_count were exhausted
    x = buf["x"]
    assert not backed_by_mapping(x)
    assert store_of(buf).degraded_reads == 1
    assert (x == 1).all()


def test_export_and_adopt_share_one_inode_and_split_accounting(root):
    sender, receiver = shared_buffer(), shared_buffer()
    sender["x"] = np.arange(MB // 8, dtype=float)  # in memory, no file yet
    handle = sender.export("x")
    assert handle is not None
    assert "x" not in sender.fast and "x" in sender.slow  # private copy dropped
    transfer.enable_receiving(receiver)
    value = transfer.receive(handle)
    os.unlink(handle.path)  # what the sender does after the handshake
    receiver["x"] = value  # claims the received file
    assert receiver.fast.weights["x"] == 0
    s_path, r_path = store_of(sender).path("x"), store_of(receiver).path("x")
    assert os.stat(s_path).st_ino == os.stat(r_path).st_ino
    assert os.stat(s_path).st_nlink == 2
    size = os.path.getsize(s_path)
    # the handle's link is gone: seen once link counts are refreshed (a
    # worker's share publisher does it every few seconds)
    assert receiver.refresh_links() == 1
    assert sender.refresh_links() == 0  # 2 since its hand-out: its own and the handle
    assert sender.spilled_total.disk + receiver.spilled_total.disk == size
    assert receiver.shm_counters["received_links"] == 1
    del sender["x"]
    flush_deletes()  # the sender's file is deleted off its thread
    receiver.refresh_links()
    assert receiver.spilled_total.disk == size
    np.testing.assert_array_equal(receiver["x"], np.arange(MB // 8, dtype=float))


def reduction_parts() -> dict[str, object]:
    """Values that are not weak-referenceable but hold arrays, as dask's
    reductions pass between workers (``mean_chunk`` returns a dict)."""
    total = np.arange(MB // 8, dtype=float)
    return {
        "dict": {"n": np.full(1, 3.0), "total": total},
        "tuple": (total, np.ones(4)),
        "list": [total, np.ones(4)],
    }


def arrays_in(value: object) -> list[np.ndarray]:
    parts = value.values() if isinstance(value, dict) else value
    return [a for a in parts if isinstance(a, np.ndarray)]  # type: ignore[union-attr]


def container_sent_by_link(
    kind: str,
) -> tuple[SharedSpillBuffer, SharedSpillBuffer, object]:
    """A sender holding ``reduction_parts()[kind]`` under "x", a receiver,
    and the value the receiver got by link (the handle's link deleted, as
    the sender does after the handshake)."""
    sender, receiver = shared_buffer(), shared_buffer()
    sender["x"] = reduction_parts()[kind]
    handle = sender.export("x")
    assert handle is not None
    value = transfer.receive(handle)
    os.unlink(handle.path)
    return sender, receiver, value


@pytest.mark.parametrize("kind", ["dict", "tuple", "list"])
def test_a_container_of_arrays_received_by_link_stays_shared(root, kind):
    """A dict, tuple or list of arrays (not weak-referenceable) is kept by
    its link like an array: one file for both workers, only private bytes
    weigh on the receiver, its eviction writes nothing, and once the sender
    drops it the receiver's file still counts its pages (none are held by
    a mapping alone, which no worker's share would count)."""
    sender, receiver, value = container_sent_by_link(kind)
    assert all(backed_by_mapping(a) for a in arrays_in(value) if a.nbytes >= MB // 2)
    receiver["x"] = value
    assert receiver.shm_counters["received_links"] == 1
    assert receiver.fast.weights["x"] < MB // 8
    s_path, r_path = store_of(sender).path("x"), store_of(receiver).path("x")
    assert os.stat(s_path).st_ino == os.stat(r_path).st_ino
    size = os.path.getsize(r_path)
    del sender["x"]
    flush_deletes()
    receiver.refresh_links()
    assert receiver.spilled_total.disk == size
    # evicted: the file is already there, nothing is written
    receiver.fast.evict("x")
    assert "x" in receiver.slow and store_of(receiver).path("x") == r_path
    del value
    got = receiver["x"]
    expected = reduction_parts()[kind]
    for a, b in zip(arrays_in(got), arrays_in(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def total_of(value: object) -> np.ndarray:
    """The large array of a :func:`reduction_parts` value."""
    return value["total"] if isinstance(value, dict) else value[0]  # type: ignore[index]


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_a_received_container_written_in_place_keeps_the_write_as_in_stock(root, kind):
    """A task that writes into an array of a received container: the
    receiver still sees the write after the value was evicted and read back
    (its file no longer holds the value, so eviction writes it anew), the
    sender's value is untouched, and a third worker gets the written value."""
    sender, receiver, value = container_sent_by_link(kind)
    receiver["x"] = value
    total_of(value)[0] = 99.0
    receiver.fast.evict("x")
    del value
    assert total_of(receiver["x"])[0] == 99.0
    assert total_of(sender["x"])[0] == 0.0
    handle = receiver.export("x")
    assert handle is not None
    third = shared_buffer()  # receives the handles from now on
    got = transfer.receive(handle)
    os.unlink(handle.path)
    assert total_of(got)[0] == 99.0
    third["x"] = got
    assert third.shm_counters["received_links"] == 1


def test_an_arrival_dropped_while_the_buffer_is_busy_never_blocks_the_dropper(root):
    # The file of an arrival that dies unstored is deleted by a finalizer, in
    # whatever thread drops the value: it must not wait there for the
    # buffer's lock (that thread may hold a lock the lock's holder needs).
    _, receiver, value = container_sent_by_link("dict")
    directory = store_of(receiver).directory
    busy, release = threading.Event(), threading.Event()

    def hold_the_buffer() -> None:
        with receiver._operation_lock:
            busy.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_buffer)
    holder.start()
    busy.wait(10)
    box = [value]
    del value
    dropper = threading.Thread(target=box.clear)  # drops the last reference
    dropper.start()
    dropper.join(10)
    blocked = dropper.is_alive()
    release.set()
    holder.join()
    assert not blocked, "the finalizer waited for the busy buffer"
    deadline = time.monotonic() + 10
    while receiver.pending_arrivals():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    flush_deletes()
    assert os.listdir(directory) == []


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_a_received_container_dropped_before_it_is_stored_leaves_no_file(root, kind):
    """A fetch cancelled after the value arrived: its file goes once the
    value (a container, not weak-referenceable) is garbage."""
    _, receiver, value = container_sent_by_link(kind)
    assert receiver.pending_arrivals() == 1
    directory = store_of(receiver).directory
    assert len(os.listdir(directory)) == 1
    del value
    gc.collect()
    flush_deletes()
    assert receiver.pending_arrivals() == 0
    assert os.listdir(directory) == []
    assert receiver.shm_counters["abandoned_arrivals"] == 1


def forged_handles(root: str, genuine: Handle, outside: str) -> dict[str, tuple[str, int]]:
    stolen = os.path.join(outside, "copy")
    with open(genuine.path, "rb") as src, open(stolen, "wb") as dst:
        dst.write(src.read())
    link = os.path.join(os.path.dirname(genuine.path), "sneaky")
    os.symlink(genuine.path, link)
    return {
        "outside the root": (stolen, genuine.size),
        "a symlink": (link, genuine.size),
        "another size": (genuine.path, genuine.size + 64),
        "dot-dot escape": (os.path.join(root, "..", "..", "etc", "passwd"), 100),
        "a directory": (root, 4096),
    }


def test_forged_handles_are_refused(root, tmp_path_factory):
    outside = tempfile.mkdtemp(dir="/dev/shm", prefix="dask-shm-outside-")
    try:
        refuse_forgeries(root, outside)
    finally:
        import shutil

        shutil.rmtree(outside, ignore_errors=True)


def refuse_forgeries(root: str, outside: str) -> None:
    sender = shared_buffer()
    sender["x"] = np.ones(MB // 8)
    genuine = sender.export("x")
    assert genuine is not None
    for why, (path, size) in forged_handles(root, genuine, outside).items():
        with pytest.raises(ForgedHandleError, match="refused shared-memory handle"):
            transfer.receive(Handle(path, size, MB, MB))
        with pytest.raises(ForgedHandleError):
            read_peer_file(root, path, size)
        assert why  # each case refused


def test_fallback_copy_reads_a_valid_handle(root):
    sender = shared_buffer()
    sender["x"] = np.arange(1000, dtype=float) * np.ones((200, 1))
    handle = sender.export("x")
    assert handle is not None
    frames = read_peer_file(root, handle.path, handle.size)
    from dask_shm.spill_store import frames_to_object

    np.testing.assert_array_equal(frames_to_object(frames), sender["x"])


def test_unusable_root_is_refused_clearly(tmp_path):
    not_tmpfs = tempfile.mkdtemp(dir="/work" if os.path.isdir("/work") else "/var/tmp")
    try:
        with dask.config.set({"shm.shared-memory.root": not_tmpfs}):
            with pytest.raises(paths.UnusableRoot, match="not tmpfs"):
                SharedSpillBuffer.from_config(MB)
        with pytest.raises(TypeError, match="SharedSpillBuffer"):
            SpillBuffer(str(tmp_path / "spill"), target=MB, shared=True)
    finally:
        os.rmdir(not_tmpfs)


def test_dead_process_directories_are_swept(root):
    base = paths.user_root(root)
    dead = os.path.join(base, paths.ProcessIdentity(2**22 + 12345, 1).dirname)
    os.makedirs(os.path.join(dead, "w-1"))
    open(os.path.join(dead, "w-1", "x#0"), "w").close()
    alive = paths.process_dir(root)
    assert dead in paths.sweep_dead_processes(root)
    assert not os.path.exists(dead) and os.path.isdir(alive)


def test_truncated_shared_file_raises_naming_the_key(root):
    from dask_shm import SpillFileError

    buf = shared_buffer()
    buf["x"] = np.ones(MB // 8)
    buf.evict()
    with open(store_of(buf).path("x"), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(SpillFileError, match="'x'"):
        buf["x"]
    del buf["x"]
    flush_deletes()
    assert os.listdir(buf.spill_directory) == []


def test_many_threads_keep_values_and_accounting_consistent(root):
    import random
    import threading

    buf = shared_buffer(target=4 * MB)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine = [f"t{seed}-{i}" for i in range(6)]  # each thread owns its keys
        try:
            for _ in range(300):
                key = rng.choice(mine)
                op = rng.random()
                if op < 0.4:
                    buf[key] = np.full(rng.choice([16, 64 * 1024, 256 * 1024]), hash(key) % 97.0)
                elif op < 0.7 and key in buf:
                    assert (buf[key] == hash(key) % 97.0).all()
                elif op < 0.85 and key in buf:
                    del buf[key]
                else:
                    buf.evict()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    flush_deletes()  # files of 1 MiB or more are deleted on the unlinking thread
    store = store_of(buf)
    names = set(store.filenames.values()) | {r.name for r in store.retained.values()}
    assert names == set(os.listdir(buf.spill_directory))
    expected_disk = sum(os.path.getsize(os.path.join(buf.spill_directory, n)) for n in names)
    assert buf.spilled_total.disk == expected_disk
    for key in list(buf):
        assert (buf[key] == hash(key) % 97.0).all()


def test_max_spill_bounds_spilled_files_not_those_of_values_read_back(root, caplog):
    # A value read back through a mapping keeps its file (stock deletes it);
    # counted against max_spill, those files once left no room to spill
    # anything else, and a worker paused for good where stock finished.
    buf = shared_buffer(target=4 * MB, max_spill=int(3.5 * MB))
    values = {f"k{i}": np.full(MB // 8, float(i)) for i in range(9)}
    for k in list(values)[:6]:
        buf[k] = values[k]
    for k in ["k0", "k1", "k2"]:
        np.testing.assert_array_equal(buf[k], values[k])  # read back: retained
    assert set(buf.store.retained) == {"k0", "k1", "k2"}
    for k in ["k6", "k7", "k8"]:
        buf[k] = values[k]
    spilled = {k: buf.store.files.sizes(buf.store.filenames[k])[1] for k in buf.slow}
    assert len(spilled) >= 3, "nothing could be spilled"
    assert sum(spilled.values()) <= 3.5 * MB  # and the limit holds for them
    for k, v in values.items():
        np.testing.assert_array_equal(buf[k], v)
