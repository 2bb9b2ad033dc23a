"""Recycling of spill files (FileStore(recycle_bytes=...)): files of removed
entries are kept under hidden ``.pool-*`` names and overwritten by later puts
instead of creating new files. Only stores whose values are never mapped
recycle."""

from __future__ import annotations

import gc
import os
import random

import numpy as np
import pytest

from dask_shm import SpillBuffer
from dask_shm._core import FileStore
from dask_shm.config import spill_recycle_bytes
from dask_shm.spill_store import SpillStore

KiB = 2**10
MiB = 2**20


@pytest.fixture(params=["shm", "disk"])
def directory(request, shm_dir, tmp_path) -> str:
    """A directory on a tmpfs (where reuse saves the kernel's page
    allocation) and one on the test's temporary file system."""
    return shm_dir if request.param == "shm" else str(tmp_path)


def listing(directory: str) -> tuple[list[str], list[str], list[str]]:
    """(entries, pool files, other hidden files) in ``directory``."""
    names = os.listdir(directory)
    entries = sorted(n for n in names if not n.startswith("."))
    pool = sorted(n for n in names if n.startswith(".pool-"))
    other = sorted(n for n in names if n.startswith(".") and not n.startswith(".pool-"))
    return entries, pool, other


def payload(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype="u1")


def read_payload(store: FileStore, name: str) -> np.ndarray:
    frames = store.read(name)
    return np.frombuffer(frames[1], dtype="u1")


def test_values_survive_many_cycles_of_varying_sizes(directory):
    store = FileStore(directory, recycle_bytes=32 * MiB)
    rng = random.Random(0)
    live: dict[str, np.ndarray] = {}
    for i in range(80):
        # sizes below, around and above those of the files in the pool
        value = payload(i, rng.choice([300 * KiB, 1 * MiB, 3 * MiB, 5 * MiB]) + rng.randrange(4096))
        stored = store.put(f"k{i}", [b"header", value], memory=value.nbytes)
        assert stored is not None
        name, disk = stored
        assert os.path.getsize(store.path(name)) == disk
        live[name] = value
        if len(live) > 3:
            victim = rng.choice(sorted(live))
            np.testing.assert_array_equal(read_payload(store, victim), live.pop(victim))
            assert store.delete(victim) is not None
        for name, value in live.items():
            np.testing.assert_array_equal(read_payload(store, name), value)
        entries, pool, other = listing(directory)
        assert entries == sorted(store.names()) == sorted(live)
        assert len(pool) == store.pooled[0]
        assert not other
        # pool files are not entries: totals count only the live files
        assert store.total() == (
            sum(v.nbytes for v in live.values()),
            sum(os.path.getsize(store.path(n)) for n in live),
        )
    assert store.pooled[0] > 0
    assert 0 < store.pooled[1] <= 32 * MiB


def test_pool_is_bounded(directory):
    store = FileStore(directory, recycle_bytes=2 * MiB)
    names = []
    for i in range(6):
        stored = store.put(f"k{i}", [payload(i, 900 * KiB)], memory=1)
        assert stored is not None
        names.append(stored[0])
    for name in names:
        store.delete(name)
    files, nbytes = store.pooled
    assert files == 2 and nbytes <= 2 * MiB
    assert listing(directory) == ([], listing(directory)[1], [])
    assert len(listing(directory)[1]) == 2
    assert len(store) == 0 and store.total() == (0, 0)


def test_default_store_and_small_files_are_not_pooled(directory):
    plain = FileStore(os.path.join(directory, "plain"))
    recycling = FileStore(os.path.join(directory, "recycling"), recycle_bytes=64 * MiB)
    for store in (plain, recycling):
        for i, nbytes in enumerate([4 * MiB, 10 * KiB]):
            stored = store.put(f"k{i}", [payload(i, nbytes)], memory=1)
            assert stored is not None
            store.delete(stored[0])
    assert plain.pooled == (0, 0)
    assert os.listdir(plain.directory) == []
    assert recycling.pooled[0] == 1  # the 10 KiB file was deleted


def test_pool_files_are_deleted_with_the_store(directory):
    store = FileStore(directory, recycle_bytes=64 * MiB)
    kept = store.put("kept", [payload(0, 1 * MiB)], memory=1)
    assert kept is not None
    stored = [store.put(f"k{i}", [payload(i, (i + 1) * MiB)], memory=1) for i in range(3)]
    for s in stored:
        assert s is not None
        store.delete(s[0])
    assert store.pooled[0] == 3
    del store
    gc.collect()
    # entries' files stay as they always have; the pool is gone
    assert listing(directory) == ([kept[0]], [], [])


