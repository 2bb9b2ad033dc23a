"""Non-contiguous numpy arrays (slices such as ``a[1:, 1:]``, what dask's
getitem tasks hand over) written to our files from their rows, without the
contiguous copy distributed's serializer makes: the files and the values
read back are those of that copy, in every buffer, and arrays whose rows
are not contiguous take the copy as before."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from distributed.protocol import serialize
from distributed.spill import SpillBuffer as StockSpillBuffer

from dask_shm import SpillBuffer
from dask_shm._core import FileStore
from dask_shm.spill_store import (
    STRIDED_MIN_BYTES,
    compress_frames,
    frames_to_object,
    pack_header,
    serialize_unsplit,
)

BASE = np.arange(600 * 700, dtype="f8").reshape(600, 700)

#: views whose innermost axis is contiguous: written row by row
GATHERED = {
    "a[1:, 1:]": BASE[1:, 1:],
    "a[:-1, 3:-2]": BASE[:-1, 3:-2],
    "a[::-2, 5:]": BASE[::-2, 5:],
    "3-d a[:, ::2, 1:]": BASE.reshape(6, 100, 700)[:, ::2, 1:],
    "int32 rows": np.arange(300 * 4000, dtype="i4").reshape(300, 4000)[2:, 7:],
    "complex, read-only": np.require(BASE[2:, 2:].astype("c16"), requirements="C")[1:, 1:],
}
GATHERED["complex, read-only"].flags.writeable = False

#: arrays distributed's serializer handles as before (copied or not at all)
UNCHANGED = {
    "innermost axis strided": BASE[:, ::2],
    "small": BASE[:20, 1:60],
    "F-contiguous": np.asfortranarray(BASE),
    "contiguous": BASE[10:],
    "broadcast": np.broadcast_to(BASE[0], (300, 700)),
    "object dtype": np.array([[1, "x"] * 5000, [2, "y"] * 5000], dtype=object)[:, 1:],
    "structured": np.zeros((300, 300), dtype=[("a", "f8"), ("b", "i4")])[1:, 1:],
    "datetime": np.arange(300 * 300).astype("M8[ns]").reshape(300, 300)[1:, 1:],
}


def _stored_bytes(tmp_path: Any, frames: list) -> bytes:
    store = FileStore(str(tmp_path / "files"))
    name, _ = store.put("k", frames, 1)
    with open(store.path(name), "rb") as f:
        return f.read()


@pytest.mark.parametrize("name", list(GATHERED))
def test_a_sliced_array_is_stored_as_its_contiguous_copy_would_be(tmp_path, name):
    view = GATHERED[name]
    assert view.nbytes >= STRIDED_MIN_BYTES and not view.flags.c_contiguous
    header, frames = serialize_unsplit(view, lambda *_: None)
    assert len(frames) == 1 and frames[0] is view  # no copy made
    copy_header, copy_frames = serialize_unsplit(np.ascontiguousarray(view), lambda *_: None)
    assert header == copy_header
    ours = _stored_bytes(tmp_path / "ours", [pack_header(header), *frames])
    copied = _stored_bytes(tmp_path / "copy", [pack_header(copy_header), *copy_frames])
    assert ours == copied
    # and it reads back, mapped, as the copy stock's serializer sends
    stock_header, stock_frames = serialize(view)
    store = FileStore(str(tmp_path / "read"))
    stored, _ = store.put("k", [pack_header(header), *frames], 1)
    back = frames_to_object(store.read_mapped(stored))
    np.testing.assert_array_equal(back, view)
    assert back.dtype == view.dtype and back.flags.c_contiguous
    assert back.flags.writeable == stock_header["sub-header"]["writeable"][0]
    assert stock_header["sub-header"] == header["sub-header"]


@pytest.mark.parametrize("name", list(UNCHANGED))
def test_other_arrays_serialize_as_distributed_serializes_them(name):
    value = UNCHANGED[name]
    header, frames = serialize_unsplit(value, lambda *_: None)
    stock_header, stock_frames = serialize(value, on_error="raise")
    assert header["sub-header"] == stock_header["sub-header"]
    assert all(memoryview(f).contiguous for f in frames)
    assert [bytes(f) for f in frames] == [bytes(f) for f in stock_frames]


def test_a_sliced_array_compresses_as_its_copy(tmp_path):
    view = GATHERED["a[1:, 1:]"]
    header, frames = compress_frames(*serialize_unsplit(view, lambda *_: None), "zlib")
    copy = compress_frames(*serialize_unsplit(np.ascontiguousarray(view), lambda *_: None), "zlib")
    assert header == copy[0]
    assert [bytes(f) for f in frames] == [bytes(f) for f in copy[1]]
    np.testing.assert_array_equal(frames_to_object([pack_header(header), *frames]), view)


@pytest.mark.parametrize("kind", ["private", "private-mapped", "shared"])
def test_sliced_arrays_spill_and_come_back_as_in_stock(tmp_path, kind, shared_spill_buffer):
    stock = StockSpillBuffer(str(tmp_path / "stock"), target=1)
    if kind == "shared":
        ours = shared_spill_buffer(target=1)
    else:
        ours = SpillBuffer(str(tmp_path / "ours"), target=1, memmap=kind == "private-mapped")
    values = {**GATHERED, **UNCHANGED}
    for buf in (stock, ours):
        for key, value in values.items():
            buf[key] = value  # over target: written to a file at once
        assert set(buf.slow) == set(values)
    for key, value in values.items():
        got, want = ours[key], stock[key]
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, value)


def test_a_sliced_array_is_written_without_a_copy(tmp_path):
    """The write allocates nothing of the array's size (tracemalloc sees
    numpy's buffers and Python's ``bytes``, the two copies there were)."""
    import tracemalloc

    store = FileStore(str(tmp_path / "files"))
    view = BASE[1:, 1:]  # 3.2 MB
    narrow = np.ones((4000, 300))[:, 1:]  # rows of 2,392 bytes: copied by the store
    cases = {"sliced": view, "innermost axis strided": BASE[:, ::2], "narrow rows": narrow}
    serialize(BASE[:2, 1:])  # distributed's numpy serializer, imported on first use
    peaks = {}
    for name, value in cases.items():
        tracemalloc.start()
        try:
            header, frames = serialize_unsplit(value, lambda *_: None)
            store.put(name, [pack_header(header), *frames], 1)
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks["sliced"] < view.nbytes / 10, peaks
    # the check sees a copy where one is made: distributed's, or the store's
    assert peaks["innermost axis strided"] >= BASE[:, ::2].nbytes, peaks
    assert peaks["narrow rows"] >= narrow.nbytes, peaks


def test_a_sliced_array_that_does_not_fit_leaves_nothing_behind():
    """A full tmpfs refuses the row-by-row write as it refuses any other: an
    OSError, no file left, and the store still takes what fits."""
    import errno
    import os

    from tmpfs import small_tmpfs

    view = BASE[1:, 1:]  # 3.2 MB
    with small_tmpfs("2m") as root:
        store = FileStore(os.path.join(root, "files"))
        header, frames = serialize_unsplit(view, lambda *_: None)
        with pytest.raises(OSError) as raised:
            store.put("big", [pack_header(header), *frames], 1)
        assert raised.value.errno == errno.ENOSPC
        assert os.listdir(store.directory) == [] and store.total() == (0, 0)
        small = BASE[:100, 1:200]  # 159 KB, sliced too
        header, frames = serialize_unsplit(small, lambda *_: None)
        name, _ = store.put("small", [pack_header(header), *frames], 1)
        np.testing.assert_array_equal(frames_to_object(store.read_mapped(name)), small)
