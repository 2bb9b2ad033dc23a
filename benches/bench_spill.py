"""SpillBuffer: stock distributed vs dask-shm, side by side in one run.

Run: ``pytest benches/bench_spill.py`` (ratios are printed at the end).
``ours-norecycle`` is dask-shm with file recycling off (every spill writes a
new file), to show what recycling contributes in the same run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import dask
import numpy as np
import pytest
from distributed.spill import SpillBuffer as StockSpillBuffer

from dask_shm import SpillBuffer

N_OPS = 2_000
BIG = 64 * 2**20  # 64 MiB
DIRS = {"shm": "/dev/shm", "disk": tempfile.gettempdir()}


def make(impl: str, directory: str, target: int) -> Any:
    if impl == "stock":
        return StockSpillBuffer(directory, target=target)
    if impl == "ours-norecycle":
        # every spill writes a new file, as before files were recycled
        with dask.config.set({"shm.spill-recycle-bytes": 0}):
            return SpillBuffer(directory, target=target)
    return SpillBuffer(directory, target=target, memmap=impl == "ours-mmap")


@pytest.fixture
def spill_dir(request: pytest.FixtureRequest) -> Any:
    where = getattr(request, "param", "shm")
    base = DIRS[where] if os.path.isdir(DIRS[where]) else tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix="dask-shm-bench-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


VALUES = [np.arange(10) + i for i in range(N_OPS)]
KEYS = [f"key-{i}" for i in range(N_OPS)]


def run_per_op(benchmark: Any, impl: str, spill_dir: str, op: str) -> None:
    """Time N_OPS set/get/del on a buffer that never spills; report per batch."""

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        buf = make(impl, os.path.join(spill_dir, str(len(os.listdir(spill_dir)))), 2**40)
        if op != "set":
            for k, v in zip(KEYS, VALUES, strict=True):
                buf[k] = v
        return (buf,), {}

    def do_set(buf: Any) -> None:
        for k, v in zip(KEYS, VALUES, strict=True):
            buf[k] = v

    def do_get(buf: Any) -> None:
        for k in KEYS:
            buf[k]

    def do_del(buf: Any) -> None:
        for k in KEYS:
            del buf[k]

    fn: Callable[[Any], None] = {"set": do_set, "get": do_get, "del": do_del}[op]
    benchmark.extra_info["ops"] = N_OPS
    benchmark.pedantic(fn, setup=setup, rounds=30, warmup_rounds=2)


@pytest.mark.parametrize("impl", ["stock", "ours"])
@pytest.mark.parametrize("op", ["set", "get", "del"])
def test_per_op_without_spilling(benchmark: Any, impl: str, op: str, spill_dir: str) -> None:
    benchmark.group = f"per-op {op} x{N_OPS} (no spill)"
    run_per_op(benchmark, impl, spill_dir, op)


def spill_then_delete(benchmark: Any, buf: Any, value: np.ndarray) -> None:
    """Time ``buf[key] = value`` (heavier than target: straight to a file);
    the key is deleted between rounds."""
    counter = iter(range(10**9))

    def setup() -> tuple[tuple[str], dict[str, Any]]:
        return (f"x{next(counter)}",), {}

    def spill(key: str) -> None:
        buf[key] = value

    def teardown(key: str) -> None:
        del buf[key]

    benchmark.pedantic(spill, setup=setup, teardown=teardown, rounds=15, warmup_rounds=1)


def spill_then_unspill(benchmark: Any, buf: Any) -> None:
    """Time ``buf.evict()`` of the one key (it fits in target); between rounds
    a copying read moves it back to memory and deletes its file. The buffer
    holds the only reference, so nothing is served from the weak-value cache."""

    def unspill() -> None:
        if "x" in buf.slow:
            assert buf["x"].nbytes == BIG
        assert "x" in buf.fast and "x" not in buf.slow

    def evict() -> None:
        assert buf.evict() > 0

    benchmark.pedantic(evict, setup=unspill, rounds=15, warmup_rounds=1)
    assert "x" in buf.slow


@pytest.mark.parametrize("spill_dir", ["shm", "disk"], indirect=True)
@pytest.mark.parametrize("impl", ["stock", "ours", "ours-norecycle"])
@pytest.mark.parametrize("cycle", ["del", "unspill"])
def test_spill_64mib(benchmark: Any, impl: str, spill_dir: str, cycle: str) -> None:
    """Spill bandwidth in a worker's steady state: one long-lived buffer
    spills a 64 MiB array, later gets rid of its file and spills again. Only
    the spill is timed; the warm-up round spills into an empty directory.

    - ``cycle=del``: the key is deleted (a task released its result);
    - ``cycle=unspill``: the key is read back with a copying read, which moves
      it to memory and deletes its file, then evicted again.
    """
    benchmark.group = f"spill 64 MiB to {os.path.dirname(spill_dir)}"
    benchmark.extra_info["bytes"] = BIG
    value = np.random.default_rng(0).random(BIG // 8)
    if cycle == "del":
        spill_then_delete(benchmark, make(impl, spill_dir, target=2**20), value)
    else:
        buf = make(impl, spill_dir, target=2 * BIG)
        buf["x"] = value
        del value
        spill_then_unspill(benchmark, buf)


@pytest.mark.parametrize("spill_dir", ["shm", "disk"], indirect=True)
@pytest.mark.parametrize("impl", ["stock", "ours", "ours-mmap"])
def test_unspill_64mib(benchmark: Any, impl: str, spill_dir: str) -> None:
    """Unspill: read a spilled 64 MiB array back (heavier than target, so it
    stays on disk and every round reads the file again)."""
    benchmark.group = f"unspill 64 MiB from {os.path.dirname(spill_dir)}"
    value = np.random.default_rng(0).random(BIG // 8)
    buf = make(impl, spill_dir, target=2**20)
    buf["x"] = value
    del value

    def unspill() -> None:
        got = buf["x"]
        assert got.nbytes == BIG

    benchmark.extra_info["bytes"] = BIG
    benchmark.pedantic(unspill, rounds=15, warmup_rounds=1)


@pytest.mark.parametrize("impl", ["stock", "ours", "ours-mmap"])
def test_unspill_64mib_and_read_every_page(benchmark: Any, impl: str, spill_dir: str) -> None:
    """Unspill and then sum the array: the mmap variant pays its page faults here,
    so this is the honest end-to-end comparison."""
    benchmark.group = "unspill 64 MiB from /dev/shm + sum"
    buf = make(impl, spill_dir, target=2**20)
    buf["x"] = np.random.default_rng(0).random(BIG // 8)

    def unspill_and_sum() -> None:
        buf["x"].sum()

    benchmark.extra_info["bytes"] = BIG
    benchmark.pedantic(unspill_and_sum, rounds=10, warmup_rounds=1)
