"""Shared-memory pages that are not dask-shm's count as a worker's memory, as in
stock: a task's own shared memory (a multiprocessing heap, a torch shared
tensor, a memmap in /dev/shm) and a spill file that only a view of its
mapping keeps in RAM once its key is gone. Shared mode leaves out of a
worker's memory only the pages of its own mappings that a share counts.

Each test runs the same operations on stock and in shared mode, on real
worker processes, and compares what the worker's monitor (spill, pause) and
its nanny (terminate) count."""

from __future__ import annotations

import gc
import mmap
import os
import sys
import time
import uuid

import numpy as np
import pytest
from distributed import KilledWorker, wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clusters import process_cluster  # noqa: E402
from p2p_workload import shared_config  # noqa: E402

MiB = 2**20
LIMIT = 1024 * MiB
MODES = ["stock", "shared"]

#: what a task keeps alive in its worker process between tasks
_held: list = []


def _config(mode: str, root: str) -> dict:
    return shared_config(root) if mode == "shared" else {}


def _own_shared_memory(size: int, directory: str) -> int:
    """Map ``size`` bytes of a fresh, already unlinked file in ``directory``
    (a tmpfs) and write every page, as a multiprocessing heap or a torch
    shared tensor does; the mapping stays in ``_held``. Nothing is left in
    ``directory``, even if the process is killed."""
    path = os.path.join(directory, f"task-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    np.frombuffer(m, dtype="u1")[:] = 1
    _held.append(m)
    return size


def _drop_held() -> None:
    _held.clear()
    gc.collect()


def _monitored(dask_worker) -> int:
    return int(dask_worker.monitor.get_process_memory())


def _settled(client, worker: str, *, above: int | None = None, below: int | None = None) -> int:
    """The worker's monitored memory once it is above/below the bound (the
    last reading if it never gets there within 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        (value,) = client.run(_monitored, workers=[worker]).values()
        ok = (above is None or value >= above) and (below is None or value <= below)
        if ok or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.parametrize("mode", MODES)
def test_a_tasks_own_shared_memory_counts_as_in_stock(shm_dir, mode):
    """300 MiB of shared memory a task maps and writes count in the worker's
    memory (what spilling and pausing compare with their thresholds), and
    leave it when the task's mapping goes."""
    size = 300 * MiB
    with process_cluster(1, LIMIT, _config(mode, shm_dir)) as client:
        (worker,) = client.scheduler_info()["workers"]
        before = _settled(client, worker)
        client.submit(_own_shared_memory, size, shm_dir, pure=False).result()
        held = _settled(client, worker, above=before + size * 9 // 10)
        assert held >= before + size * 9 // 10, (mode, before, held)
        client.run(_drop_held)
        after = _settled(client, worker, below=before + 50 * MiB)
        assert after <= before + 50 * MiB, (mode, before, after)


def _grow_shared_memory(fraction: float, limit: int, directory: str) -> int:
    """Map and write shared memory in 16 MiB steps until ``fraction`` of
    ``limit`` is held that way; then hold it a while."""
    step, held = 16 * MiB, 0
    while held < fraction * limit:
        held += _own_shared_memory(step, directory)
        time.sleep(0.02)
    time.sleep(3)
    return held


@pytest.mark.parametrize("mode", MODES)
def test_the_nanny_restarts_a_worker_over_the_limit_in_its_own_shared_memory(shm_dir, mode):
    """A task holding 110% of the worker's memory limit in shared memory of
    its own gets its worker restarted by the nanny (terminate, 95%), in
    shared mode as in stock, instead of taking the host's memory unseen."""
    config = {**_config(mode, shm_dir), "distributed.scheduler.allowed-failures": 0}
    with process_cluster(1, LIMIT, config) as client:
        growing = client.submit(_grow_shared_memory, 1.1, LIMIT, shm_dir, pure=False)
        with pytest.raises(KilledWorker):
            growing.result(timeout=120)
        assert client.get_events("worker-restart-memory")
    assert not [name for name in os.listdir(shm_dir) if name.startswith("task-")]


def _make(i: int) -> np.ndarray:
    return np.full(4 * MiB, i, dtype="f8")  # 32 MiB


def _spill_all(dask_worker) -> int:
    n = 0
    while dask_worker.data.fast:
        if dask_worker.data.evict() < 0:
            break
        n += 1
    return n


def _keep_views(*values: np.ndarray) -> int:
    """Keep a 10-element view of each value in the worker process."""
    _held.extend(v[:10] for v in values)
    return len(values)


VALUES = 8
VALUE = 32 * MiB


@pytest.mark.parametrize("mode", MODES)
def test_a_view_that_outlives_its_key_keeps_counting(shm_dir, mode):
    """Values spilled, read back by a task that keeps a small view of each,
    then released: the views keep the whole values in RAM (in shared mode,
    the mappings of their files; in stock, the arrays), so the worker's
    memory still counts them, until the views go."""
    with process_cluster(1, LIMIT, _config(mode, shm_dir)) as client:
        (worker,) = client.scheduler_info()["workers"]
        before = _settled(client, worker)
        futures = [client.submit(_make, i, key=f"v-{i}") for i in range(VALUES)]
        wait(futures)
        assert client.run(_spill_all)[worker] == VALUES
        kept = client.submit(_keep_views, *futures, key="keep")
        assert kept.result() == VALUES
        del futures, kept
        # The keys are gone from the worker: no share counts their files.
        deadline = time.monotonic() + 10
        while client.run(lambda dask_worker: len(dask_worker.data))[worker]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        expected = VALUES * VALUE * 9 // 10
        held = _settled(client, worker, above=before + expected)
        assert held >= before + expected, (mode, before, held)
        client.run(_drop_held)
        after = _settled(client, worker, below=before + 50 * MiB)
        assert after <= before + 50 * MiB, (mode, before, after)


# --- the record of mappings, in this process ---------------------------------------


def test_mapping_memory_follows_the_entries_that_hold_a_mapped_file(shm_dir):
    """A file mapped through a store's entry is ``mapped`` (its pages count
    in a share); once no entry of this process holds it (deleted,
    forgotten, moved to another store, the store closed) it is ``kept`` too,
    once however many mappings of it live, until its last mapping is
    unmapped."""
    from dask_shm._core import FileStore, flush_deletes, mapping_memory, move_entry

    value = np.ones(2 * MiB + 100, dtype="u1")

    def settled() -> tuple[int, int]:
        gc.collect()
        flush_deletes()  # large mappings are unmapped on the deleting thread
        return mapping_memory()

    def opened() -> FileStore:
        return FileStore(os.path.join(shm_dir, "a"), defer_deletes=True)

    base = settled()
    store, other = opened(), FileStore(os.path.join(shm_dir, "b"), defer_deletes=True)
    for leave in ("delete", "forget", "move", "close"):
        name, _ = store.put("k", [value], value.nbytes)
        path = store.path(name)
        pages = -(-os.path.getsize(path) // mmap.PAGESIZE) * mmap.PAGESIZE
        views = store.read_mapped(name)
        assert mapping_memory() == (base[0] + pages, base[1]), leave
        again = store.read_mapped(name)  # a second mapping of the same file
        assert mapping_memory() == (base[0] + 2 * pages, base[1]), leave
        if leave == "delete":
            store.delete(name)
        elif leave == "forget":
            store.forget(name)
        elif leave == "move":
            move_entry(store, name, other)
        else:
            del store
            gc.collect()
        assert mapping_memory() == (base[0] + 2 * pages, base[1] + pages), leave
        del views, again
        assert settled() == base, leave
        if leave == "forget":
            os.unlink(path)
        if leave == "close":
            store = opened()
    # An entry still in its store holds its file once its mapping is gone:
    # a mapping made later is not counted as kept.
    name, _ = store.put("k", [value], value.nbytes)
    store.read_mapped(name)
    assert settled() == base
    views = store.read_mapped(name)
    assert mapping_memory() == (base[0] + pages, base[1])
    del views
    store.delete(name)
    assert settled() == base


def test_mappings_of_files_on_disk_count_neither_way(tmp_path):
    """A mapped file of a disk tier is page cache (``RssFile``, part of the
    private memory): it is neither ``mapped`` nor ``kept``."""
    from dask_shm._core import FileStore, mapping_memory

    store = FileStore(str(tmp_path / "disk"))
    value = np.ones(MiB, dtype="u1")
    base = mapping_memory()
    name, _ = store.put("k", [value], value.nbytes)
    views = store.read_mapped(name)
    store.delete(name)
    assert mapping_memory() == base
    del views


def test_the_nanny_counts_shared_pages_only_on_figures_newer_than_its_last_look(shm_dir):
    """The nanny reads a worker's figures from the file it publishes. Figures
    older than the nanny's last look (a publisher waiting for the GIL, a
    full root) may miss a mapping made since, whose pages would then count
    twice: the shared pages are then left out, as before the worker's
    figures existed. Fresh figures count them, as far as two looks saw them.
    This process plays the worker."""
    from dask_shm.procmem import process_memory
    from dask_shm.shared import paths
    from dask_shm.shared.monitor import _PrivateMemoryTerminator
    from dask_shm.shared.published_share import SharePublisher, share_path

    size = 64 * MiB
    _own_shared_memory(size, shm_dir)
    try:
        publisher = SharePublisher(
            share_path(paths.subdir(shm_dir, "w")), lambda: 0, lambda: None, pages=lambda: (0, 0)
        )
        terminator = _PrivateMemoryTerminator(None, shm_dir)  # type: ignore[arg-type]
        pid = os.getpid()

        def held() -> int:
            return terminator.parts(pid)[0] - process_memory().private

        publisher.publish()
        assert held() < size // 2  # a first look: nothing to compare with
        assert held() < size // 2  # figures from before the last look: stale
        publisher.publish()
        assert held() >= size * 9 // 10  # fresh, and seen by both looks
        assert held() < size // 2
        publisher.stop()
    finally:
        _drop_held()
