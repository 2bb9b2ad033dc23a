"""Shared-mode workers pack distributed's messages with a small starting
buffer (dask_shm.shared.pack_buffers): the same bytes as msgpack's own, and
switched on only where shared mode is."""

from __future__ import annotations

import logging

import msgpack
import numpy as np
import pytest
from clusters import process_cluster
from distributed.protocol import Serialize, dumps, loads

from dask_shm import compat
from dask_shm.shared import pack_buffers

SHARED = {
    "distributed.worker.preload": ["dask_shm"],
    "distributed.nanny.preload": ["dask_shm"],
    "shm.shared-memory.enabled": True,
}
DEFAULT = {
    "distributed.worker.preload": ["dask_shm"],
    "distributed.nanny.preload": ["dask_shm"],
}

MESSAGES = [
    "OK",
    {"op": "get_data", "keys": [("x", 1), ("y", 2)], "who": "tcp://127.0.0.1:1", "reply": True},
    # a batch longer than the 4 KiB starting buffer: the buffer grows
    [{"op": "task-finished", "key": ("sum", i), "nbytes": {"a": i}} for i in range(2000)],
    {"data": {"k": b"\0" * 300_000}, "status": "OK"},
    {"nested": [[1.5, None, True], {"s": "é" * 1000}], "big": 2**63 - 1},
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_the_same_bytes_as_msgpack(message: object) -> None:
    small = pack_buffers.SMALL_BUFFER_MSGPACK
    for kwargs in (
        {},
        {"use_bin_type": True},
        {"use_bin_type": True, "default": str},
        {"buf_size": 16},  # a caller's own starting size wins over ours
    ):
        assert small.dumps(message, **kwargs) == msgpack.dumps(message, **kwargs)
        assert small.packb(message, **kwargs) == msgpack.packb(message, **kwargs)
    assert small.loads is msgpack.loads


def test_distributed_messages_round_trip_once_installed() -> None:
    """Installing is process-wide: distributed's dumps/loads of a message with
    a serialized array still round-trip (and the hook stays recognised)."""
    pack_buffers.install()
    pack_buffers.install()  # idempotent
    assert pack_buffers.installed()
    array = np.arange(10_000.0)
    frames = dumps({"op": "x", "value": Serialize(array), "keys": [("a", 1)]})
    back = loads(frames)
    assert back["op"] == "x" and back["keys"] == (("a", 1),)
    np.testing.assert_array_equal(back["value"], array)
    assert compat.missing_hooks() == []


def _installed() -> bool:
    from dask_shm.shared import pack_buffers

    return pack_buffers.installed()


def test_shared_workers_pack_with_the_small_buffer_and_default_ones_do_not() -> None:
    with process_cluster(1, "1GiB", SHARED, silence_logs=logging.ERROR) as client:
        assert list(client.run(_installed).values()) == [True]
        value = client.submit(np.arange, 20_000.0).result()
        np.testing.assert_array_equal(value, np.arange(20_000.0))
    with process_cluster(1, "1GiB", DEFAULT, silence_logs=logging.ERROR) as client:
        assert list(client.run(_installed).values()) == [False]
