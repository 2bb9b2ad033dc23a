"""The sending side's comm proxy (dask_shm.shared.sender): a batch that
``get_data`` answers is swapped for hard-link handles, in the offload thread
when it is large, and no link outlives its request, also when the request
ends while the offloaded swap still runs."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np
import pytest
from dask.sizeof import sizeof
from distributed.protocol.core import dumps, loads
from distributed.protocol.serialize import Serialize, Serialized, to_serialize
from distributed.utils import offload

from dask_shm.shared import SharedSpillBuffer
from dask_shm.shared.sender import OFFLOAD_KEYS, _HandleSwappingComm
from dask_shm.shared.store import Handle, Unshared

MB = 2**20


@pytest.fixture
def buffer(shared_buffer_256mib):
    return shared_buffer_256mib


class RecordingComm:
    """A comm whose ``write`` keeps the messages it was given."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def write(self, msg: Any, *args: Any, **kwargs: Any) -> int:
        self.sent.append(msg)
        return 0


def outgoing(buf: SharedSpillBuffer) -> list[str]:
    return sorted(os.listdir(buf.store.tiers.tiers[0].outgoing))


def batch(buf: SharedSpillBuffer, n: int) -> dict:
    for i in range(n):
        buf[f"k{i}"] = np.full(128 * 1024 // 8, float(i))  # above min-size: shared
    return {f"k{i}": to_serialize(buf[f"k{i}"]) for i in range(n)}


def handles(msg: dict) -> dict[str, Handle]:
    return {k: v.data for k, v in msg["data"].items() if isinstance(v, Serialize)}


@pytest.mark.parametrize("n", [1, OFFLOAD_KEYS + 1])
def test_a_batch_goes_as_handles_and_its_links_go_with_the_request(buffer, n):
    comm = RecordingComm()
    proxy = _HandleSwappingComm(comm, buffer, frozenset({2}), None)
    data = batch(buffer, n)
    asyncio.run(proxy.write({"status": "OK", "data": data}))
    sent = handles(comm.sent[0])
    assert sorted(sent) == sorted(data)
    assert all(isinstance(h, Handle) and os.path.exists(h.path) for h in sent.values())
    assert len(outgoing(buffer)) == n
    proxy.delete_links()
    assert outgoing(buffer) == []
    for i in range(n):  # the values read back from their files
        assert buffer[f"k{i}"][0] == i


def test_values_in_memory_under_transfer_min_size_keep_their_bytes(buffer):
    """A value still in private memory below ``transfer_min_size`` goes as
    bytes (nothing written, counted as sent the stock way), one at or above
    it as a handle, and a small one already in a file (sent before) as a
    handle too."""
    buffer["small"] = np.full(100 * 1024 // 8, 1.0)
    buffer["large"] = np.full(256 * 1024 // 8, 2.0)
    buffer["sent"] = np.full(100 * 1024 // 8, 3.0)
    earlier = buffer.export("sent")
    assert earlier is not None
    os.unlink(earlier.path)
    comm = RecordingComm()
    proxy = _HandleSwappingComm(comm, buffer, frozenset({2}), None, min_bytes=256 * 1024)
    data = {k: to_serialize(buffer[k]) for k in ("small", "large", "sent")}
    before = buffer.shm_counters["fallback_transfers"]
    asyncio.run(proxy.write({"status": "OK", "data": data}))
    sent = comm.sent[0]["data"]
    assert not isinstance(sent["small"].data, Handle)
    assert sent["small"].data[0] == 1.0
    assert isinstance(sent["large"].data, Handle)
    assert isinstance(sent["sent"].data, Handle)
    assert buffer.store.file_of("small") is None  # nothing was written for it
    assert buffer.shm_counters["fallback_transfers"] == before + 1
    proxy.delete_links()
    assert outgoing(buffer) == []


def test_links_made_after_the_request_ended_are_deleted(buffer):
    """The handler is cancelled (the requester went away) while the offload
    thread still writes the batch out; _answer then deletes the links. The
    links the thread makes afterwards must not stay in the outgoing
    directory (each would keep its file's pages on the tmpfs)."""
    comm = RecordingComm()
    proxy = _HandleSwappingComm(comm, buffer, frozenset({2}), None)
    data = batch(buffer, 4 * OFFLOAD_KEYS)
    started = threading.Event()
    cancelled = threading.Event()
    export = buffer.hand_over

    def slow_export(*args: Any, **kwargs: Any) -> Any:
        # Held until the request is cancelled: on a busy host the thread
        # could otherwise write the whole batch before the loop cancels it.
        started.set()
        cancelled.wait(10)
        return export(*args, **kwargs)

    buffer.hand_over = slow_export  # type: ignore[method-assign]

    async def cancelled_request() -> None:
        write = asyncio.ensure_future(proxy.write({"status": "OK", "data": data}))
        while not started.is_set():
            await asyncio.sleep(0.001)
        write.cancel()
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await write
        proxy.delete_links()  # what the get_data wrapper does once the handler ends
        await offload(lambda: None)  # the offload thread is done with the swap

    asyncio.run(cancelled_request())
    assert comm.sent == []
    assert outgoing(buffer) == []
    for i in range(4 * OFFLOAD_KEYS):
        assert buffer[f"k{i}"][0] == i


class Measured:
    """A value whose ``sizeof`` counts its calls: for a pandas DataFrame it
    walks every column (milliseconds for a hundred of them)."""

    calls = 0

    def __init__(self, nbytes: int) -> None:
        self.payload = np.ones(nbytes // 8)


@sizeof.register(Measured)
def _sizeof_measured(value: Measured) -> int:
    Measured.calls += 1
    return int(value.payload.nbytes) + 100


def test_a_value_handed_over_is_sized_by_its_weight_not_measured_again(buffer):
    """``sizeof`` runs once, when the value is stored: handing it over
    (the offload and ``transfer_min_size`` decisions, the file's accounting)
    takes the buffer's weight of it, and the handle says that size."""
    buffer["k"] = Measured(512 * 1024)
    stored = Measured.calls
    assert stored >= 1
    assert buffer.private_nbytes("k") == 512 * 1024 + 100
    comm = RecordingComm()
    proxy = _HandleSwappingComm(comm, buffer, frozenset({2}), MB, min_bytes=256 * 1024)
    asyncio.run(proxy.write({"status": "OK", "data": {"k": to_serialize(buffer["k"])}}))
    handle = handles(comm.sent[0])["k"]
    assert isinstance(handle, Handle)
    assert handle.memory == 512 * 1024 + 100
    assert Measured.calls == stored
    proxy.delete_links()
    assert buffer.private_nbytes("k") is None  # in its file now
    assert buffer["k"].payload.sum() == 512 * 1024 // 8


def test_only_values_still_in_memory_count_towards_offloading(buffer):
    """A batch is swapped in the offload thread when the bytes it must write
    pass ``offload_bytes``: a value already in a file is only linked."""
    buffer["private"] = np.ones(256 * 1024 // 8)
    buffer["in_file"] = np.ones(256 * 1024 // 8)
    earlier = buffer.export("in_file")
    assert earlier is not None
    os.unlink(earlier.path)
    proxy = _HandleSwappingComm(RecordingComm(), buffer, frozenset({2}), 200 * 1024)
    assert proxy._offloads({"private": to_serialize(buffer["private"])})
    assert not proxy._offloads({"in_file": to_serialize(buffer["in_file"])})


class Pickled:
    """A value whose pickling counts its calls, and that is not worth sharing
    (pickled bytes, no buffers)."""

    dumps = 0

    def __init__(self, nbytes: int) -> None:
        self.text = "x" * nbytes

    def __reduce__(self) -> tuple:
        Pickled.dumps += 1
        return (Pickled._from_text, (self.text,))

    @staticmethod
    def _from_text(text: str) -> Pickled:
        value = Pickled(0)
        value.text = text
        return value


@sizeof.register(Pickled)
def _sizeof_pickled(value: Pickled) -> int:
    return len(value.text)


class HandshakenComm(RecordingComm):
    """A RecordingComm with what distributed's comm agreed with the peer."""

    def __init__(self, compression: str | None = None) -> None:
        super().__init__()
        self.handshake_options = {"compression": compression, "pickle-protocol": 5}


def test_a_value_not_worth_sharing_is_serialized_once(buffer):
    """The serialization that found a value not worth sharing is what goes
    to the peer (as a Serialized, which the comm sends as it is): the value
    is pickled once per transfer, as in stock, and arrives equal."""
    buffer["objects"] = Pickled(2 * MB)
    comm = HandshakenComm()
    proxy = _HandleSwappingComm(comm, buffer, frozenset({2}), None, min_bytes=MB)
    before = Pickled.dumps
    fallbacks = buffer.shm_counters["fallback_transfers"]
    asyncio.run(proxy.write({"status": "OK", "data": {"objects": to_serialize(buffer["objects"])}}))
    sent = comm.sent[0]["data"]["objects"]
    assert isinstance(sent, Serialized)
    assert Pickled.dumps == before + 1
    assert buffer.store.file_of("objects") is None
    assert buffer.shm_counters["fallback_transfers"] == fallbacks + 1
    # what the peer's comm makes of the message
    arrived = loads(dumps({"data": {"objects": sent}}))["data"]["objects"]
    assert isinstance(arrived, Pickled) and arrived.text == buffer["objects"].text
    assert Pickled.dumps == before + 1


def test_a_comm_that_compresses_gets_the_value_to_serialize(buffer):
    """Where the comm agreed on compression with its peer, it gets the value
    (it compresses what it serializes; frames passed through would not be)."""
    buffer["objects"] = Pickled(2 * MB)
    comm = HandshakenComm(compression="lz4")
    proxy = _HandleSwappingComm(comm, buffer, frozenset({2}), None, min_bytes=MB)
    asyncio.run(proxy.write({"status": "OK", "data": {"objects": to_serialize(buffer["objects"])}}))
    sent = comm.sent[0]["data"]["objects"]
    assert isinstance(sent, Serialize) and sent.data is buffer["objects"]


def test_frames_that_are_not_flat_buffers_are_left_to_the_comm(buffer):
    """Only frames the comm can write as they are go as a Serialized: a
    strided array frame (``serialize_unsplit`` keeps a slice as its payload)
    or anything that is no buffer makes the comm serialize the value."""
    proxy = _HandleSwappingComm(HandshakenComm(), buffer, frozenset({2}), None)
    assert isinstance(proxy._serialized(Unshared({}, [b"pickled", bytearray(8)])), Serialized)
    assert proxy._serialized(Unshared({}, [np.ones((64, 64))[:, ::2]])) is None
    assert proxy._serialized(Unshared({}, ["not a buffer"])) is None
    assert proxy._serialized(None) is None