def test_max_disk_holds_for_entries_and_pool_together(directory):
    store = FileStore(directory, recycle_bytes=64 * MiB)
    names = []
    for i in range(4):
        stored = store.put(f"k{i}", [payload(i, 1 * MiB)], memory=1)
        assert stored is not None
        names.append(stored[0])
    for name in names:
        store.delete(name)
    assert store.pooled[0] == 4
    value = payload(9, 2 * MiB)
    stored = store.put("big", [value], memory=1, max_disk=3 * MiB)
    assert stored is not None
    on_disk = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    assert on_disk <= 3 * MiB
    np.testing.assert_array_equal(np.frombuffer(store.read(stored[0])[0], "u1"), value)


def test_a_full_file_system_gives_up_the_pool_before_refusing_a_spill():
    # A 3 MiB file pooled on a 4 MiB tmpfs: none of the later 0.9 MB values
    # fits it, and writing them fresh ran out of space, so they stayed in
    # memory (stock spills them all).
    from distributed.spill import SpillBuffer as StockSpillBuffer
    from tmpfs import small_tmpfs

    values = {f"k{i}": payload(i, 900_000) for i in range(4)}
    on_disk = {}
    for cls in (StockSpillBuffer, SpillBuffer):
        with small_tmpfs("4m") as root:
            directory = os.path.join(root, "spill")
            buf = cls(directory, target=MiB)
            buf["big"] = payload(0, 3 * MiB)  # over target: straight to disk
            del buf["big"]
            for k, v in values.items():
                buf[k] = v
            while buf.fast:
                assert buf.evict() > 0
            on_disk[cls] = set(buf.slow)
            if cls is SpillBuffer:
                assert listing(directory)[1] == [], "the pool gave its file up"
            for k, v in values.items():
                np.testing.assert_array_equal(buf[k], v)
    assert on_disk[SpillBuffer] == on_disk[StockSpillBuffer] == set(values)


def test_a_truncated_pool_file_is_rewritten_whole(directory):
    store = FileStore(directory, recycle_bytes=64 * MiB)
    for cut in [0, 1000, 3 * MiB]:
        stored = store.put("a", [payload(1, 2 * MiB)], memory=1)
        assert stored is not None
        store.delete(stored[0])
        (pooled,) = listing(directory)[1]
        os.truncate(os.path.join(directory, pooled), cut)  # 3 MiB: extended with a hole
        value = payload(2, 2 * MiB)
        stored = store.put("b", [b"h", value], memory=1)
        assert stored is not None
        name, disk = stored
        assert os.path.getsize(store.path(name)) == disk
        np.testing.assert_array_equal(read_payload(store, name), value)
        assert listing(directory)[1] == []  # the cut file was reused
        store.delete(name)


def test_a_pool_file_replaced_by_a_symlink_is_not_followed(directory, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * (4 * MiB))
    spill = os.path.join(directory, "spill")
    store = FileStore(spill, recycle_bytes=64 * MiB)
    stored = store.put("a", [payload(1, 2 * MiB)], memory=1)
    assert stored is not None
    store.delete(stored[0])
    (pooled,) = listing(spill)[1]
    os.unlink(os.path.join(spill, pooled))
    os.symlink(victim, os.path.join(spill, pooled))
    value = payload(2, 2 * MiB)
    stored = store.put("b", [b"h", value], memory=1)
    assert stored is not None
    np.testing.assert_array_equal(read_payload(store, stored[0]), value)
    assert not os.path.islink(store.path(stored[0]))
    assert victim.read_bytes() == b"v" * (4 * MiB)
    assert listing(spill) == ([stored[0]], [], [])
    assert store.pooled == (0, 0)


def test_an_entry_read_through_a_mapping_is_never_recycled(directory):
    store = FileStore(directory, recycle_bytes=64 * MiB)
    value = payload(1, 4 * MiB)
    stored = store.put("m", [b"h", value], memory=1)
    assert stored is not None
    mapped = np.frombuffer(store.read_mapped(stored[0])[1], dtype="u1")
    store.delete(stored[0])
    assert store.pooled == (0, 0)
    for i in range(4):
        other = store.put(f"o{i}", [b"h", payload(10 + i, 4 * MiB)], memory=1)
        assert other is not None
        store.delete(other[0])
    np.testing.assert_array_equal(mapped, value)


def test_spill_store_recycles_only_when_not_mapped(directory):
    budget = spill_recycle_bytes()
    private = SpillStore(os.path.join(directory, "private"), recycle_bytes=budget)
    mapped = SpillStore(os.path.join(directory, "mapped"), mapped=True, recycle_bytes=budget)
    for store in (private, mapped):
        for i in range(3):
            store[f"x{i}"] = np.full(MiB, i, dtype="u1")
            assert store[f"x{i}"].sum() == i * MiB
            del store[f"x{i}"]
    assert private.files.pooled[0] == 1
    assert 0 < private.files.pooled[1] <= budget
    assert mapped.files.pooled == (0, 0)
    assert listing(mapped.directory) == ([], [], [])


