"""Arrays born shared: numpy allocations served from tmpfs files (real /dev/shm
files, real mappings, real numpy handler API)."""

from __future__ import annotations

import contextvars
import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dask
import numpy as np
import psutil
import pytest
from clusters import process_cluster, worker_addresses
from distributed.utils_test import gen_cluster, gen_test
from tmpfs import shmem_forced_huge

from dask_shm._core import born_stats, flush_deletes, read_peer_file
from dask_shm.shared import born, born_worker, paths
from dask_shm.spill_store import frames_to_object, serialize_unsplit

MiB = 1 << 20

try:  # numpy 2 moved numpy.core to numpy._core; dask-shm supports 1.26 too
    from numpy._core.multiarray import get_handler_name
except ImportError:
    from numpy.core.multiarray import get_handler_name


def handler_name(a: np.ndarray | None = None) -> str:
    return get_handler_name() if a is None else get_handler_name(a)


@pytest.fixture
def arena(shm_dir: str) -> Iterator[str]:
    """The process arena serving >= 1 MiB from a fresh directory; stopped after."""
    directory = os.path.join(paths.user_root(shm_dir), "born")  # where workers put it
    os.mkdir(directory, 0o700)
    born.start(directory, threshold=MiB, budget=256 * MiB)
    try:
        yield directory
    finally:
        born.stop()


