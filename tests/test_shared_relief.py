"""Tier 2 gives way under memory pressure (dask_shm.shared.relief), as stock's
spilling gives managed memory way: a full tier 2 must not get a worker
restarted that stock keeps."""

from __future__ import annotations

import logging
import os
import random
import re
import sys
import threading
import time

import numpy as np
import pytest
from distributed import KilledWorker, wait

from dask_shm.shared import SharedSpillBuffer, shm_metrics
from dask_shm.shared.relief import SPILL_RECHECK, Tier2Relief

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clusters import process_cluster  # noqa: E402
from p2p_workload import shared_config  # noqa: E402

MiB = 2**20
GiB = 2**30


# --- the policy, on a real buffer in one process ---------------------------------


def _buffer(target: int, root: str, tmp_path) -> SharedSpillBuffer:
    """A shared buffer of ``target`` bytes in memory, tier 2 of 40 MiB in
    ``root``, tier 3 below ``tmp_path``."""
    return SharedSpillBuffer.create(
        target,
        root=root,
        disk_root=str(tmp_path / "disk"),
        budget=40 * MiB,
        min_size=64 * 1024,
        min_shared_fraction=0.5,
    )


@pytest.fixture
def tier2_buffer(shm_dir, tmp_path):
    buf = _buffer(0, shm_dir, tmp_path)  # everything goes to files
    yield buf
    buf.close()


def test_tier2_is_capped_above_spill_and_given_back_below_target(tier2_buffer):
    buf = tier2_buffer
    tiers = buf.store.tiers
    values = {f"k{i}": np.full(MiB, i, dtype="f8") for i in range(4)}  # 8 MiB each
    for k, v in values.items():
        buf[k] = v
    assert {tiers.tier_of(buf.store.file_of(k)) for k in values} == {2}
    rest = [50 * MiB]  # the worker's memory besides tier 2

    relief = Tier2Relief(
        buf, lambda: rest[0] + buf.tier2_bytes(), limit=100 * MiB, spill=0.7, target=0.6
    )
    # 50 + 32 MiB > 70 (spill): tier 2 may keep 60 - 50 = 10 MiB, one file.
    moved = relief.check()
    assert relief.capped and relief.episodes == 1
    assert tiers.tier("shared").budget.limit == 10 * MiB
    where = {k: tiers.tier_of(buf.store.file_of(k)) for k in values}
    assert sorted(where.values()) == [2, 3, 3, 3], where
    assert where["k3"] == 2, "the most recently used file stays"
    assert moved >= 24 * MiB and buf.tier2_bytes() <= 10 * MiB
    # A spill while capped goes past tier 2.
    buf["k4"] = np.full(MiB, 4, dtype="f8")
    assert tiers.tier_of(buf.store.file_of("k4")) == 3

    # Between target and spill, the cap stays.
    rest[0] = 55 * MiB
    assert relief.check() == 0 and tiers.tier("shared").budget.limit == 10 * MiB
    # Below target, it rises with the room left, then goes when it reaches the budget.
    rest[0] = 40 * MiB
    relief.check()
    assert relief.capped and tiers.tier("shared").budget.limit == 20 * MiB
    rest[0] = 10 * MiB
    relief.check()
    assert not relief.capped and tiers.tier("shared").budget.limit == 40 * MiB
    buf["k5"] = np.full(MiB, 5, dtype="f8")
    assert tiers.tier_of(buf.store.file_of("k5")) == 2

    values.update(k4=np.full(MiB, 4, dtype="f8"), k5=np.full(MiB, 5, dtype="f8"))
    for k, v in values.items():
        np.testing.assert_array_equal(buf[k], v)


def test_files_mapped_by_values_in_memory_stay(tier2_buffer):
    buf = tier2_buffer
    tiers = buf.store.tiers
    for i in range(3):
        buf[f"k{i}"] = np.full(MiB, i, dtype="f8")
    buf.n = 64 * MiB  # room in memory: a read keeps the value mapped
    held = buf["k0"]  # mapped: its file is pinned
    assert "k0" in buf.store.retained
    relief = Tier2Relief(buf, lambda: 90 * MiB, limit=100 * MiB, spill=0.7, target=0.6)
    relief.check()
    assert tiers.tier("shared").budget.limit == 0
    assert tiers.tier_of(buf.store.file_of("k0")) == 2
    assert {tiers.tier_of(buf.store.file_of(k)) for k in ("k1", "k2")} == {3}
    # Once the value leaves memory (distributed's eviction), the next check moves it.
    buf.evict()
    del held
    relief.check()
    assert tiers.tier_of(buf.store.file_of("k0")) == 3
    np.testing.assert_array_equal(buf["k0"], np.full(MiB, 0, dtype="f8"))