def test_memmap_buffer_values_stay_intact(directory):
    buf = SpillBuffer(directory, target=MiB, memmap=True)
    buf["x"] = np.arange(MiB, dtype="u8")
    x = buf["x"]  # a private mapping of the file
    del buf["x"]
    for i in range(5):
        buf[f"y{i}"] = np.full(MiB, i, dtype="u8")
        del buf[f"y{i}"]
    np.testing.assert_array_equal(x, np.arange(MiB, dtype="u8"))
    assert buf.store.files.pooled == (0, 0)


def test_shared_buffer_never_recycles(shm_dir, tmp_path):
    import dask

    from dask_shm.shared import SharedSpillBuffer

    settings = {"shm.shared-memory.root": shm_dir, "shm.shared-memory.disk-root": str(tmp_path)}
    with dask.config.set(settings):
        buf = SharedSpillBuffer.from_config(MiB)
        buf["x"] = np.arange(MiB, dtype="u8")
        x = buf["x"]
        del buf["x"]
        for i in range(5):
            buf[f"y{i}"] = np.full(MiB, i, dtype="u8")
            del buf[f"y{i}"]
        np.testing.assert_array_equal(x, np.arange(MiB, dtype="u8"))
        assert buf.store.tiers.tier("shared").store.pooled == (0, 0)
        assert buf.store.tiers.tier("disk").store.pooled == (0, 0)


@pytest.mark.parametrize("cycle", ["del", "unspill"])
def test_spill_buffer_steady_state(directory, cycle):
    """A worker's steady state: spill, delete or unspill (copying read), spill
    again, with values of varying sizes; every read returns what was set."""
    buf = SpillBuffer(directory, target=8 * MiB)
    rng = random.Random(1)
    expected: dict[str, np.ndarray] = {}
    for i in range(40):
        key = f"k{i}"
        expected[key] = payload(i, rng.choice([512 * KiB, 1 * MiB, 3 * MiB, 6 * MiB, 12 * MiB]))
        buf[key] = expected[key]
        if len(expected) > 4:
            victim = rng.choice(sorted(expected))
            if cycle == "unspill":
                # a copying read; one that fits in target leaves disk
                np.testing.assert_array_equal(buf[victim], expected[victim])
                victim = min(expected, key=lambda k: int(k[1:]))
            del buf[victim]
            del expected[victim]
        for key, value in expected.items():
            if key in buf.slow:
                np.testing.assert_array_equal(buf[key], value)
        files = buf.store.files
        entries, pool, other = listing(directory)
        assert entries == sorted(files.names())
        assert len(pool) == files.pooled[0]
        assert not other
        assert buf.spilled_total.disk == sum(
            os.path.getsize(os.path.join(directory, n)) for n in entries
        )
    assert buf.store.files.pooled[0] > 0


def test_reads_racing_overwrites_never_see_a_recycled_file(directory):
    """One thread keeps overwriting a key (each write removes the previous
    file, which goes to the pool and is reused by the next write) while others
    read it: a read either fails cleanly or returns one whole value."""
    import threading

    from dask_shm._core import SpillFileError

    store = SpillStore(directory, recycle_bytes=spill_recycle_bytes())
    store["s"] = np.full(MiB, 0, dtype="u8")
    stop = threading.Event()
    torn: list[object] = []
    errors: list[BaseException] = []
    reads = [0]

    def writer() -> None:
        try:
            for i in range(1, 150):
                store["s"] = np.full(MiB, i, dtype="u8")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            stop.set()

    def reader() -> None:
        while not stop.is_set():
            try:
                got = store["s"]
            except (KeyError, SpillFileError):
                continue  # removed between lookup and open: fine
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
                return
            reads[0] += 1
            if not (got == got[0]).all():
                torn.append((got[0], np.unique(got)[:5]))

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not torn, torn
    assert reads[0] > 0


def test_recycling_budget_comes_from_config(directory):
    """SpillBuffer, the edge direct users build, reads shm.spill-recycle-bytes
    unless given recycle_bytes; its store takes the value it is given."""
    import dask

    with dask.config.set({"shm.spill-recycle-bytes": 0}):
        off = SpillBuffer(os.path.join(directory, "off"), target=0)
    given = SpillBuffer(os.path.join(directory, "given"), target=0, recycle_bytes=0)
    for buf in (off, given):
        buf["x"] = np.ones(MiB, dtype="u1")  # larger than target: straight to a file
        del buf["x"]
        assert buf.store.files.pooled == (0, 0)
    on = SpillBuffer(os.path.join(directory, "on"), target=0)
    on["x"] = np.ones(MiB, dtype="u1")
    del on["x"]
    assert on.store.files.pooled[0] == 1
    with dask.config.set({"shm.spill-recycle-bytes": "lots"}):
        with pytest.raises(ValueError, match="shm.spill-recycle-bytes must be a byte size"):
            SpillBuffer(os.path.join(directory, "bad"), target=0)
    with pytest.raises(ValueError, match="recycle_bytes"):
        SpillBuffer(os.path.join(directory, "bad"), target=0, recycle_bytes="lots")