def files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_large_allocations_come_from_files_small_ones_do_not(arena: str) -> None:
    before = handler_name()
    with born.allocating():
        assert handler_name() == "dask_shm_born_shared"
        big = np.ones(2 * MiB // 8)
        small = np.ones(1000)
        just_below = np.empty(MiB - 1, dtype=np.uint8)
    assert handler_name() == before
    outside = np.ones(2 * MiB // 8)

    block = born.block_of(big)
    assert block is not None and block.length == 2 * MiB and not block.sealed
    assert files(arena) == [os.path.basename(block.path)]
    st = os.stat(block.path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == born._core.born_header_size() + 2 * MiB
    assert born.block_of(small) is None
    assert born.block_of(just_below) is None
    assert born.block_of(outside) is None
    assert big.sum() == 2 * MiB // 8
    # A view of a block is found; only the whole array is a whole block.
    assert born.block_of(big[10:20]) == block
    assert born.whole_block(big[10:20]) is None
    assert born.whole_block(big) == block


def test_free_keeps_blocks_for_reuse_until_released(arena: str) -> None:
    with born.allocating():
        # In use throughout: the cache holds no more than the arrays in use.
        in_use = np.zeros(8 * MiB, dtype=np.uint8)
        arrays = [np.full(MiB, i, dtype=np.uint8) for i in range(5)]
    assert len(files(arena)) == 6
    before = born.stats()
    del arrays
    after = born.stats()
    assert after["blocks"] == 1 and after["bytes"] == 8 * MiB and after["owned_bytes"] == 8 * MiB
    assert after["freed"] - before["freed"] == 5
    # Kept, files and mappings intact, and still the arena's own memory.
    assert len(files(arena)) == 6
    assert after["cached_blocks"] == 5 and after["cached_bytes"] == 5 * MiB
    assert born.own_bytes() == 13 * MiB
    assert born.release_cache() == 5 * MiB
    assert files(arena) == [os.path.basename(born.block_of(in_use).path)]
    s = born.stats()
    assert s["cached_blocks"] == 0 and s["cached_bytes"] == 0
    assert s["evicted"] - after["evicted"] == 5


def test_freed_blocks_beyond_the_arrays_in_use_are_released(arena: str) -> None:
    with born.allocating():
        arrays = [np.full(MiB, i, dtype=np.uint8) for i in range(4)]
    newest = os.path.basename(born.block_of(arrays[3]).path)
    del arrays[:2]  # 2 MiB freed, 2 MiB in use: both kept
    assert born.stats()["cached_blocks"] == 2
    del arrays[0]  # 3 MiB freed, 1 MiB in use: the oldest two go
    assert born.stats()["cached_blocks"] == 1
    # Nothing in use (a graph's keys released): only the newest freed block
    # stays, for the next allocation or until the decay.
    del arrays[0]
    s = born.stats()
    assert s["cached_blocks"] == 1 and s["cached_bytes"] == MiB
    assert files(arena) == [newest]


def test_cached_blocks_unused_for_the_decay_are_released(arena: str) -> None:
    born.start(arena, threshold=MiB, budget=256 * MiB, cache_decay=0.2)
    with born.allocating():
        x = np.full(MiB, 1, dtype=np.uint8)
    del x
    assert born.stats()["cached_bytes"] == MiB
    assert born.release_expired() == 0  # not yet
    time.sleep(0.3)
    assert born.release_expired() == MiB
    assert files(arena) == [] and born.stats()["cached_bytes"] == 0
    with pytest.raises(ValueError, match="cache_decay must be >= 0 s"):
        born.start(arena, threshold=MiB, budget=256 * MiB, cache_decay=-1)


def test_free_unmaps_and_unlinks_without_a_cache(arena: str) -> None:
    born.start(arena, threshold=MiB, budget=256 * MiB, cache=0)
    with born.allocating():
        arrays = [np.full(MiB, i, dtype=np.uint8) for i in range(5)]
    assert len(files(arena)) == 5
    del arrays
    assert files(arena) == []
    assert born.stats()["cached_blocks"] == 0


def test_a_fresh_array_reuses_a_freed_block_of_the_same_size(arena: str, shm_dir: str) -> None:
    with born.allocating():
        x = np.full(2 * MiB // 8, 1.0)
        first = born.whole_block(x)
        del x
        before = born.stats()
        y = np.full(2 * MiB // 8, 2.0)
        z = np.zeros(2 * MiB // 8)  # a fresh block: the cached one is taken
        del y
        zeros = np.zeros(2 * MiB // 8)  # y's block, cleared
        odd = np.full(MiB + 8, 3, dtype=np.uint8)  # nothing cached: a new block
    assert first is not None
    assert born.whole_block(zeros) is not None
    assert born.whole_block(zeros).path == first.path
    assert not zeros.any() and not z.any()
    assert (odd == 3).all()
    after = born.stats()
    assert after["reused"] - before["reused"] == 2
    assert after["allocated"] - before["allocated"] == 4
    assert len(files(arena)) == 3
    # The reused block is still an exact spill file for its new array.
    st = os.stat(first.path)
    assert st.st_size == born.header_size() + 2 * MiB and st.st_nlink == 1
    zeros[:] = 7.0
    header, _ = serialize_unsplit(zeros)
    path = born.seal(zeros, header)
    assert path == first.path
    out = frames_to_object(read_peer_file(shm_dir, path, st.st_size))
    np.testing.assert_array_equal(out, np.full(2 * MiB // 8, 7.0))


def test_a_freed_block_serves_arrays_from_half_to_twice_its_size(arena: str, shm_dir: str) -> None:
    with born.allocating():
        in_use = np.zeros(16 * MiB, dtype=np.uint8)  # lets the cache hold a block
        x = np.full(4 * MiB, 1, dtype=np.uint8)
        path = born.whole_block(x).path
        del x
        before = born.stats()
        smaller = np.full(3 * MiB, 2, dtype=np.uint8)  # x's block, cut to 3 MiB
        assert born.whole_block(smaller).path == path
        assert os.stat(path).st_size == born.header_size() + 3 * MiB
        del smaller
        larger = np.zeros(6 * MiB, dtype=np.uint8)  # grown to 6 MiB, all zero
        assert born.whole_block(larger).path == path
        assert not larger.any()
        del larger
        far = np.full(13 * MiB, 3, dtype=np.uint8)  # over twice: a new block
        assert born.whole_block(far).path != path
    after = born.stats()
    assert after["reused"] - before["reused"] == 2
    assert after["allocated"] - before["allocated"] == 3
    assert len(files(arena)) == 3  # in_use's, far's and the cached one
    # The grown and cut block is still an exact spill file for an array.
    with born.allocating():
        again = np.full(6 * MiB // 8, 7.0)
    assert born.whole_block(again).path == path
    header, _ = serialize_unsplit(again)
    born.seal(again, header)
    size = born.header_size() + 6 * MiB
    out = frames_to_object(read_peer_file(shm_dir, path, size))
    np.testing.assert_array_equal(out, np.full(6 * MiB // 8, 7.0))
    del in_use, far


def test_a_block_sealed_or_exported_while_in_use_is_never_reused(
    arena: str, shm_dir: str, tmp_path: Any
) -> None:
    store = _store(shm_dir, tmp_path)
    with born.allocating():
        a = np.full(MiB // 4, 1.0)  # adopted by a store
        b = np.full(MiB // 4, 2.0)  # sealed and linked by a "peer"
        c = np.full(MiB // 4, 3.0)  # sealed only
    store["a"] = a
    assert not born.whole_block(a).owned
    path_b = born.seal(b, serialize_unsplit(b)[0])
    peer = os.path.join(paths.user_root(shm_dir), "peer-b")
    os.link(path_b, peer)
    assert born.seal(c, serialize_unsplit(c)[0]) is not None
    before = born.stats()
    del a, b, c
    after = born.stats()
    assert after["cached_blocks"] == before["cached_blocks"]
    with born.allocating():
        fresh = [np.full(MiB // 4, 9.0) for _ in range(3)]
    assert born.stats()["reused"] == after["reused"]
    assert all(born.whole_block(x) is not None for x in fresh)
    np.testing.assert_array_equal(store["a"], np.full(MiB // 4, 1.0))
    size = os.stat(peer).st_size
    np.testing.assert_array_equal(
        frames_to_object(read_peer_file(shm_dir, peer, size)), np.full(MiB // 4, 2.0)
    )


def test_calloc_reads_zeros(arena: str) -> None:
    with born.allocating():
        z = np.zeros((512, 1024))
    assert born.block_of(z) is not None
    assert not z.any()
    z[-1, -1] = 3
    assert z.sum() == 3


def test_realloc_keeps_bytes_and_block(arena: str) -> None:
    with born.allocating():
        a = np.arange(2 * MiB // 8, dtype=np.float64)
        a.resize(4 * MiB // 8, refcheck=False)
        assert born.whole_block(a) is not None
        assert (a[: 2 * MiB // 8] == np.arange(2 * MiB // 8)).all()
        assert not a[2 * MiB // 8 :].any()
        a.resize(1000, refcheck=False)  # below the threshold: leaves the arena
        assert born.block_of(a) is None
        assert (a == np.arange(1000)).all()
        b = np.arange(1000, dtype=np.float64)
        b.resize(2 * MiB // 8, refcheck=False)  # ordinary memory stays ordinary
        assert (b[:1000] == np.arange(1000)).all()
    assert born.stats()["blocks"] == 0
    born.release_cache()
    assert files(arena) == []
    del a, b


def test_sealed_file_is_a_spill_file_a_peer_reads_and_owner_writes_never_reach(
    arena: str, shm_dir: str
) -> None:
    with born.allocating():
        a = np.arange(MiB // 4, dtype=np.float64).reshape(512, 512)
    header, frames = serialize_unsplit(a)
    path = born.seal(a, header)
    assert path is not None
    assert born.block_of(a).sealed
    size = os.stat(path).st_size
    # Sealing again with the same header is fine.
    assert born.seal(a, header) == path

    a[0, 0] = -1.0  # the owner writes in place after sharing
    a[-1, -1] = -2.0
    assert a[0, 0] == -1.0 and a[-1, -1] == -2.0

    peer = frames_to_object(read_peer_file(shm_dir, path, size))
    expected = np.arange(MiB // 4, dtype=np.float64).reshape(512, 512)
    np.testing.assert_array_equal(peer, expected)
    # Another process mapping the file sees the original bytes too.
    code = (
        "import numpy as np, sys;"
        "m = np.memmap(sys.argv[1], dtype=np.float64, mode='r', offset=int(sys.argv[2]));"
        "print(m[0], m[-1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, path, str(born._core.born_header_size())],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["0.0", str(float(MiB // 4 - 1))]


def test_seal_refuses_views_and_other_headers(arena: str) -> None:
    with born.allocating():
        a = np.ones(MiB // 8)
    assert born.seal(a[1:], serialize_unsplit(a[1:])[0]) is None
    assert born.seal(np.ones(MiB // 8), serialize_unsplit(a)[0]) is None  # not born
    assert born.seal(a, serialize_unsplit(a)[0]) is not None
    other = a.view(np.int64)  # same bytes, another header: the file may be shared
    assert born.whole_block(other) is not None
    assert born.seal(other, serialize_unsplit(other)[0]) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(MiB, dtype=np.uint8),
        lambda: np.asfortranarray(np.arange(MiB // 8, dtype=np.float64).reshape(1024, 128)),
        lambda: np.zeros(MiB // 8, dtype=[("x", "<i4"), ("y", "<f4")]),
        lambda: np.ones((3, 4, MiB // 64), dtype=np.float64),
    ],
)
def test_file_prefix_round_trips(arena: str, shm_dir: str, make) -> None:
    with born.allocating():
        a = make()
    header, _ = serialize_unsplit(a)
    path = born.seal(a, header)
    assert path is not None
    out = frames_to_object(read_peer_file(shm_dir, path, os.stat(path).st_size))
    np.testing.assert_array_equal(out, a)
    assert out.dtype == a.dtype and out.strides == a.strides


def test_file_prefix_refuses_a_header_that_does_not_fit() -> None:
    page = born._core.born_header_size()
    assert born.file_prefix({"x": b"\0" * page}, MiB) is None
    # A payload too short to be an aligned frame would not start at the page.
    assert born.file_prefix({"x": 1}, born._core.FRAME_ALIGN_MIN_LEN - 1) is None
    prefix = born.file_prefix({"x": 1}, MiB)
    assert prefix is not None and len(prefix) == page


def test_disown_hands_the_file_to_a_store(arena: str, shm_dir: str) -> None:
    with born.allocating():
        a = np.ones(MiB // 8)
    path = born.seal(a, serialize_unsplit(a)[0])
    kept = os.path.join(shm_dir, "kept")
    os.link(path, kept)
    born.disown(a, kept)
    assert not os.path.exists(path)
    assert born.block_of(a).path == kept and not born.block_of(a).owned
    assert born.stats()["owned_bytes"] == 0
    del a
    assert os.path.exists(kept)
    with pytest.raises(LookupError):
        born.disown(np.ones(3), kept)


def test_budget_falls_back_to_ordinary_memory(shm_dir: str) -> None:
    born.start(shm_dir, threshold=MiB, budget=3 * MiB)
    try:
        refused = born.stats()["refused_budget"]
        with born.allocating():
            a = np.ones(2 * MiB // 8)
            b = np.ones(2 * MiB // 8)
        assert born.block_of(a) is not None
        assert born.block_of(b) is None
        assert b.sum() == 2 * MiB // 8
        assert born.stats()["refused_budget"] == refused + 1
        del a
        with born.allocating():
            c = np.ones(2 * MiB // 8)
        assert born.block_of(c) is not None
    finally:
        born.stop()


def test_mapping_budget_falls_back(shm_dir: str) -> None:
    born.start(shm_dir, threshold=MiB, budget=1 << 30, max_blocks=2)
    try:
        refused = born.stats()["refused_blocks"]
        with born.allocating():
            arrays = [np.ones(MiB // 8) for _ in range(4)]
        assert [born.block_of(x) is not None for x in arrays] == [True, True, False, False]
        assert born.stats()["refused_blocks"] == refused + 2
    finally:
        born.stop()


def test_full_tmpfs_falls_back_instead_of_sigbus() -> None:
    mount_point = tempfile.mkdtemp(prefix="dask-shm-born-full-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mount_point]).returncode:
        os.rmdir(mount_point)
        pytest.skip("cannot mount a small tmpfs here (not root?)")
    try:
        born.start(mount_point, threshold=MiB, budget=1 << 30)
        refused = born.stats()["refused_error"]
        with born.allocating():
            fits = np.ones(2 * MiB // 8)
            too_big = np.ones(8 * MiB // 8)  # no room: ordinary memory
        assert born.block_of(fits) is not None
        assert born.block_of(too_big) is None
        assert too_big.sum() == MiB
        assert born.stats()["refused_error"] == refused + 1
        del fits
    finally:
        born.stop()
        subprocess.run(["umount", mount_point], check=True)
        os.rmdir(mount_point)


def test_disabled_arena_and_bad_directory(shm_dir: str) -> None:
    born.stop()
    with born.allocating():
        a = np.ones(2 * MiB // 8)
    assert born.block_of(a) is None
    with pytest.raises(ValueError, match="does not exist"):
        born.start(os.path.join(shm_dir, "missing"), budget=MiB)


def test_many_threads(arena: str) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(seed: int) -> int:
        barrier.wait()
        born_count = 0
        for i in range(30):
            n = (MiB // 8) * (1 + (seed + i) % 3)
            a = np.full(n, float(seed))
            if born.whole_block(a) is not None:
                born_count += 1
            b = a * 2
            if not (b == 2.0 * seed).all():
                errors.append(AssertionError(seed))
            if i % 5 == 0:
                header, _ = serialize_unsplit(b)
                born.seal(b, header)
                b += 1  # private after sealing
        return born_count

    ctx = contextvars.copy_context()
    with born.allocating():
        ctx = contextvars.copy_context()
    with ThreadPoolExecutor(8) as pool:
        counts = list(pool.map(lambda s: ctx.copy().run(work, s), range(8)))
    assert not errors
    assert sum(counts) > 0
    s = born.stats()
    assert s["blocks"] == 0 and s["bytes"] == 0
    assert s["reused"] > 0
    assert len(files(arena)) == s["cached_blocks"]
    born.stop()  # releases the cache
    assert files(arena) == []


def test_settings_from_config(shm_dir: str) -> None:
    assert born_worker.BornSettings.from_config() == born_worker.BornSettings()
    with dask.config.set(
        {"shm.shared-memory.born-shared": True, "shm.shared-memory.born-threshold": "4 MiB"}
    ):
        s = born_worker.BornSettings.from_config()
    assert s.decision(shm_dir)[0] and s.threshold == 4 * MiB
    assert 0 < s.budget_for(shm_dir, 10 * MiB) <= 10 * MiB
    for key, bad in [("born-shared", "yes"), ("born-threshold", "lots"), ("born-budget", -1)]:
        with dask.config.set({f"shm.shared-memory.{key}": bad}):
            with pytest.raises(ValueError, match=key):
                born_worker.BornSettings.from_config()


def test_huge_pages_read_from_mount_options(tmp_path, monkeypatch) -> None:
    # psutil reads <PROCFS_PATH>/self/mounts: a mount table of our own
    (tmp_path / "self").mkdir()
    mounts = tmp_path / "self" / "mounts"
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    mounts.write_text(
        "tmpfs /dev/shm tmpfs rw,relatime,size=100k 0 0\n"
        f"tmpfs {tmp_path} tmpfs rw,huge=within_size 0 0\n"
    )
    assert born_worker.huge_pages(str(tmp_path))
    mounts.write_text(f"tmpfs {tmp_path} tmpfs rw,huge=never 0 0\n")
    assert born_worker.huge_pages(str(tmp_path)) == shmem_forced_huge()


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_worker_tasks_allocate_born_shared(c, s, a) -> None:
    directory = tempfile.mkdtemp(prefix="dask-shm-born-", dir="/dev/shm")
    try:
        born_worker.install_on_worker(a, directory, threshold=MiB, budget=64 * MiB)

        def make() -> tuple[str, bool]:
            x = np.ones(MiB // 4)
            return handler_name(), born.block_of(x) is not None

        assert await c.submit(make, pure=False) == ("dask_shm_born_shared", True)
        # Code outside tasks (the event loop here) is untouched.
        assert handler_name() == "default_allocator"
        born_worker.uninstall_from_worker(a)
        assert await c.submit(make, pure=False) == ("default_allocator", False)
        assert born_stats()["directory"] is None
    finally:
        born.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _store(shm_dir: str, disk_root: Any, max_weight: int | bool = False, budget: int = 1 << 30):
    from dask_shm.shared.buffer import SharedSpillBuffer

    buffer = SharedSpillBuffer.create(
        1 << 40,
        root=shm_dir,
        disk_root=str(disk_root),
        budget=budget,
        min_size=64 * 1024,
        min_shared_fraction=0.5,
        max_spill=max_weight,  # type: ignore[arg-type]
    )
    return buffer.store


def test_adopt_born_a_store_writes_only_the_header(arena: str, shm_dir: str, tmp_path: Any) -> None:
    store = _store(shm_dir, tmp_path)
    with born.allocating():
        a = np.arange(MiB // 2, dtype=np.float64)
    block = born.whole_block(a)
    assert block is not None
    with open(block.path, "rb") as f:
        before = f.read(os.stat(block.path).st_size)
    name = store.adopt_born("x", a)
    assert name is not None
    store._register("x", name)
    path = store.files.path(name)
    st = os.stat(path)
    assert st.st_nlink == 1  # the arena's own name is gone
    assert not os.path.exists(block.path)
    # Same inode, same payload bytes: nothing was copied.
    with open(path, "rb") as f:
        after = f.read()
    page = born._core.born_header_size()
    assert after[page:] == before[page:]
    a[0] = -5.0  # the owner's later write stays private
    value, backed = store.load("x")
    assert backed
    np.testing.assert_array_equal(value, np.arange(MiB // 2, dtype=np.float64))
    del a
    assert os.path.exists(path)
    np.testing.assert_array_equal(store["x"], value)
    assert store.adopt_born("y", np.ones(MiB)) is None  # not born


def test_a_born_array_that_outlives_its_spilled_key_keeps_counting(
    arena: str, shm_dir: str, tmp_path: Any
) -> None:
    """A born array whose block became a store's file counts as a mapping
    of that file (its pages are in the share); once the key is gone while
    the array lives, as a file only this process keeps, until it is freed."""
    import gc

    from dask_shm._core import flush_deletes, mapping_memory
    from dask_shm.shared.monitor import own_shared_pages

    store = _store(shm_dir, tmp_path)
    # Mappings that earlier tests' garbage still holds go first: their
    # release during this test's collection would move the baseline. (A
    # collection can free what queues another release: settled after two.)
    for _ in range(2):
        gc.collect()
        flush_deletes()
    base = mapping_memory()
    with born.allocating():
        a = np.ones(MiB)  # 8 MiB
    length = born.whole_block(a).length
    pages = own_shared_pages()
    store["x"] = a  # spilled: the block is now the store's file
    assert not born.whole_block(a).owned
    assert mapping_memory() == (base[0] + length, base[1])
    # mapped bytes count once: no longer the arena's own, now a file's mapping
    assert own_shared_pages().mapped == pages.mapped
    del store["x"]
    assert mapping_memory() == (base[0] + length, base[1] + length)
    del a
    gc.collect()
    flush_deletes()
    assert mapping_memory() == base


def test_store_spill_of_a_born_array_meters_one_header_write(
    arena: str, shm_dir: str, tmp_path: Any
) -> None:
    store = _store(shm_dir, tmp_path)
    with born.allocating():
        a = np.ones(MiB // 4)
    store["x"] = a
    assert born.whole_block(a).sealed and not born.whole_block(a).owned
    assert store.cumulative_metrics["disk-write", "count"] == 1
    assert store.cumulative_metrics["disk-write", "bytes"] == born.header_size()
    store["y"] = np.ones(MiB // 4)  # an ordinary array: the ordinary write
    assert store.cumulative_metrics["disk-write", "bytes"] > 2 * MiB
    np.testing.assert_array_equal(store["x"], store["y"])


def test_a_second_key_on_a_sealed_block_gets_a_file_of_its_own(
    arena: str, shm_dir: str, tmp_path: Any
) -> None:
    # Two keys on one block (an identity or full-slice task): the second was
    # linked to the first's sealed file, missing what was written in place
    # since (and failing to spill at all once that file was gone).
    store = _store(shm_dir, tmp_path)
    with born.allocating():
        a = np.full(MiB // 4, 3.0)
    store["A"] = a
    b = a[:]
    b[0] = 99.0  # the owner's write: private since the seal
    store["B"] = b
    assert store["B"][0] == 99.0
    assert store["A"][0] == 3.0
    del store["A"]
    flush_deletes()
    store["C"] = b  # its first file is gone: a file of its own again
    assert store["C"][0] == 99.0


def test_a_born_block_that_cannot_be_sealed_is_written_the_ordinary_way(
    arena: str, shm_dir: str, tmp_path: Any, monkeypatch: Any
) -> None:
    # (a full root, say): the value once could not be spilled at all, and
    # stayed at the head of the buffer's LRU, so nothing after it could.
    from dask_shm.shared import born_store

    def no_space(self: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(born_store.BornFile, "seal", no_space)
    store = _store(shm_dir, tmp_path)
    with born.allocating():
        a = np.full(MiB // 4, 5.0)
    store["x"] = a
    assert not born.whole_block(a).sealed
    np.testing.assert_array_equal(store["x"], np.full(MiB // 4, 5.0))


def _bytes(a: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a contiguous array of any dtype."""
    return a.reshape(-1).view(np.uint8).reshape(-1)


def test_arrays_of_one_kind_reuse_a_header_and_read_back_exactly(
    arena: str, shm_dir: str, tmp_path: Any
) -> None:
    """The spill-file header of an array is remembered by dtype, shape,
    strides and writeability: arrays of the same kind read back with their
    own values, and structured dtypes of one item size (same ``dtype.str``)
    or another shape never get another kind's header."""
    store = _store(shm_dir, tmp_path)
    pair = np.dtype([("a", "<f8"), ("b", "<f8")])
    other = np.dtype([("x", "<i8"), ("y", "<f8")])
    assert pair.str == other.str
    made = {}
    for i, (dtype, shape) in enumerate(
        [
            ("<f8", (MiB // 8,)),
            ("<f8", (MiB // 8,)),
            ("<f8", (MiB // 16, 2)),
            (pair, (MiB // 16,)),
            (other, (MiB // 16,)),
            (">f8", (MiB // 8,)),
        ]
    ):
        with born.allocating():
            a = np.empty(shape, dtype=dtype)
        _bytes(a)[:] = np.arange(a.nbytes, dtype=np.uint64).astype(np.uint8) + i
        made[f"k{i}"] = a.copy()
        store[f"k{i}"] = a
        assert born.whole_block(a).sealed, "spilled without a copy"
        del a
    for key, expected in made.items():
        value, backed = store.load(key)
        assert backed
        assert value.dtype == expected.dtype and value.shape == expected.shape
        np.testing.assert_array_equal(_bytes(value), _bytes(expected))


def test_adopt_born_respects_max_spill(arena: str, shm_dir: str, tmp_path: Any) -> None:
    from dask_shm.spill_store import MaxSpillExceeded

    store = _store(shm_dir, tmp_path, max_weight=MiB)
    with born.allocating():
        a = np.ones(MiB // 4)  # 2 MiB
    with pytest.raises(MaxSpillExceeded):
        store.adopt_born("x", a)
    assert not born.whole_block(a).sealed  # untouched


def test_adopt_born_respects_the_tier2_budget(arena: str, shm_dir: str, tmp_path: Any) -> None:
    store = _store(shm_dir, tmp_path, budget=MiB)
    with born.allocating():
        a = np.ones(MiB // 4)  # 2 MiB: more than tier 2 may hold
    assert store.adopt_born("x", a) is None
    assert not born.whole_block(a).sealed
    store["x"] = a  # the ordinary write, which goes to tier 3
    assert store.tiers.tier_of(store.file_of("x")) == 3
    np.testing.assert_array_equal(store["x"], a)


def test_arena_budget_follows_what_tier2_leaves(shm_dir: str, tmp_path: Any) -> None:
    store = _store(shm_dir, tmp_path, budget=5 * MiB)
    directory = os.path.join(paths.user_root(shm_dir), "born")
    os.mkdir(directory, 0o700)
    born.start(directory, budget=5 * MiB)
    try:
        with born.allocating():
            a = np.ones(MiB // 2)  # 4 MiB
        name = store.adopt_born("a", a)
        assert name is not None
        store._register("a", name)
        # Disowned blocks no longer count against the arena's own budget...
        assert born.stats()["owned_bytes"] == 0
        # ...but they fill tier 2, which is what a worker's budget function reads.
        tier2 = store.tiers.tier("shared").budget
        assert tier2 is not None
        born.start(directory, budget=max(0, 5 * MiB - tier2.used))
        with born.allocating():
            b = np.ones(MiB // 2)
        assert born.block_of(b) is None
    finally:
        born.stop()


def _born_report(dask_worker: Any, key: str) -> dict[str, Any]:
    """Where ``key``'s value and file are on this worker."""
    store = dask_worker.data.store
    name = store.file_of(key)
    path = None if name is None else store.files.path(name)
    return {
        "inode": None if path is None else os.stat(path).st_ino,
        "links": None if path is None else os.stat(path).st_nlink,
        "stats": born.stats(),
        "handler": handler_name(),
    }


def _made_born(nbytes: int, fill: float) -> np.ndarray:
    x = np.full(nbytes // 8, fill)
    assert born.whole_block(x) is not None, "not born shared"
    return x


def test_cluster_hands_a_born_array_over_without_copying_it() -> None:

    from dask_shm import SharedMemoryPlugin

    with process_cluster(2, "2GiB") as client:
        client.register_plugin(SharedMemoryPlugin())
        client.register_plugin(born_worker.BornSharedPlugin(born_worker.BornSettings(mode=True)))
        a, b = worker_addresses(client)
        x = client.submit(_made_born, 32 * MiB, 2.0, workers=[a], key="born-x")
        total = client.submit(lambda v: float(v.sum()), x, workers=[b], key="born-sum")
        assert total.result() == 2.0 * 4 * MiB
        reports = client.run(_born_report, key="born-x")
        # One file, linked by both workers' stores: A's arena handed its block
        # over (sealed, no copy) and B linked it.
        assert reports[a]["inode"] is not None and reports[a]["inode"] == reports[b]["inode"]
        assert reports[a]["stats"]["sealed"] >= 1
        assert reports[a]["stats"]["owned_bytes"] == 0
        assert reports[a]["handler"] == "default_allocator"  # outside tasks: untouched
        client.cancel([x, total])


def _churn(nbytes: int) -> float:
    """Allocate and free a born array, leaving its block in the cache."""
    x = np.full(nbytes // 8, 1.0)
    assert born.whole_block(x) is not None, "not born shared"
    return float(x.sum())


def _born_memory_figure(dask_worker: Any) -> int:
    """The worker's memory figure with its private part taken out: what the
    born-shared plugin adds to it."""
    plugin = dask_worker.plugins["dask-shm-born-shared"]
    private = plugin._monitor
    plugin._monitor = lambda: 0
    try:
        return dask_worker.monitor.get_process_memory()
    finally:
        plugin._monitor = private


def _memory_report(dask_worker: Any) -> dict[str, Any]:
    """The worker's born-shared memory figure, then what one memory-pressure
    eviction releases."""
    figure = _born_memory_figure(dask_worker)
    stats = born.stats()
    released = dask_worker.data.evict()
    return {"figure": figure, "stats": stats, "released": released, "after": born.stats()}


def test_worker_memory_counts_cached_blocks_and_pressure_releases_them() -> None:
    from dask_shm import SharedMemoryPlugin

    # Cached blocks wait an hour: no decay between the tasks and the report.
    settings = born_worker.BornSettings(mode=True, cache_decay=3600)
    with process_cluster(1, "2GiB") as client:
        client.register_plugin(SharedMemoryPlugin())
        client.register_plugin(born_worker.BornSharedPlugin(settings))
        assert client.submit(_churn, 32 * MiB, pure=False).result() == 4 * MiB
        assert client.submit(_churn, 32 * MiB, pure=False).result() == 4 * MiB
        (report,) = client.run(_memory_report).values()
        stats = report["stats"]
        assert stats["reused"] >= 1
        assert stats["cached_bytes"] >= 32 * MiB
        # Cached blocks are the worker's own memory: the figure adds them back.
        assert report["figure"] == stats["owned_bytes"] + stats["cached_bytes"]
        # Memory pressure (the memory manager's evict) releases them first.
        assert report["released"] == stats["cached_bytes"]
        assert report["after"]["cached_bytes"] == 0


def test_an_idle_worker_releases_cached_blocks_after_the_decay() -> None:
    """A freed block nobody asks for again does not stay the worker's memory:
    the worker releases it once it waited the cache's decay, with no task
    running and no memory pressure."""
    from dask_shm import SharedMemoryPlugin

    settings = born_worker.BornSettings(mode=True, cache_decay=0.5)
    with process_cluster(1, "2GiB") as client:
        client.register_plugin(SharedMemoryPlugin())
        client.register_plugin(born_worker.BornSharedPlugin(settings))
        assert client.submit(_churn, 32 * MiB, pure=False).result() == 4 * MiB
        deadline = time.monotonic() + 30
        while (report := _one(client.run(_idle_report)))["cached_bytes"]:
            assert time.monotonic() < deadline, report
            time.sleep(0.1)
        assert report["evicted"] >= 1 and report["figure"] == 0 and report["files"] == 0


def _one(results: dict[str, Any]) -> Any:
    (result,) = results.values()
    return result


def _idle_report(dask_worker: Any) -> dict[str, Any]:
    """The arena's cache, the worker's born-shared memory figure, and the
    files in its born directory."""
    stats = born.stats()
    return {
        "cached_bytes": stats["cached_bytes"],
        "evicted": stats["evicted"],
        "figure": _born_memory_figure(dask_worker),
        "files": len(os.listdir(dask_worker.plugins["dask-shm-born-shared"]._directory)),
    }


def test_shared_memory_plugin_turns_it_on_from_config() -> None:
    from distributed import Client, LocalCluster

    from dask_shm import SharedMemoryPlugin

    def probe() -> tuple[str, bool]:
        x = np.ones(MiB // 4)
        return handler_name(), born.block_of(x) is not None

    for setting, expected in [(True, ("dask_shm_born_shared", True)), (False, None)]:
        with (
            dask.config.set({"shm.shared-memory.born-shared": setting}),
            LocalCluster(
                n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0"
            ) as cluster,
            Client(cluster) as client,
        ):
            client.register_plugin(SharedMemoryPlugin())
            got = client.submit(probe, pure=False).result()
            if expected is None:
                assert got == ("default_allocator", False)
            else:
                assert got == expected


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_tasks_run_on_ordinary_memory_when_the_directory_vanishes(c, s, a) -> None:
    directory = tempfile.mkdtemp(prefix="dask-shm-born-", dir="/dev/shm")
    try:
        born_worker.install_on_worker(
            a, directory, threshold=MiB, budget=64 * MiB, budget_fn=lambda: 64 * MiB
        )
        os.rmdir(directory)

        def make() -> tuple[float, bool]:
            x = np.ones(MiB // 4)
            return float(x.sum()), born.block_of(x) is not None

        assert await c.submit(make, pure=False) == (MiB // 4, False)
    finally:
        born_worker.uninstall_from_worker(a)
        shutil.rmtree(directory, ignore_errors=True)


@gen_test()
async def test_preload_refuses_a_bad_born_setting() -> None:
    from distributed import Scheduler, Worker

    from dask_shm.preload import InvalidConfig

    config = {"shm.shared-memory.enabled": True, "shm.shared-memory.born-shared": "maybe"}
    async with Scheduler(dashboard_address=":0") as s:
        with dask.config.set(config), pytest.raises(RuntimeError, match="failed to start") as info:
            await Worker(s.address, preload=["dask_shm"], memory_limit="512 MiB")
    assert isinstance(info.value.__cause__, InvalidConfig)
    assert "born-shared" in str(info.value.__cause__)
