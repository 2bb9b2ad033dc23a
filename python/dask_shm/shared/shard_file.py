"""One P2P shard batch as one file on the shared-memory root.

:func:`write` lays a batch (what ``ShuffleRun._send`` is given: a list of
shards, or the bytes distributed already pickled small shards into) out in a
file: a fixed header (magic, a random nonce, the kind, the sizes), then the
protocol-5 pickle of the batch, then its out-of-band buffers (numpy arrays'
data, and the data of every ``bytes`` shard of at least
:data:`OUT_OF_BAND_BYTES`: a dataframe shuffle's shards are arrow streams
as bytes), each 64-byte aligned. :func:`read` maps the file copy-on-write,
checks it is the file the handle names (size and nonce), unlinks it, and
rebuilds the batch with the arrays viewing the mapping: no copy of their
bytes, and writable as a received array is in stock. A ``bytes`` shard comes
back as a read-only ``memoryview`` of the mapping, which distributed's
receive path reads as it reads bytes (``pyarrow.py_buffer``). A receiver that keeps
shards in memory asks for a copy of each buffer instead, so that one kept
shard does not keep its whole batch alive. A batch of bytes (small shards
distributed pickled itself) comes back as bytes (one copy: distributed's
receive path unpickles only ``bytes``).

The handle (:class:`ShardFile`) travels as a plain dict (msgpack, no
pickle): turning it back into an object never runs code of ours during
deserialization, so it cannot raise there.
"""

from __future__ import annotations

import mmap
import os
import pickle as std_pickle
import struct
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

from distributed.protocol import pickle

MAGIC = b"DSHMP2P\x01"
#: magic, nonce, kind, buffer count, pickle length
_HEADER = struct.Struct("<8s16sB7xQQ")
_LENGTH = struct.Struct("<Q")
_ALIGN = 64

#: madvise(2) advice, not in Python's mmap module before 3.13
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

KIND_BYTES = 0
KIND_PICKLE = 1

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ShardFileError(Exception):
    """A shard file that cannot be used: the sender then sends its batch as bytes."""


