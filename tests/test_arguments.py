"""Arguments users pass by hand: byte sizes read as distributed reads them
("1GiB"), and a bad value refused at construction with an error naming the
parameter, never a raw TypeError at the first write."""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import pytest

from dask_shm import SpillBuffer, SpillFileError
from dask_shm.shared import SharedSpillBuffer


def test_spill_buffer_reads_byte_sizes_like_distributed(tmp_path):
    buf = SpillBuffer(str(tmp_path), target="1 KiB", max_spill="10GiB")
    buf["small"] = np.zeros(10, dtype="u1")
    buf["big"] = np.zeros(4096, dtype="u1")  # larger than 1 KiB: straight to disk
    assert "small" in buf.fast
    assert "big" in buf.slow
    assert (buf["big"] == 0).all()


def test_numpy_integers_are_byte_sizes(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=np.int64(1024), max_spill=np.uint32(1 << 20))
    buf["big"] = np.zeros(4096, dtype="u1")
    assert "big" in buf.slow


def test_spill_buffer_max_spill_as_a_string_is_enforced(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=0, max_spill="8 KiB")
    buf["a"] = np.zeros(6000, dtype="u1")
    buf["b"] = np.zeros(6000, dtype="u1")  # would take the disk past 8 KiB
    assert "a" in buf.slow
    assert "b" in buf.fast
    assert buf.spilled_total.disk <= 8192


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"target": "lots"}, ValueError, "target must be a byte size"),
        ({"target": -1}, ValueError, "target must be a whole number of bytes >= 0"),
        ({"target": 0.6}, ValueError, "target must be a whole number"),
        ({"target": None}, TypeError, "target must be a byte size"),
        ({"target": True}, TypeError, "target must be a byte size"),
        ({"target": float("inf")}, ValueError, "target must be a whole number"),
        ({"target": 100, "max_spill": -1}, ValueError, "max_spill must be a whole number"),
        ({"target": 100, "max_spill": "10 gigs"}, ValueError, "max_spill must be a byte size"),
        ({"target": 100, "max_spill": None}, TypeError, "max_spill must be False or a byte"),
        ({"target": 100, "max_spill": True}, TypeError, "max_spill must be False or a byte"),
    ],
)
def test_spill_buffer_refuses_bad_sizes_at_construction(tmp_path, kwargs, error, words):
    directory = tmp_path / "spill"
    with pytest.raises(error, match=words):
        SpillBuffer(str(directory), **kwargs)
    assert not directory.exists()  # refused before anything was made


def _shared_args(shm_dir: str, tmp_path: Any) -> dict[str, Any]:
    return {
        "root": shm_dir,
        "disk_root": str(tmp_path / "disk"),
        "budget": 64 << 20,
        "min_size": 64 * 1024,
        "min_shared_fraction": 0.5,
    }


def test_shared_buffer_reads_byte_sizes(shm_dir, tmp_path):
    args = {**_shared_args(shm_dir, tmp_path), "budget": "64MiB", "min_size": "64 KiB"}
    buf = SharedSpillBuffer.create("1 KiB", max_spill="1GiB", **args)
    try:
        buf["x"] = np.zeros(1 << 20, dtype="u1")  # over target: to tier 2
        assert buf.tier2_bytes() >= 1 << 20
        assert buf.shared_bytes("x") >= 1 << 20  # the file: payload and its header
    finally:
        buf.close()


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"budget": "lots"}, ValueError, "budget must be a byte size"),
        ({"budget": [1]}, TypeError, "budget must be a byte size"),
        ({"min_size": -5}, ValueError, "min_size must be a whole number"),
        ({"min_shared_fraction": 3}, ValueError, "min_shared_fraction must be between 0 and 1"),
        ({"min_shared_fraction": float("nan")}, ValueError, "must be between 0 and 1"),
        ({"min_shared_fraction": "half"}, TypeError, "min_shared_fraction must be a number"),
        ({"max_spill": -1}, ValueError, "max_spill must be a whole number"),
        ({"target": "1 GiB each"}, ValueError, "target must be a byte size"),
    ],
)
def test_shared_buffer_refuses_bad_arguments(shm_dir, tmp_path, change, error, words):
    args: dict[str, Any] = {"target": 1 << 20, **_shared_args(shm_dir, tmp_path), **change}
    target = args.pop("target")
    with pytest.raises(error, match=words):
        SharedSpillBuffer.create(target, **args)
    assert os.listdir(shm_dir) == []  # refused before anything was made


def test_spill_file_error_is_public_and_travels(tmp_path):
    """A damaged file's error prints as users import it and unpickles (as it
    must to reach a client from a worker)."""
    assert repr(SpillFileError) == "<class 'dask_shm.SpillFileError'>"
    buf = SpillBuffer(str(tmp_path), target=0)
    buf["victim"] = np.arange(1_000)
    os.truncate(buf.store.path("victim"), 10)
    with pytest.raises(SpillFileError) as info:
        buf["victim"]
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is SpillFileError
    assert str(copy) == str(info.value)
