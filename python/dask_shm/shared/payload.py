"""How much of a serialized value can live in shared memory.

``serialize_bytelist`` produces a header and frames. Some frames are raw
buffers (numpy data, arrow buffers, pickle protocol 5 out-of-band buffers):
deserializing from a memory mapping makes the value point into the mapping, so
those bytes cost the worker nothing private. Other frames are pickle streams of
Python objects: they are unpickled into fresh private objects whatever the
source, so sharing them gains nothing and costs a deserialization on every
unspill. :func:`shareable_bytes` counts the first kind. ``bytes`` and
``bytearray`` are raw frames too, but their deserializer copies them: they are
of the second kind. :func:`read_tracking_mapping` checks after the fact that a
value read from a mapping really lives in it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _frame_len(frame: Any) -> int:
    return memoryview(frame).nbytes


def shareable_bytes(header: Mapping[str, Any], frames: Sequence[Any]) -> int:
    """Bytes of ``frames`` that a deserializer maps without copying.

    ``header``/``frames`` are one value as serialized by distributed (no
    compression: compressed frames are always decompressed into private memory).
    """
    if header.get("compression") and any(c for c in header["compression"]):
        return 0
    if header.get("is-collection"):
        total, start = 0, 0
        for sub, count in zip(header["sub-headers"], header["frame-lengths"], strict=False):
            total += shareable_bytes(sub, frames[start : start + count])
            start += count
        return total
    serializer = header.get("serializer")
    if serializer == "pickle":
        # frames[0] is the in-band pickle stream; the rest are out-of-band buffers.
        return sum(_frame_len(f) for f in frames[1:])
    if serializer == "dask":
        if header.get("type") in _COPIED_TYPES:
            return 0  # deserialized into a private copy of the frame
        sub = header.get("sub-header")
        if isinstance(sub, Mapping) and sub.get("pickle"):
            return 0  # e.g. object-dtype numpy: a pickle stream
        return sum(_frame_len(f) for f in frames)
    return 0


#: Types whose dask deserializer copies the frames (``bytes(frame)``): they never
#: live in a mapping, whatever the source.
_COPIED_TYPES = frozenset({"bytes", "bytearray"})


def read_tracking_mapping(read: Callable[[], T]) -> tuple[T, bool]:
    """Run ``read`` (which maps a file and deserializes it, dropping its own
    references to the frames) and tell whether the value it returns still
    keeps a mapping that ``read`` made alive, i.e. lives at least partly in
    the file; False means it came back as a private copy and must be weighed
    in full. Only the mappings made by ``read`` itself (on this thread) are
    looked at: others made or freed meanwhile, by other threads or by a
    garbage collection during the read, do not change the answer."""
    from dask_shm._core import watch_mappings

    return watch_mappings(read)


def worth_sharing(
    header: Mapping[str, Any], frames: Sequence[Any], min_size: int, min_fraction: float
) -> tuple[bool, int]:
    """``(share?, shareable bytes)`` for a serialized value: shared when it has
    at least ``min_size`` shareable bytes making up at least ``min_fraction``
    of the payload."""
    payload = sum(_frame_len(f) for f in frames)
    shareable = shareable_bytes(header, frames)
    share = shareable >= max(min_size, 1) and shareable >= min_fraction * payload
    return share, shareable
