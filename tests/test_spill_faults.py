"""Fault handling: full disks, vanished directories, max_spill, damaged files,
and many threads at once. Nothing may be lost and no internal error may leak."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import shutil
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from distributed.utils import RateLimiterFilter

from dask_shm import SpillBuffer, SpillFileError


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Make writes beyond ``nbytes`` fail with EFBIG, like a full disk.
    (CPython ignores SIGXFSZ, so the write returns an error instead.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def entry_files(directory) -> list[str]:
    """Files of spilled keys (hidden ``.pool-*`` files kept for reuse are not entries)."""
    return [n for n in os.listdir(directory) if not n.startswith(".")]


def test_full_disk_keeps_data_in_memory_and_logs(tmp_path, caplog):
    buf = SpillBuffer(str(tmp_path), target=20_000)
    small = np.arange(1_000)  # 8 kB: fits under the limit
    big = np.arange(10_000)  # 80 kB: cannot be written
    with file_size_limit(50_000), caplog.at_level(logging.ERROR, logger="distributed.spill"):
        buf["big"] = big  # heavier than target: goes to disk, fails, stays in memory
        assert "big" in buf.fast and "big" not in buf.slow
        buf["a"] = small
        buf["b"] = small
        assert buf.evict() == -1  # "big" is the oldest and still cannot be written
    assert "Spill to disk failed; keeping data in memory" in caplog.text
    # No partial file was left and nothing was accounted for the failed writes.
    assert buf.spilled_total == (0, 0)
    assert entry_files(tmp_path) == []
    # Once space is back, spilling works again and every value is intact.
    assert buf.evict() > 0
    assert set(buf.slow) == {"big"}
    np.testing.assert_array_equal(buf["big"], big)
    np.testing.assert_array_equal(buf["a"], small)


def test_spill_directory_removed_mid_run(tmp_path, caplog):
    directory = tmp_path / "spill"
    buf = SpillBuffer(str(directory), target=10_000)
    buf["a"] = np.zeros(1_000)
    buf["b"] = np.zeros(1_000)  # "a" is spilled
    shutil.rmtree(directory)
    with caplog.at_level(logging.ERROR, logger="distributed.spill"):
        buf["c"] = np.zeros(1_000)  # spilling "b" fails: the directory is gone
    assert "b" in buf.fast and "c" in buf.fast
    # The value whose file vanished is reported with its key, not lost silently.
    with pytest.raises(SpillFileError, match="'a'"):
        buf["a"]
    assert "a" in buf
    del buf["a"]
    assert buf.spilled_total == (0, 0)
    assert (buf["b"] == 0).all() and (buf["c"] == 0).all()


def test_max_spill_reached_keeps_data_in_memory(tmp_path, caplog):
    # distributed logs this warning at most every 10 s: an earlier test may have used it.
    RateLimiterFilter.reset_timer("distributed.spill")
    buf = SpillBuffer(str(tmp_path), target=10_000, max_spill=30_000)
    with caplog.at_level(logging.WARNING, logger="distributed.spill"):
        for i in range(10):
            buf[f"k{i}"] = np.full(1_000, i)  # 8 kB each
    assert "Spill file on disk reached capacity; keeping data in memory" in caplog.text
    assert 0 < buf.spilled_total.disk <= 30_000
    assert len(buf.slow) == 3
    assert len(buf) == 10
    for i in range(10):
        assert (buf[f"k{i}"] == i).all()
    # A value too large for memory that cannot go to disk stays in memory too.
    buf["huge"] = np.zeros(50_000)
    assert "huge" in buf.fast
    assert buf.spilled_total.disk <= 30_000


@pytest.mark.parametrize("damage", ["truncate", "extend", "garbage", "delete", "foreign"])
def test_damaged_spill_file_gives_a_clear_error_naming_the_key(tmp_path, damage):
    buf = SpillBuffer(str(tmp_path), target=100)
    buf["victim"] = np.arange(1_000)
    buf["bystander"] = np.arange(1_000) * 2
    path = buf.store.path("victim")
    size = os.path.getsize(path)
    if damage == "truncate":
        os.truncate(path, size // 2)
    elif damage == "extend":
        with open(path, "ab") as f:
            f.write(b"\0" * 10)
    elif damage == "garbage":
        # Keep the header valid; scramble the serialization header frame.
        with open(path, "r+b") as f:
            f.seek(64)
            f.write(b"\xff" * 32)
    elif damage == "delete":
        os.remove(path)
    else:
        with open(path, "wb") as f:
            f.write(b"not a spill file at all" * 10)
    with pytest.raises(SpillFileError, match="'victim'"):
        buf["victim"]
    # The buffer is unharmed: other keys read fine, the key can be deleted.
    np.testing.assert_array_equal(buf["bystander"], np.arange(1_000) * 2)
    assert "victim" in buf
    del buf["victim"]
    assert "victim" not in buf
    assert set(buf.store.weight_by_key) == {"bystander"}


def hammer_from_threads(buf: SpillBuffer, n_threads: int = 8) -> tuple[list, list, dict]:
    """Each thread sets/gets/deletes its own keys (and races on shared keys)
    while evictions run from every thread. Returns (errors, stale reads,
    expected final values of the private keys)."""
    errors: list[BaseException] = []
    stale: list[tuple[str, int, int]] = []
    expected: dict[str, int] = {}
    lock = threading.Lock()

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for i in range(300):
                key = f"t{tid}-{rng.randrange(20)}"
                op = rng.random()
                if op < 0.5:
                    value = rng.randrange(1_000_000)
                    buf[key] = np.full(rng.choice([100, 2_000, 30_000]), value)
                    with lock:
                        expected[key] = value
                elif op < 0.8:
                    with lock:
                        want = expected.get(key)
                    if want is not None:
                        got = int(buf[key][0])
                        if got != want:
                            stale.append((key, want, got))
                else:
                    with lock:
                        present = expected.pop(key, None) is not None
                    if present:
                        del buf[key]
                if i % 50 == 0 and buf.fast:
                    buf.evict()
                # Shared keys: racing writers; none may be lost.
                buf[f"shared-{i % 5}"] = np.full(500, tid)
        except BaseException as e:  # pragma: no cover - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, stale, expected


def test_many_threads_at_once_leave_consistent_totals(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=200_000)
    errors, _, expected = hammer_from_threads(buf)
    assert not errors, errors

    assert set(buf) == set(expected) | {f"shared-{i}" for i in range(5)}
    for key in expected:
        assert buf[key].shape[0] in (100, 2_000, 30_000)
    slow = buf.store
    on_disk = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in entry_files(tmp_path))
    assert buf.spilled_total.disk == on_disk
    assert len(entry_files(tmp_path)) == len(buf.slow)
    assert sum(w.disk for w in slow.weight_by_key.values()) == on_disk
    assert buf.fast.total_weight == sum(buf.fast.weights.values())
    for key in list(buf):
        del buf[key]
    assert buf.spilled_total == (0, 0)
    assert entry_files(tmp_path) == []


def test_many_threads_never_read_a_superseded_value(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=200_000)
    errors, stale, expected = hammer_from_threads(buf)
    assert not errors, errors
    assert not stale, stale[:5]
    for key, value in expected.items():
        assert int(buf[key][0]) == value


def test_spill_store_from_many_threads_keeps_totals_exact(tmp_path):
    """Our layer under zict: concurrent writes, reads, overwrites and deletes of
    SpillStore (the Rust store plus its key map) keep every value intact and
    the accounting equal to the files on disk."""
    store = SpillBuffer(str(tmp_path), target=1).store
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        mine: dict[str, int] = {}
        try:
            for i in range(300):
                key = f"t{tid}-{rng.randrange(15)}"
                op = rng.random()
                if op < 0.5:
                    value = rng.randrange(1_000_000)
                    store[key] = np.full(rng.choice([10, 2_000, 30_000]), value)
                    mine[key] = value
                elif op < 0.8 and key in mine:
                    assert int(store[key][0]) == mine[key]
                elif key in mine:
                    del store[key]
                    del mine[key]
                store[f"shared-{i % 4}"] = np.full(100, tid)  # racing overwrites
            for key, value in mine.items():
                assert int(store[key][0]) == value
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    names = entry_files(tmp_path)
    assert len(names) == len(store)  # racing overwrites left no orphan file
    on_disk = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in names)
    assert store.total_weight.disk == on_disk
    assert sum(w.disk for w in store.weight_by_key.values()) == on_disk
    for key in list(store):
        del store[key]
    assert store.total_weight == (0, 0)
    assert entry_files(tmp_path) == []
