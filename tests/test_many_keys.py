"""100,000 keys in one worker's buffer, as a worker of a large graph holds
them: the drop-in buffer stays in step with stock's at that count, and in
shared mode every key is still held, read back and, once deleted, leaves no
file behind.

Real files (a tmp directory for the drop-in buffer, a fresh root on
/dev/shm for shared mode); no timing is asserted (``benches/bench_scale.py``
measures the event loop at this count).
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from distributed.spill import SpillBuffer as StockSpillBuffer
from test_shared_lifecycle import files_under
from test_spill_parity import check_same_state

from dask_shm import SpillBuffer
from dask_shm._core import flush_deletes

#: Each test takes about a minute on the 2-core dev box, alone; CI runs
#: distributed's tests beside it.
pytestmark = pytest.mark.timeout(900)

N_KEYS = 100_000
#: 3,125 of these values (64 bytes by sizeof) fit: the rest is spilled, one
#: file each.
TARGET = 200_000


def key_of(i: int) -> str | tuple[str, int]:
    """A key as a dask graph names it: tuples for chunks, strings otherwise."""
    return ("chunk", i) if i % 2 else f"task-{i}"


def value_of(i: int) -> np.ndarray:
    return np.full(8, i, dtype="i8")


def test_a_hundred_thousand_keys_match_stock(tmp_path, caplog):
    """Setting, reading a random tenth, deleting half and then the rest: the
    same keys in memory and on disk as stock, with the same weights, at
    every stage; the values read back are the ones written, and no file is
    left at the end."""
    caplog.set_level(logging.CRITICAL)
    stock = StockSpillBuffer(str(tmp_path / "stock"), target=TARGET)
    ours = SpillBuffer(str(tmp_path / "ours"), target=TARGET)
    for i in range(N_KEYS):
        stock[key_of(i)] = ours[key_of(i)] = value_of(i)
    check_same_state(stock, ours)
    assert len(ours.fast) == TARGET // value_of(0).nbytes
    assert len(files_under(str(tmp_path / "ours"))) == len(ours.slow)

    rng = random.Random(0)
    for i in rng.sample(range(N_KEYS), N_KEYS // 10):
        np.testing.assert_array_equal(stock[key_of(i)], value_of(i))
        np.testing.assert_array_equal(ours[key_of(i)], value_of(i))
    check_same_state(stock, ours)

    for i in range(0, N_KEYS, 2):
        del stock[key_of(i)], ours[key_of(i)]
    check_same_state(stock, ours)
    for i in range(1, N_KEYS, 2):
        del stock[key_of(i)], ours[key_of(i)]
    check_same_state(stock, ours)
    assert len(ours) == 0
    assert ours.spilled_total.memory == ours.spilled_total.disk == 0
    assert files_under(str(tmp_path / "ours")) == []


def test_a_hundred_thousand_shared_keys_are_held_and_leave_no_file(shm_dir, shared_spill_buffer):
    """Shared mode with every value a file (min-size 0): all keys held with
    their values, at most the buffer's bound of them mapped, the tier's
    accounting back to zero and the root empty once they are deleted."""
    buf = shared_spill_buffer(target=TARGET)
    for i in range(N_KEYS):
        buf[key_of(i)] = value_of(i)
    assert len(buf) == N_KEYS
    assert set(buf) == {key_of(i) for i in range(N_KEYS)}
    assert len(buf.store.retained) <= buf.max_mapped
    assert len(files_under(shm_dir)) >= len(buf.slow)

    for i in range(N_KEYS):
        np.testing.assert_array_equal(buf[key_of(i)], value_of(i))
    assert len(buf.store.retained) <= buf.max_mapped

    for i in range(N_KEYS):
        del buf[key_of(i)]
    assert len(buf) == 0
    assert buf.spilled_total.memory == buf.spilled_total.disk == 0
    flush_deletes()  # files are deleted off the caller's thread
    assert files_under(shm_dir) == []
