"""Hard-link handles on the wire, and which buffer receives them.

A worker answering ``get_data`` for a peer on the same host replaces each
value by a :class:`~dask_shm.shared.store.Handle` (see
:mod:`dask_shm.shared.sender`). The handle serializes as a few fields and no
frames. Deserializing it in the receiving process hands it to the *receiving
buffer*, :meth:`SharedSpillBuffer.receive
<dask_shm.shared.buffer.SharedSpillBuffer.receive>`, which validates the file
(:class:`~dask_shm._core.ForgedHandleError` if it fails: nothing is linked or
mapped), hard-links it once into its own store and maps it, so what the
receiver's code sees is the real value. The file belongs to that buffer from
the moment it arrives (see ``receive`` for its release).

Deserialization never raises (distributed deadlocks on an exception there): a
handle that cannot be turned into its value (not found, another file system,
unreadable, forged, no receiving buffer) deserializes into an
:class:`Unresolved` marker naming the key's stem and the reason. The fetch
that received it drops the marker (:func:`drop_unresolved`, called by the
plugin around ``Worker.gather_dep``): distributed then takes the key as
missing on that peer and fetches it elsewhere or asks the scheduler, and the
receiver asks that peer for bytes from then on.

The receiving buffer is the one of the worker whose fetch is running
(:func:`receiving_into`, set around ``Worker.gather_dep`` by the plugin: a
context variable, so it follows the fetch into offload threads and tells
in-process workers apart), else the one given to :func:`enable_receiving`.
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from typing import Any, Protocol

from distributed.protocol.serialize import dask_deserialize, dask_serialize

from dask_shm.shared.store import Handle

logger = logging.getLogger(__name__)


class Receiver(Protocol):
    """What takes handles over here: a
    :class:`~dask_shm.shared.buffer.SharedSpillBuffer` (named by what it does,
    so that this module, which the buffer's guard uses, does not import it)."""

    def receive(self, handle: Handle) -> object: ...


_receiver: contextvars.ContextVar[Receiver | None] = contextvars.ContextVar(
    "dask_shm_receiving_buffer", default=None
)
_default: weakref.ref[Receiver] | None = None


@dask_serialize.register(Handle)
def _serialize_handle(handle: Handle) -> tuple[dict[str, Any], list]:
    return {
        "path": handle.path,
        "size": handle.size,
        "memory": handle.memory,
        "shareable": handle.shareable,
        "stem": handle.stem,
    }, []


class PeerReadError(RuntimeError):
    """A peer could not read back a key it holds (its file vanished or was
    tampered with): the :class:`~dask_shm.SpillFileError` message, naming the
    key, carried over the wire as an error that is not an OSError
    (distributed takes an OSError from a peer for a dead connection and
    retries it forever)."""


class Unresolved:
    """What a handle that could not be turned into its value deserializes
    into: never a value, only a note for the fetch that received it."""

    __slots__ = ("path", "reason")

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason

    def __repr__(self) -> str:
        return f"<unresolved shared-memory handle {self.path}: {self.reason}>"


@dask_deserialize.register(Handle)
def _deserialize_handle(header: dict[str, Any], frames: list) -> object:
    try:
        handle = Handle(
            str(header["path"]),
            int(header["size"]),
            int(header["memory"]),
            int(header["shareable"]),
            str(header.get("stem", "in")),
        )
    except (KeyError, TypeError, ValueError):
        return Unresolved(str(header.get("path", "?")), f"malformed handle {header!r}")
    try:
        return receive(handle)
    except Exception as e:  # never raise here: distributed deadlocks on it
        logger.warning("dask-shm: cannot take over %s from a peer: %s", handle.path, e)
        return Unresolved(handle.path, f"{type(e).__name__}: {e}")


def drop_unresolved(data: dict) -> dict:
    """Remove the :class:`Unresolved` markers from a fetch's ``data`` (in
    place); returns them by key."""
    dropped = {k: v for k, v in data.items() if isinstance(v, Unresolved)}
    for k in dropped:
        del data[k]
    return dropped


def enable_receiving(buffer: Receiver | None) -> None:
    """Make ``buffer`` receive the handles deserialized outside any
    :func:`receiving_into` block in this process (None: refuse them)."""
    global _default
    _default = None if buffer is None else weakref.ref(buffer)


class receiving_into:  # noqa: N801 - used as a function: ``with receiving_into(b):``
    """Handles deserialized in this context go to ``buffer``. A class rather
    than a generator-based context manager: a worker enters it for every fetch."""

    __slots__ = ("_buffer", "_token")

    def __init__(self, buffer: Receiver):
        self._buffer = buffer

    def __enter__(self) -> None:
        self._token = _receiver.set(self._buffer)

    def __exit__(self, *exc: object) -> None:
        _receiver.reset(self._token)


def receiver() -> Receiver | None:
    """The buffer that receives handles here and now, if any."""
    buffer = _receiver.get()
    if buffer is None and _default is not None:
        buffer = _default()
    return buffer


def receive(handle: Handle) -> object:
    """Turn a handle into the value it names, in the receiving buffer.

    Raises ForgedHandleError for a handle that fails validation, and
    RuntimeError where no shared-memory buffer receives handles.
    """
    buffer = receiver()
    if buffer is None:
        raise RuntimeError(
            "received a shared-memory handle in a process where dask-shm's "
            "shared-memory mode is not enabled"
        )
    return buffer.receive(handle)