def test_a_spill_under_a_new_cap_moves_one_step_not_the_whole_tier(tier2_buffer):
    """The thread that spills (a worker's event loop) moves about as much as
    it writes, not all that a lowered cap put over budget: the rest is the
    relief thread's, in steps."""
    buf = tier2_buffer
    tiers = buf.store.tiers
    for i in range(4):
        buf[f"k{i}"] = np.full(MiB, i, dtype="f8")  # 8 MiB each, in tier 2
    buf.cap_tier2(0)
    buf["small"] = np.full(2**17, 9, dtype="f8")  # 1 MiB, spilled at once
    where = {k: tiers.tier_of(buf.store.file_of(k)) for k in ("k0", "k1", "k2", "k3", "small")}
    # One file (the least recently used) moved, the new one went past tier 2.
    assert where == {"k0": 3, "k1": 2, "k2": 2, "k3": 2, "small": 3}, where

    relief = Tier2Relief(buf, lambda: 90 * MiB, limit=100 * MiB, spill=0.7, target=0.6)
    assert relief.check() >= 24 * MiB
    assert {tiers.tier_of(buf.store.file_of(k)) for k in ("k1", "k2", "k3")} == {3}
    assert buf.tier2_bytes() == 0
    for i in range(4):
        np.testing.assert_array_equal(buf[f"k{i}"], np.full(MiB, i, dtype="f8"))
    np.testing.assert_array_equal(buf["small"], np.full(2**17, 9, dtype="f8"))


def test_a_long_move_lets_other_threads_in_between_its_steps(shm_dir, tmp_path):
    """The relief thread moves a capped tier 2 in steps so that a worker's
    event loop waits one step at most: it must not take the buffer's lock
    again at once after each step (Python's locks are not fair; before the
    pause between steps, a reader waited 22-41 steps of 41 on the dev box)."""
    buf = SharedSpillBuffer.create(
        0,
        root=shm_dir,
        disk_root=str(tmp_path / "disk"),
        budget=GiB,
        min_size=64 * 1024,
        min_shared_fraction=0.5,
    )
    try:
        for i in range(24):
            buf[f"k{i}"] = np.full(2 * MiB, i, dtype="f8")  # 16 MiB each, in tier 2
        relief = Tier2Relief(
            buf, lambda: 150 * MiB + buf.tier2_bytes(), limit=200 * MiB, spill=0.7, target=0.6
        )
        steps = [0]
        relieve = buf.relieve_tier2

        def counted(max_bytes: int) -> int:
            moved = relieve(max_bytes)
            steps[0] += 1
            return moved

        buf.relieve_tier2 = counted  # type: ignore[method-assign]
        seen: list[int] = []  # the step count each time the reader got in
        done = threading.Event()

        def read() -> None:
            while not done.is_set():
                buf.check_readable("k23")  # takes the buffer's lock
                seen.append(steps[0])

        reader = threading.Thread(target=read)
        reader.start()
        try:
            assert relief.check() >= 23 * 16 * MiB
        finally:
            done.set()
            reader.join()
        assert steps[0] >= 23
        during = [n for n in seen if n < steps[0]]
        gaps = [b - a for a, b in zip([0, *during], [*during, steps[0]], strict=True)]
        assert max(gaps) <= 5, gaps
        for i in range(24):
            np.testing.assert_array_equal(buf[f"k{i}"], np.full(2 * MiB, i, dtype="f8"))
    finally:
        buf.close()


def test_stop_gives_the_budget_back(tier2_buffer):
    buf = tier2_buffer
    relief = Tier2Relief(
        buf, lambda: 90 * MiB, limit=100 * MiB, spill=0.7, target=0.6, interval=0.01
    ).start()
    deadline = time.monotonic() + 10
    while not relief.capped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert buf.store.tiers.tier("shared").budget.limit == 0
    relief.stop()
    assert buf.store.tiers.tier("shared").budget.limit == 40 * MiB


