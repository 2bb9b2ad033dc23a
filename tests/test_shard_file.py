"""A P2P shard batch as a file (dask_shm.shared.shard_file): what a sender
writes comes back equal on the receiver's side, whatever its shape, and a
file that is not the one announced is refused with ShardFileError."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dask_shm.shared import shard_file
from dask_shm.shared.shard_file import ShardFileError


def rechunk_batch(shards: int) -> list:
    """What ArrayRechunkRun sends: (input id, [(output id, (shard id, array))])."""
    rng = np.random.default_rng(0)
    return [
        ((0, 0), [((0, i), ((i, 0), rng.random((3 + i % 5, 2)))) for i in range(shards)]),
    ]


def assert_same_batch(got: list, sent: list) -> None:
    assert len(got) == len(sent)
    for (id_got, payload_got), (id_sent, payload_sent) in zip(got, sent, strict=True):
        assert id_got == id_sent
        for (out_got, (shard_got, a)), (out_sent, (shard_sent, b)) in zip(
            payload_got, payload_sent, strict=True
        ):
            assert (out_got, shard_got) == (out_sent, shard_sent)
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shards", [1, 2500])
def test_a_batch_comes_back_equal_and_its_file_goes(tmp_path, shards):
    # 2500 arrays: more buffers than one writev call takes (IOV_MAX, 1024).
    sent = rechunk_batch(shards)
    path = str(tmp_path / "batch.p2p")
    size, nonce = shard_file.write(path, sent)
    got = shard_file.read(path, size, nonce)
    assert not os.path.exists(path)
    assert_same_batch(got, sent)
    array = got[0][1][0][1][1]
    assert array.flags.writeable and array.ctypes.data % 64 == 0
    array[0, 0] = -1.0  # a private copy-on-write page: the sender's array is untouched
    assert sent[0][1][0][1][1][0, 0] != -1.0


def test_a_batch_of_bytes_comes_back_as_bytes(tmp_path):
    path = str(tmp_path / "batch.p2p")
    size, nonce = shard_file.write(path, b"x" * 100_000)
    assert shard_file.read(path, size, nonce) == b"x" * 100_000


def dataframe_batch() -> list:
    """What DataFrameShuffleRun sends: (input partition, arrow stream as bytes),
    with one shard under OUT_OF_BAND_BYTES."""
    import pandas as pd
    import pyarrow as pa
    from distributed.shuffle._arrow import serialize_table

    frames = [
        pd.DataFrame({"x": np.arange(n, dtype=float), "y": np.arange(n) % 7}) for n in (1, 5000)
    ]
    return [(i, serialize_table(pa.Table.from_pandas(df))) for i, df in enumerate(frames)]


@pytest.mark.parametrize("copy", [False, True])
def test_dataframe_shards_come_back_as_tables_without_copies_into_the_pickle(tmp_path, copy):
    from distributed.shuffle._arrow import buffers_to_table

    sent = dataframe_batch()
    assert [len(b) < shard_file.OUT_OF_BAND_BYTES for _, b in sent] == [True, False]
    path = str(tmp_path / "batch.p2p")
    size, nonce = shard_file.write(path, sent)
    with open(path, "rb") as f:
        head = f.read(shard_file._HEADER.size)
    # the large shard is written after the pickle, not into it; the small one in it
    assert shard_file._HEADER.unpack(head)[4] < len(sent[0][1]) + 256
    got = shard_file.read(path, size, nonce, copy=copy)
    assert [i for i, _ in got] == [i for i, _ in sent]
    assert [bytes(b) for _, b in got] == [b for _, b in sent]
    large = got[1][1]
    assert isinstance(large, memoryview) and large.readonly
    if not copy:  # a view of the mapping, at an aligned offset
        assert np.frombuffer(large, np.uint8).ctypes.data % 64 == 0
    # distributed's receive path reads them as it reads bytes
    assert buffers_to_table(got).equals(buffers_to_table(sent))


class DefinedInMain:
    """Stands for a class of the sender's script: pickled by value."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DefinedInMain) and other.payload == self.payload


def test_objects_of_main_go_by_value_as_distributed_sends_them(tmp_path, monkeypatch):
    monkeypatch.setattr(DefinedInMain, "__module__", "__main__")
    sent = [(0, DefinedInMain(b"z" * 5000))]
    path = str(tmp_path / "batch.p2p")
    size, nonce = shard_file.write(path, sent)
    # cloudpickle wrote the class itself: the reader needs no __main__ of ours
    monkeypatch.setattr(DefinedInMain, "__module__", __name__)
    with open(path, "rb") as f:
        assert b"DefinedInMain" in f.read()
    got = shard_file.read(path, size, nonce)
    assert got[0][0] == 0 and got[0][1].payload == b"z" * 5000


@pytest.mark.parametrize(
    "damage", ["shorter", "other nonce", "missing", "forged length", "forged count"]
)
def test_a_file_that_is_not_the_one_announced_is_refused(tmp_path, damage):
    path = str(tmp_path / "batch.p2p")
    size, nonce = shard_file.write(path, rechunk_batch(3))
    if damage == "shorter":
        os.truncate(path, size - 1)
    elif damage == "other nonce":
        nonce = "00" * 16
    elif damage == "missing":
        os.unlink(path)
    else:
        # A header that asks for more than the file holds: ShardFileError,
        # as for any other file that is not the one announced.
        with open(path, "r+b") as f:
            if damage == "forged length":
                f.seek(shard_file._HEADER.size)
                f.write(shard_file._LENGTH.pack(2**60))
            else:
                magic, found, kind, _, body = shard_file._HEADER.unpack(
                    f.read(shard_file._HEADER.size)
                )
                f.seek(0)
                f.write(shard_file._HEADER.pack(magic, found, kind, 2**58, body))
    with pytest.raises(ShardFileError):
        shard_file.read(path, size, nonce)