@dataclass(frozen=True)
class ShardFile:
    """What a receiver needs to open a batch file: its path relative to the
    user directory of the shared root (``<root>/dask-shm-<uid>``), that
    root's identity token (:mod:`~dask_shm.shared.root_id`), the file's size
    and the nonce written at its head."""

    relpath: str
    token: str
    size: int
    nonce: str

    def to_msg(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_msg(cls, msg: Any) -> ShardFile:
        """Raises ShardFileError for a message that is not a handle."""
        try:
            handle = cls(
                relpath=str(msg["relpath"]),
                token=str(msg["token"]),
                size=int(msg["size"]),
                nonce=str(msg["nonce"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ShardFileError(f"not a shard file handle: {e!r}") from e
        if os.path.isabs(handle.relpath) or ".." in handle.relpath.split("/"):
            raise ShardFileError(f"shard file path {handle.relpath!r} leaves the root")
        return handle


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


#: at most this many buffers per ``writev`` call (Linux's IOV_MAX)
_IOV_MAX = 1024
_PADDING = bytes(_ALIGN)


def _writev_all(fd: int, parts: list[memoryview]) -> None:
    """Write ``parts`` in order with as few ``writev`` calls as the kernel allows."""
    first = 0
    while first < len(parts):
        written = os.writev(fd, parts[first : first + _IOV_MAX])
        while first < len(parts) and written >= parts[first].nbytes:
            written -= parts[first].nbytes
            first += 1
        if written:
            parts[first] = parts[first][written:]


#: ``bytes`` in a batch at least this long are written out of band
OUT_OF_BAND_BYTES = 1024


def _bytes_out_of_band(obj: Any) -> Any:
    """``obj`` with every ``bytes`` of :data:`OUT_OF_BAND_BYTES` or more found
    in its lists and tuples (of exactly those types) wrapped in a
    ``PickleBuffer``, which protocol 5 writes out of band and reads back as
    a read-only ``memoryview``. Pickle writes ``bytes`` in band (before any
    ``reducer_override``): copied into the pickle, then into the file, then
    out again on the receiver."""
    kind = type(obj)
    if kind is bytes:
        return std_pickle.PickleBuffer(obj) if len(obj) >= OUT_OF_BAND_BYTES else obj
    if kind is list:
        return [_bytes_out_of_band(item) for item in obj]
    if kind is tuple:
        return tuple(_bytes_out_of_band(item) for item in obj)
    return obj


def _layout(batch: list | bytes) -> tuple[int, bytes, list[memoryview]]:
    """The kind, the pickle (or the bytes themselves) and the buffers of a batch."""
    if isinstance(batch, bytes):
        return KIND_BYTES, batch, []
    raw: list[memoryview] = []
    try:
        body = std_pickle.dumps(
            _bytes_out_of_band(batch), protocol=5, buffer_callback=lambda b: raw.append(b.raw())
        )
        # Classes of the sender's __main__ go by value, as distributed's
        # dumps sends them (cloudpickle); so does what pickle refuses.
        if b"__main__" not in body:
            return KIND_PICKLE, body, raw
    except Exception:
        pass
    raw.clear()
    frames = pickle.dumps(batch, buffer_callback=lambda b: raw.append(b.raw()), protocol=5)
    return KIND_PICKLE, frames, raw


def write(
    path: str,
    batch: list | bytes,
    *,
    serializing: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[int, str]:
    """Write ``batch`` to a new file ``path``; returns (size, nonce). The
    file is removed if anything fails (OSError from the file system, an
    exception from pickling or BufferError), which is raised. The pickling
    runs inside ``serializing()`` (e.g. a metrics meter).

    One ``writev`` call writes the whole batch (header, pickle, padding and
    the buffers straight from the arrays' memory): no copy in user space and
    a single release of the GIL, so it runs in the event loop as stock's
    socket writes do, without a thread hand-over per batch."""
    with serializing():
        kind, body, buffers = _layout(batch)
    nonce = uuid.uuid4().bytes
    head = _HEADER.pack(MAGIC, nonce, kind, len(buffers), len(body)) + b"".join(
        _LENGTH.pack(b.nbytes) for b in buffers
    )
    parts = [memoryview(head), memoryview(body)]
    offset = len(head) + len(body)
    padding = memoryview(_PADDING)
    for buf in buffers:
        pad = _aligned(offset) - offset
        if pad:
            parts.append(padding[:pad])
        parts.append(buf)
        offset += pad + buf.nbytes
    fd = os.open(path, _CREATE, 0o600)
    try:
        _writev_all(fd, parts)
        os.close(fd)
        fd = -1
    except BaseException:
        if fd >= 0:
            os.close(fd)
        _unlink(path)
        raise
    return offset, nonce.hex()


def read(path: str, size: int, nonce: str, *, copy: bool = False) -> list | bytes:
    """The batch in file ``path``, which must be ``size`` bytes and carry
    ``nonce``; the file is unlinked once opened (its pages live on while the
    batch's arrays view them; with ``copy`` each buffer is copied out, into
    memory of its own). Raises ShardFileError for anything else."""
    if size < _HEADER.size:
        raise ShardFileError(f"shard file {path} cannot be {size} bytes")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ShardFileError(f"cannot open shard file {path}: {e}") from e
    try:
        _unlink(path)
        # mmap itself refuses a file shorter than size (ValueError); a longer
        # one is caught by the nonce at its head and the layout's lengths.
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:
        raise ShardFileError(f"cannot map shard file {path}: {e}") from e
    finally:
        os.close(fd)
    _populate(mapping)
    return _parse(mapping, nonce, path, copy)


def _populate(mapping: mmap.mmap) -> None:
    """Map the file's pages in one call instead of one page fault per 64 KiB
    as the batch is read (Linux 5.14+; elsewhere the faults happen as before)."""
    try:
        mapping.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError, AttributeError):
        pass


def _parse(mapping: mmap.mmap, nonce: str, path: str, copy: bool) -> list | bytes:
    view = memoryview(mapping)
    magic, found, kind, count, body_len = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or found.hex() != nonce:
        raise ShardFileError(f"{path} is not the shard file announced")
    offset = _HEADER.size + count * _LENGTH.size
    if offset + body_len > len(mapping):
        raise ShardFileError(f"shard file {path} is truncated")
    lengths = struct.unpack_from(f"<{count}Q", view, _HEADER.size)
    body = view[offset : offset + body_len]
    if kind == KIND_BYTES:
        return bytes(body)
    offset += body_len
    buffers = []
    for length in lengths:
        offset = _aligned(offset)
        buffer = view[offset : offset + length]
        buffers.append(bytearray(buffer) if copy else buffer)
        offset += length
    if kind != KIND_PICKLE or offset > len(mapping):
        raise ShardFileError(f"shard file {path} is truncated or of an unknown kind")
    try:
        return pickle.loads(body, buffers=buffers)  # type: ignore[no-any-return]
    except Exception as e:
        raise ShardFileError(f"cannot unpickle shard file {path}: {e!r}") from e


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
