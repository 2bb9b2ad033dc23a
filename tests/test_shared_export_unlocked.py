"""SharedSpillBuffer.export copies a value into its file without the
buffer's locks: the worker's event loop keeps reading, storing and deleting
keys meanwhile, and whatever happened to the key during the copy (deleted,
replaced, spilled, exported by another thread) decides the outcome, with no
file left behind. One process, real files in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from dask_shm._core import flush_deletes
from dask_shm.shared import SharedSpillBuffer

MB = 2**20


@pytest.fixture
def buf(shared_buffer_256mib):
    return shared_buffer_256mib


def during_the_copy(
    monkeypatch: pytest.MonkeyPatch, buf: SharedSpillBuffer, action: Callable[[], Any]
) -> None:
    """Run ``action`` once, while ``buf``'s next export copies its value
    into a file (after the file is written, before the export commits)."""
    store = buf.store
    real = store.write_file
    done: list[bool] = []

    def write_file(*args: Any, **kwargs: Any) -> str | None:
        name = real(*args, **kwargs)
        if not done:
            done.append(True)
            action()
        return name

    monkeypatch.setattr(store, "write_file", write_file)


def files(buf: SharedSpillBuffer) -> list[str]:
    flush_deletes()
    return sorted(n for n in os.listdir(buf.spill_directory) if not n.startswith("."))


def test_other_keys_are_served_from_another_thread_while_an_export_copies(monkeypatch, buf):
    buf["x"] = np.arange(16 * MB // 8, dtype=float)
    buf["y"] = np.full(MB // 8, 2.0)
    buf["w"] = np.zeros(10)
    seen: dict[str, Any] = {}

    def event_loop() -> None:  # what the worker's loop does meanwhile
        seen["y"] = float(buf["y"][0])
        buf["z"] = np.full(10, 3.0)
        del buf["w"]
        seen["done"] = True

    def on_another_thread() -> None:
        t = threading.Thread(target=event_loop)
        t.start()
        t.join(timeout=30)
        seen["blocked"] = t.is_alive()

    during_the_copy(monkeypatch, buf, on_another_thread)
    handle = buf.export("x")
    assert seen == {"y": 2.0, "done": True, "blocked": False}
    assert handle is not None and os.path.exists(handle.path)
    assert "x" not in buf.fast and "x" in buf.slow  # the private copy left memory
    np.testing.assert_array_equal(buf["x"], np.arange(16 * MB // 8, dtype=float))
    assert "w" not in buf and float(buf["z"][0]) == 3.0
    os.unlink(handle.path)


def test_a_key_deleted_during_the_copy_is_not_handed_over(monkeypatch, buf):
    buf["x"] = np.ones(4 * MB // 8)
    during_the_copy(monkeypatch, buf, lambda: buf.__delitem__("x"))
    assert buf.export("x") is None
    assert "x" not in buf
    assert files(buf) == []  # the new file went too


def test_a_key_replaced_during_the_copy_keeps_its_new_value(monkeypatch, buf):
    buf["x"] = np.ones(4 * MB // 8)
    during_the_copy(monkeypatch, buf, lambda: buf.__setitem__("x", np.full(4 * MB // 8, 7.0)))
    assert buf.export("x") is None  # the caller sends what it holds, as bytes
    assert "x" in buf.fast
    assert (buf["x"] == 7.0).all()
    assert files(buf) == []


def test_a_key_spilled_during_the_copy_goes_as_its_spilled_file(monkeypatch, buf):
    buf["x"] = np.arange(4 * MB // 8, dtype=float)
    during_the_copy(monkeypatch, buf, buf.evict)
    handle = buf.export("x")
    assert handle is not None
    assert os.stat(handle.path).st_ino == os.stat(buf.store.path("x")).st_ino
    assert len(files(buf)) == 1  # the spill's file; the export's own was dropped
    np.testing.assert_array_equal(buf["x"], np.arange(4 * MB // 8, dtype=float))
    os.unlink(handle.path)


def test_two_exports_of_one_key_racing_write_one_file(monkeypatch, buf):
    buf["x"] = np.arange(4 * MB // 8, dtype=float)
    second: list[Any] = []
    during_the_copy(monkeypatch, buf, lambda: second.append(buf.export("x")))
    first = buf.export("x")
    assert first is not None and second[0] is not None
    assert os.stat(first.path).st_ino == os.stat(second[0].path).st_ino
    assert len(files(buf)) == 1
    np.testing.assert_array_equal(buf["x"], np.arange(4 * MB // 8, dtype=float))
    os.unlink(first.path)
    os.unlink(second[0].path)


class _StoreCallingBack:
    """A tier's FileStore that runs ``during_put`` while a put is under way
    (after the file is written), delegating everything else."""

    def __init__(self, store: Any, during_put: Callable[[], Any]):
        self._store = store
        self._during_put = during_put

    def put(self, *args: Any) -> Any:
        stored = self._store.put(*args)
        self._during_put()
        return stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@contextlib.contextmanager
def calling_back(tier: Any, during_put: Callable[[], Any]) -> Iterator[None]:
    """``tier``'s store runs ``during_put`` in each put (FileTier is frozen:
    its field is swapped as its own dataclass machinery would)."""
    store = tier.store
    object.__setattr__(tier, "store", _StoreCallingBack(store, during_put))
    try:
        yield
    finally:
        object.__setattr__(tier, "store", store)


@pytest.fixture
def budgeted(shm_dir, tmp_path) -> Iterator[SharedSpillBuffer]:
    """A shared buffer whose tier 2 has a budget of 32 MiB."""
    buf = SharedSpillBuffer.create(
        64 * MB,
        root=shm_dir,
        disk_root=str(tmp_path),
        budget=32 * MB,
        min_size=64 * 1024,
        min_shared_fraction=0.5,
    )
    yield buf
    buf.close()


def test_a_write_in_flight_holds_its_room_and_lets_others_delete(budgeted):
    """TieredFiles.put copies without its lock: another thread deletes a
    file meanwhile, and the tier-2 budget counts the write's room until it
    is accounted under its own name."""
    tiers = budgeted.store.tiers
    first = tiers.tiers[0]
    budget = first.budget
    old, _ = tiers.put("old", [np.ones(4 * MB // 8)], 4 * MB)
    seen: dict[str, Any] = {}

    def another_thread_deletes() -> None:
        seen["used_during"] = budget.used
        t = threading.Thread(target=tiers.delete, args=(old,))
        t.start()
        t.join(timeout=30)
        seen["blocked"] = t.is_alive()
        seen["used_after_delete"] = budget.used

    with calling_back(first, another_thread_deletes):
        new, disk = tiers.put("new", [np.ones(8 * MB // 8)], 8 * MB)
    assert seen["blocked"] is False
    assert seen["used_during"] >= 4 * MB + 8 * MB  # the old file and the write's room
    assert 8 * MB <= seen["used_after_delete"] < 12 * MB
    assert budget.used == disk  # the room became the new file's own entry
    assert tiers.tier_of(new) == first.number
    tiers.delete(new)
    assert budget.used == 0


def test_an_export_finishing_after_close_leaves_no_file(monkeypatch, buf):
    buf["x"] = np.ones(4 * MB // 8)
    during_the_copy(monkeypatch, buf, buf.close)
    assert buf.export("x") is None
    assert files(buf) == []


def test_a_write_that_fails_gives_its_room_back(budgeted):
    tiers = budgeted.store.tiers
    with pytest.raises(OSError):
        tiers.put("no/slashes", [np.ones(8)], 64)  # an invalid name: the store refuses it
    assert tiers.tiers[0].budget.used == 0
    first = tiers.tiers[0]

    def interrupted() -> None:
        raise KeyboardInterrupt

    with calling_back(first, interrupted), pytest.raises(KeyboardInterrupt):
        tiers.put("interrupted", [np.ones(8)], 64)
    assert first.budget.used == 0 and len(first.budget) == 0  # no reservation left
