"""Issue 12 item 6: the price of noticing in-place writes on eviction.

A 256 MiB value unspilled from a shared file (mapped, every page read) is
evicted again. ``stock`` re-serializes it into a new file, as a store that
cannot tell whether the value changed must (and as stock distributed always
does); ``ours`` asks :func:`dask_shm.shared.dirty.written_in_place` (one read
of /proc/self/maps and 8 bytes of /proc/self/pagemap per page) and, finding
it unchanged, writes nothing.

Run: ``pytest benches/bench_dirty.py``.
"""

from __future__ import annotations

import os
import tempfile

import dask.config
import numpy as np
import pytest

from dask_shm import SpillBuffer
from dask_shm.shared import SharedSpillBuffer, dirty

SIZE = 256 * 2**20


@pytest.fixture(scope="module")
def mapped_value():
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm") as root,
        dask.config.set({"shm.shared-memory.root": root}),
    ):
        buf = SharedSpillBuffer.from_config(2**40)
        buf["x"] = np.ones(SIZE // 8)
        buf.evict()
        value = buf["x"]
        float(value.sum())  # every page read
        yield buf, value, root
        del value
        buf.close()


@pytest.mark.parametrize("impl", ["stock", "ours"])
def test_evict_unchanged(benchmark, mapped_value, impl: str) -> None:
    buf, value, root = mapped_value
    path = buf.store.path("x")
    store = SpillBuffer(os.path.join(root, "rewrite"), target=2**40)

    def rewrite() -> None:
        store["y"] = value
        store.evict()
        del store["y"]

    def check() -> None:
        assert not dirty.written_in_place(path)

    benchmark.pedantic(rewrite if impl == "stock" else check, rounds=10, warmup_rounds=1)
    benchmark.extra_info["bytes"] = SIZE
    store.close()
