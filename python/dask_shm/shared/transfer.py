"""Hard-link handles on the wire, and the receiving side of a transfer.

A worker answering ``get_data`` for a peer on the same host replaces each
value by a :class:`~dask_shm.shared.store.Handle` (see :mod:`dask_shm.shared.sender`). The handle
serializes as a few fields and no frames. Deserializing it in the receiving
process validates the file it names (:class:`~dask_shm._core.ForgedHandleError`
if it fails: nothing is linked or mapped), links the file into this process's
``incoming`` directory and maps it, so what the receiver's code sees is the
real value, not a handle. The worker then stores the value in its
:class:`~dask_shm.SpillBuffer`, which :func:`claim` s the incoming file and links
it into its own directory, so that the value is accounted as shared.

If the file cannot be linked or mapped (link count limit, permissions, mapping
limits), it is read by copy instead: the value arrives private, and the
fallback is counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from distributed.metrics import context_meter
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from dask_shm._core import FileStore, read_peer_file
from dask_shm.shared import paths
from dask_shm.shared.store import Handle
from dask_shm.spill_store import frames_to_object

logger = logging.getLogger(__name__)

#: A received value not stored into a buffer within this many seconds (the
#: transfer was abandoned) lets go of its incoming file.
UNCLAIMED_TTL = 60.0

#: Process-wide counts of the receiving side (the sending side counts per buffer).
receive_counters: defaultdict[str, int] = defaultdict(int)


@dask_serialize.register(Handle)
def _serialize_handle(handle: Handle) -> tuple[dict[str, Any], list]:
    return {
        "path": handle.path,
        "size": handle.size,
        "memory": handle.memory,
        "shareable": handle.shareable,
    }, []


@dask_deserialize.register(Handle)
def _deserialize_handle(header: dict[str, Any], frames: list) -> object:
    try:
        handle = Handle(
            str(header["path"]),
            int(header["size"]),
            int(header["memory"]),
            int(header["shareable"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed shared-memory handle {header!r}") from e
    return receive(handle)


@dataclass
class Received:
    """A value deserialized from a file now in the incoming directory."""

    value: object
    incoming: FileStore
    name: str
    handle: Handle
    since: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        """Delete the incoming link (the buffer has linked the file, or gave up)."""
        self.incoming.delete(self.name)


class _Incoming:
    """This process's incoming directory and the values waiting to be claimed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.root: str | None = None
        self.store: FileStore | None = None
        self.pending: dict[int, Received] = {}

    def enable(self, root: str) -> None:
        with self.lock:
            gone = self.store is None or not os.path.isdir(self.store.directory)
            if self.root != root or gone:  # gone: released by paths.release_process_dir
                self.store = FileStore(paths.subdir(root, "incoming"))
                self.root = root

    def add(self, received: Received) -> None:
        with self.lock:
            self.pending[id(received.value)] = received
            expired = [
                k for k, r in self.pending.items() if time.monotonic() - r.since > UNCLAIMED_TTL
            ]
            dropped = [self.pending.pop(k) for k in expired]
        for r in dropped:
            r.release()

    def claim(self, value: object) -> Received | None:
        with self.lock:
            r = self.pending.get(id(value))
            if r is None or r.value is not value:
                return None
            del self.pending[id(value)]
            return r


_incoming = _Incoming()


def enable_receiving(root: str) -> None:
    """Accept handles in this process, validating them against ``root``."""
    _incoming.enable(root)


def claim(value: object) -> Received | None:
    """The pending transfer whose deserialized value is ``value``, if any;
    the caller must :meth:`Received.release` it."""
    if not _incoming.pending:
        return None
    return _incoming.claim(value)


def receive(handle: Handle) -> object:
    """Turn a validated handle into the value it names (see module docstring).

    Raises ForgedHandleError for a handle that fails validation, and
    RuntimeError in a process that does not accept handles.
    """
    root, incoming = _incoming.root, _incoming.store
    if root is None or incoming is None:
        raise RuntimeError(
            "received a shared-memory handle in a process where dask-shm's "
            "shared-memory mode is not enabled"
        )
    try:
        name, _ = incoming.adopt(root, handle.path, handle.size, "in", handle.memory)
    except OSError as e:
        # ForgedHandleError is a ValueError and propagates; this is a valid
        # file we could not link: read it by copy instead.
        receive_counters["fallback_transfers"] += 1
        receive_counters["fallback_bytes"] += handle.size
        context_meter.digest_metric("shm-receive-fallback", 1, "count")
        logger.info("dask-shm: copying %s instead of linking it: %s", handle.path, e)
        return frames_to_object(read_peer_file(root, handle.path, handle.size))
    try:
        frames = incoming.read_mapped(name)
    except OSError as e:
        # Out of mappings (vm.max_map_count) or similar: degrade to a copy.
        logger.info("dask-shm: copying %s instead of mapping it: %s", handle.path, e)
        try:
            return frames_to_object(incoming.read(name))
        finally:
            incoming.delete(name)
            receive_counters["fallback_transfers"] += 1
            receive_counters["fallback_bytes"] += handle.size
    try:
        value = frames_to_object(frames)
    except BaseException:
        incoming.delete(name)
        raise
    receive_counters["linked_transfers"] += 1
    receive_counters["linked_bytes"] += handle.size
    context_meter.digest_metric("shm-receive-link", 1, "count")
    context_meter.digest_metric("shm-receive-link", handle.size, "bytes")
    shared = replace(handle, path=str(incoming.path(name)))
    _incoming.add(Received(value, incoming, name, shared))
    return value