def test_a_value_spilled_over_spill_goes_to_disk_at_once(shm_dir, tmp_path):
    """The cap follows the memory at the moment of a spill, not at the
    thread's last check: over ``spill`` the value is written to disk once,
    never to tmpfs first (where, until moved, it would be held twice)."""
    buf = _buffer(20 * MiB, shm_dir, tmp_path)
    try:
        tiers = buf.store.tiers
        rest = [30 * MiB]  # the worker's memory besides tier 2
        # No thread: only the buffer's calls set the cap.
        relief = Tier2Relief(
            buf, lambda: rest[0] + buf.tier2_bytes(), limit=100 * MiB, spill=0.7, target=0.6
        )
        buf.before_spill = relief.before_spill
        for k in "abc":  # 8 MiB each against a 20 MiB target: "a" spills
            buf[k] = np.full(MiB, ord(k), dtype="f8")
        assert tiers.tier_of(buf.store.file_of("a")) == 2
        assert not relief.capped

        rest[0] = 80 * MiB  # over spill (70 MiB) since the last spill
        time.sleep(SPILL_RECHECK)
        buf["d"] = np.full(MiB, ord("d"), dtype="f8")  # "b" spills
        assert tiers.tier_of(buf.store.file_of("b")) == 3
        assert relief.capped and relief.episodes == 1
        assert tiers.tier("shared").budget.limit == 0
        assert relief.moved_bytes == 0, "nothing went through tmpfs on its way to disk"
        for k in "abcd":
            np.testing.assert_array_equal(buf[k], np.full(MiB, ord(k), dtype="f8"))

        # A check that fails leaves the cap as it is and the spill goes on.
        rest[0] = None  # memory() now raises TypeError
        time.sleep(SPILL_RECHECK)
        buf["e"] = np.full(MiB, ord("e"), dtype="f8")  # "c" spills
        assert tiers.tier_of(buf.store.file_of("c")) == 3
        np.testing.assert_array_equal(buf["c"], np.full(MiB, ord("c"), dtype="f8"))

        relief.stop()
        assert buf.before_spill is None
        assert tiers.tier("shared").budget.limit == 40 * MiB
    finally:
        buf.close()


