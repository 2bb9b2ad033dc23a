"""A worker's figures for its nanny, published by a Rust thread
(``NativeSharePublisher`` over ``dask_shm._core.SharePublishing``): the same
figures and line the Python publisher writes, read back the way the nanny
reads them (``read_published``), on a real tmpfs with real spill files and
mappings."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from dask_shm import _core
from dask_shm.shared import paths
from dask_shm.shared.monitor import _published_pages
from dask_shm.shared.published_share import (
    NativeSharePublisher,
    SharePublisher,
    pid_namespace,
    read_published,
    share_path,
)

MiB = 2**20


def _store(shm_dir: str) -> _core.FileStore:
    return _core.FileStore(os.path.join(shm_dir, "store"))


def _share(store: _core.FileStore) -> Callable[[], int]:
    return lambda: int(store.total()[1])


def _eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_the_rust_figures_are_the_python_ones(shm_dir):
    """``figures_of`` computes what the worker's monitor publishes from
    Python: the store's share, and this process's mapped and kept bytes
    (a mapping of a deleted entry's file is kept)."""
    store = _store(shm_dir)
    store.put("a", [b"x" * 3 * MiB], 3 * MiB)
    put = store.put("b", [b"y" * MiB], MiB)
    assert put is not None
    views = store.read_mapped(put[0])
    store.delete(put[0])  # its mapping keeps the file: kept
    try:
        share, mapped, kept = _core.SharePublishing.figures_of([store])
        assert share == _share(store)() > 3 * MiB
        assert (mapped, kept) == _published_pages()
        assert kept >= MiB
        assert _core.SharePublishing.figures_of([]) == (0, mapped, kept)
    finally:
        del views


def test_it_publishes_the_line_the_nanny_reads_and_follows_the_store(shm_dir):
    root = shm_dir
    store = _store(root)
    path = share_path(paths.subdir(root, "w"))
    publisher = NativeSharePublisher(
        path, [store], lambda: None, share=_share(store), pages=_published_pages, interval=0.01
    )
    publisher.start()
    try:
        assert publisher.running()
        first = read_published(root, os.getpid())
        assert first.share == 0 and first.stamp is not None  # at once, from Python
        store.put("a", [b"x" * 2 * MiB], 2 * MiB)
        _eventually(
            lambda: read_published(root, os.getpid()).share == _share(store)(),
            "the published share never followed the store",
        )
        now = read_published(root, os.getpid())
        assert now.stamp is not None and now.stamp > first.stamp
        assert time.monotonic() - now.stamp < 5  # one clock with the nanny's
        with open(path, "rb") as f:
            parts = f.read().split()
        namespace = pid_namespace()
        assert parts[1] == (b"-" if namespace is None else str(namespace).encode())
        assert len(parts) == 5
    finally:
        publisher.stop()
    assert not publisher.running()
    assert not os.path.exists(path) and not os.path.exists(f"{path}.tmp")
    publisher.stop()  # twice: harmless


def test_python_and_rust_write_the_same_line(shm_dir):
    """The stamps aside, the Python publisher's line and the Rust thread's
    are the same for the same figures."""
    store = _store(shm_dir)
    store.put("a", [b"x" * MiB], MiB)
    path = share_path(paths.subdir(shm_dir, "w"))
    python = SharePublisher(path, _share(store), lambda: None, pages=_published_pages)
    python.publish()
    with open(path, "rb") as f:
        by_python = f.read().split()
    native = _core.SharePublishing(path, [store], pid_namespace(), 0.005)
    try:
        _eventually(lambda: open(path, "rb").read().split()[4] != by_python[4], "never wrote")
        with open(path, "rb") as f:
            by_rust = f.read().split()
    finally:
        native.stop()
    assert by_rust[:4] == by_python[:4]
    assert float(by_rust[4]) > float(by_python[4])


def test_it_ends_with_its_worker_and_refreshes_link_counts(shm_dir):
    """Once ``alive()`` is false both threads end and the file goes, even if
    nobody calls ``stop``; meanwhile link counts are refreshed when due."""
    store = _store(shm_dir)
    alive = [True]
    refreshes: list[float] = []
    path = share_path(paths.subdir(shm_dir, "w"))
    publisher = NativeSharePublisher(
        path,
        [store],
        lambda: refreshes.append(time.monotonic()),
        share=_share(store),
        pages=_published_pages,
        interval=0.01,
        refresh_interval=0.05,
        alive=lambda: alive[0],
    )
    publisher.start()
    _eventually(lambda: len(refreshes) >= 2, "never refreshed")
    alive[0] = False
    publisher._thread.join(timeout=10)
    assert not publisher._thread.is_alive()
    assert not publisher.running()
    assert not os.path.exists(path)
    time.sleep(0.05)
    assert not os.path.exists(path), "the Rust thread published after its worker ended"


def test_a_directory_that_vanishes_leaves_the_thread_running(shm_dir):
    """A write that fails (the directory gone, a full root) is skipped: the
    thread goes on, and publishes again once it can."""
    store = _store(shm_dir)
    directory = os.path.join(shm_dir, "gone")
    os.mkdir(directory)
    path = os.path.join(directory, "w.share")
    native = _core.SharePublishing(path, [store], None, 0.005)
    try:
        _eventually(lambda: os.path.exists(path), "never published")
        os.unlink(path)
        os.rmdir(directory)
        time.sleep(0.05)
        assert native.running()
        os.mkdir(directory)
        _eventually(lambda: os.path.exists(path), "never published again")
    finally:
        native.stop()


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_interval_is_refused(shm_dir, interval):
    with pytest.raises(ValueError, match="interval"):
        _core.SharePublishing(os.path.join(shm_dir, "w.share"), [], None, interval)