def test_values_survive_a_cap_that_swings_while_threads_use_the_buffer(shm_dir, tmp_path):
    """The relief thread moving files while other threads store, read, hold,
    delete and evict values (as a worker's loop, its task threads and its
    offload thread do) loses and corrupts nothing."""
    buf = _buffer(16 * MiB, shm_dir, tmp_path)
    rest = [0]  # the worker's memory besides tier 2: swings around spill
    relief = Tier2Relief(
        buf,
        lambda: rest[0] + buf.tier2_bytes(),
        limit=200 * MiB,
        spill=0.7,
        target=0.6,
        interval=0.005,
    ).start()
    buf.before_spill = relief.before_spill
    expected: dict[str, tuple[int, float]] = {}
    lock = threading.Lock()  # a buffer's callers are serialised, as in a worker
    errors: list[object] = []
    deadline = time.monotonic() + 3

    def use(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        try:
            while time.monotonic() < deadline:
                key, op = f"k{rng.randrange(60)}", rng.random()
                with lock:
                    if op < 0.4:
                        n = rng.choice([2**14, 2**17, 2**20])  # 128 KiB - 8 MiB
                        x = float(rng.randrange(1000))
                        buf[key] = np.full(n, x)
                        expected[key] = (n, x)
                    elif op < 0.75 and key in expected:
                        value, (n, x) = buf[key], expected[key]
                        if value.shape != (n,) or value[0] != x or value[-1] != x:
                            errors.append((key, value.shape, expected[key]))
                        held.append(value)  # mapped values pin their files
                    elif op < 0.85 and key in expected:
                        del buf[key], expected[key]
                    elif buf.fast:
                        buf.evict()
                del held[:-5]
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    def swing() -> None:
        rng = random.Random(0)
        while time.monotonic() < deadline:
            rest[0] = rng.choice([0, 50 * MiB, 110 * MiB, 150 * MiB])
            time.sleep(0.02)
        rest[0] = 0

    threads = [threading.Thread(target=use, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=swing))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        assert relief.episodes > 5 and relief.moved_bytes > 0
        relief.stop()
        for key, (n, x) in expected.items():
            np.testing.assert_array_equal(buf[key], np.full(n, x))
        tier2 = buf.store.tiers.tier("shared").budget
        assert tier2.limit == 40 * MiB
    finally:
        relief.stop()
        buf.close()


def test_thresholds_are_checked():
    with pytest.raises(ValueError, match="target"):
        Tier2Relief(None, int, limit=GiB, spill=0.6, target=0.7)  # type: ignore[arg-type]


# --- a real worker and nanny, stock against shared ----------------------------------

LIMIT = GiB
VALUE = 10 * MiB
VALUES = 20


def _make(i: int) -> np.ndarray:
    return np.random.default_rng(i).random(VALUE // 8)


def _evict_all(dask_worker) -> int:
    """What distributed's spilling does under pressure: evict every value in memory."""
    data = dask_worker.data
    n = 0
    while data.fast and data.evict() != -1:
        n += 1
    return n


def _grow_private_memory(fraction: float, limit: int) -> int:
    """Allocate private memory in steps until the process's private memory
    is ``fraction`` of ``limit`` (a shuffle's transient memory growing), hold
    it a while, free it; returns the bytes allocated."""
    from dask_shm.procmem import process_memory

    chunks = []
    step = 16 * MiB
    while process_memory().private + step <= fraction * limit:
        chunks.append(np.ones(step, dtype="u1"))
        time.sleep(0.05)
    time.sleep(2)
    return sum(c.nbytes for c in chunks)


@pytest.mark.parametrize("mode", ["stock", "shared"])
def test_a_full_tier2_does_not_get_a_worker_restarted_that_stock_keeps(shm_dir, mode):
    """Spilled values fill tier 2 (~200 MiB of a 1 GiB worker), then a task's
    private memory grows to 82% of the limit: stock's spilled values are on
    disk and count nothing, so it stays below terminate (95%); in shared
    mode tier 2 must give way the same, instead of adding its 200 MiB."""
    config = shared_config(shm_dir) if mode == "shared" else {}
    with process_cluster(1, LIMIT, config) as client:
        futures = [client.submit(_make, i, key=f"v-{i}") for i in range(VALUES)]
        wait(futures)
        assert sum(client.run(_evict_all).values()) == VALUES
        if mode == "shared":
            (before,) = client.run(shm_metrics).values()
            assert before["shared_bytes"] >= 0.9 * VALUES * VALUE, before
            # Spills ask the relief for the cap of the moment.
            (wired,) = client.run(
                lambda dask_worker: dask_worker.data.before_spill is not None
            ).values()
            assert wired
        grown = client.submit(_grow_private_memory, 0.82, LIMIT, pure=False).result(timeout=120)
        assert grown > 300 * MiB
        assert not client.get_events("worker-restart-memory")
        assert len(client.scheduler_info()["workers"]) == 1
        sums = client.gather([client.submit(np.sum, f) for f in futures])
        assert sums == [pytest.approx(float(np.sum(_make(i)))) for i in range(VALUES)]
        if mode == "shared":
            (after,) = client.run(shm_metrics).values()
            assert after["disk_moves"] >= VALUES // 2, after
            # The gather read the values back into memory (200 MiB beside the
            # worker's own), which leaves tier 2 less than its budget below
            # target. Spilled again, memory is well below target: tier 2 has
            # its whole budget again.
            client.run(_evict_all)
            deadline = time.monotonic() + 30
            while after["shared_budget"] < before["shared_budget"]:
                assert time.monotonic() < deadline, (before, after)
                time.sleep(0.1)
                (after,) = client.run(shm_metrics).values()


def test_the_nanny_says_what_it_counted_when_it_restarts_a_worker(shm_dir, caplog):
    """Past terminate (95%) the nanny restarts a shared-mode worker, as stock's
    does, and its warning gives the two parts it added up (private memory,
    the worker's share of shared files) and the limit."""
    config = {**shared_config(shm_dir), "distributed.scheduler.allowed-failures": 0}
    with (
        caplog.at_level(logging.WARNING, logger="distributed.nanny"),
        process_cluster(1, LIMIT, config) as client,
    ):
        growing = client.submit(_grow_private_memory, 1.1, LIMIT, pure=False)
        with pytest.raises(KilledWorker):
            growing.result(timeout=120)
        assert client.get_events("worker-restart-memory")
    (warning,) = [r.getMessage() for r in caplog.records if "exceeded 95%" in r.getMessage()]
    assert re.search(
        r"private memory [\d.]+ [MG]iB plus its share of shared-memory files "
        r"[\d.]+ [kMG]?i?B, limit 1\.00 GiB\)\. Restarting",
        warning,
    ), warning
