"""The sending side: ``get_data`` answered with hard-link handles.

:func:`install_get_data` wraps the worker's ``get_data`` handler. For a
requester in the :class:`~dask_shm.shared.registry.PeerRegistry` (a worker on
our tmpfs in shared-memory mode) the stock handler runs unchanged (throttling,
accounting, the two-step handshake) over a comm proxy that, just before the
message is written, swaps each value for a :class:`~dask_shm.shared.store.Handle`
to a fresh hard link of its file. The links are deleted once the handshake is
over (the receiver has linked the file by then) or the transfer failed. Only
files in roots the requester shares are handed over (the identity tokens it
published, see :mod:`dask_shm.shared.root_id`: a host sharing our tmpfs but
not our tier-3 directory gets tier-2 files as handles and tier-3 values as
bytes), and nothing once it refused our handles. Values that cannot be
handed over (not worth sharing, a root it does not share, link failure) are
sent as bytes; one found not worth sharing goes from the frames serialized to
tell (a :class:`~distributed.protocol.serialize.Serialized`, which the comm
sends as they are), so that it is serialized once, as in stock, unless the
comm compresses.
A value still in the sender's private memory and smaller than
``transfer_min_size`` bytes (config default 1 MiB) is sent as bytes too:
below that, writing it into a file, linking, mapping and deleting it cost
more CPU than the copy it saves; one already in a file is linked whatever
its size.
Anyone else (clients, other hosts, workers without shared memory) gets bytes,
and so does everyone over a comm that does not serialize messages
(``inproc://``): there a handle would reach the receiver as an object, not as
the value it names (see :mod:`dask_shm.shared.guard`).

Writing a batch's values out and linking them runs in distributed's offload
thread (as distributed serializes a large message there) when the batch is
over ``distributed.comm.offload`` bytes or holds more than
:data:`OFFLOAD_KEYS` values, so that it does not block the worker's event
loop; a small batch is swapped in place (a thread hand-over would cost more).

For everyone, a key whose spilled file vanished or was tampered with fails
the request with :class:`~dask_shm.shared.transfer.PeerReadError` naming it
(not the store's SpillFileError, an OSError the requester would take for a
dead connection), checked before the stock handler runs (which would count
an outgoing transfer it never uncounts) and again around it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from distributed.metrics import context_meter
from distributed.protocol.serialize import Serialize, Serialized, to_serialize
from distributed.sizeof import safe_sizeof
from distributed.utils import offload

from dask_shm import _core
from dask_shm._core import SpillFileError
from dask_shm.config import comm_offload_bytes
from dask_shm.shared import paths
from dask_shm.shared.guard import comm_serializes
from dask_shm.shared.registry import PeerRegistry
from dask_shm.shared.store import Handle, Unshared
from dask_shm.shared.transfer import PeerReadError

if TYPE_CHECKING:
    from distributed import Worker

    from dask_shm.shared.buffer import SharedSpillBuffer

logger = logging.getLogger(__name__)

#: A batch of more values than this is swapped in the offload thread whatever
#: its bytes: each value still in memory costs a file written, sealed and
#: linked (about 0.25 ms for a 72 KiB value on a 2-core box), so many small
#: values block the loop longer than their bytes suggest.
OFFLOAD_KEYS = 16


class _HandleSwappingComm:
    """Delegates to ``comm``; ``write`` replaces values by handles, in the
    offload thread for a batch over ``offload_bytes`` (None: never by bytes)
    or :data:`OFFLOAD_KEYS` values. A value in private memory smaller than
    ``min_bytes`` keeps its bytes."""

    def __init__(
        self,
        comm: Any,
        buffer: SharedSpillBuffer,
        tiers: frozenset[int],
        offload_bytes: int | None,
        min_bytes: int = 0,
    ):
        self._comm = comm
        self._buffer = buffer
        #: the tiers whose files the receiver can link
        self._tiers = tiers
        self._offload_bytes = offload_bytes
        self._min_bytes = min_bytes
        # What distributed's comm agreed with the peer in its handshake (an
        # internal: absent, values not worth sharing are serialized again).
        options = getattr(comm, "handshake_options", None) or {}
        self._sends_frames_as_serialized = (
            not options.get("compression") and options.get("pickle-protocol", 0) >= 5
        )
        self.links: list[str] = []
        # An offloaded swap can outlive its request (the handler cancelled
        # while the thread writes): links made after delete_links are
        # deleted at once instead of being left in the outgoing directory.
        self._links_lock = threading.Lock()
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    async def write(self, msg: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, dict) and msg.get("status") == "OK" and "data" in msg:
            data = msg["data"]
            swapped = await offload(self._swap, data) if self._offloads(data) else self._swap(data)
            msg = {**msg, "data": swapped}
        return await self._comm.write(msg, *args, **kwargs)

    def _offloads(self, data: dict) -> bool:
        if len(data) > OFFLOAD_KEYS:
            return True
        if self._offload_bytes is None:
            return False
        # What the swap writes: the values still only in private memory (one
        # in a file is linked), by their weight in the buffer.
        return sum(self._buffer.private_nbytes(key) or 0 for key in data) > self._offload_bytes

    def _swap(self, data: dict) -> dict:
        counters = self._buffer.shm_counters
        out = {}
        for key, wrapped in data.items():
            value = wrapped.data if isinstance(wrapped, Serialize) else wrapped
            nbytes = self._private_nbytes(key)
            handle = None
            if nbytes is None or nbytes >= self._min_bytes:
                try:
                    handle = self._buffer.hand_over(key, self._tiers)
                except Exception:  # a transfer never fails because of us: bytes
                    logger.warning("dask-shm: cannot hand %r over by link", key, exc_info=True)
            if not isinstance(handle, Handle):
                counters["fallback_transfers"] += 1
                if nbytes is None:
                    nbytes = self._buffer.private_nbytes(key)
                counters["fallback_bytes"] += safe_sizeof(value) if nbytes is None else nbytes
                # Sent the stock way (its fine metrics are stock's alone), from
                # the frames that told it is not worth sharing where they can go
                # as they are: serialized once, as stock does.
                out[key] = self._serialized(handle) or wrapped
                continue
            with self._links_lock:
                if self._closed:
                    _unlink(handle.path)
                    continue
                self.links.append(handle.path)
            counters["link_transfers"] += 1
            counters["link_bytes"] += handle.size
            context_meter.digest_metric("shm-send-link", 1, "count")
            context_meter.digest_metric("shm-send-link", handle.size, "bytes")
            out[key] = to_serialize(handle)
        return out

    def _serialized(self, unshared: Unshared | None) -> Serialized | None:
        """``unshared``'s frames as a message value the comm sends as they
        are, if this comm would have sent the same bytes: no compression
        agreed with the peer, pickle protocol 5, frames that are flat
        buffers. None otherwise (the value is then serialized again)."""
        if unshared is None or not self._sends_frames_as_serialized:
            return None
        try:
            flat = all(memoryview(frame).c_contiguous for frame in unshared.frames)
        except TypeError:  # not a buffer: left to the comm
            return None
        return Serialized(unshared.header, unshared.frames) if flat else None

    def _private_nbytes(self, key: Any) -> int | None:
        """The value's ``sizeof`` (its weight in the buffer) when the size
        decides (a value only in private memory and a ``min_bytes``
        threshold): under it the value keeps its bytes. None otherwise: a
        value in a file is linked whatever its size."""
        if self._min_bytes <= 0:
            return None
        return self._buffer.private_nbytes(key)

    def delete_links(self) -> None:
        """Delete the links made for this request, and any made from now on."""
        with self._links_lock:
            self._closed = True
            links, self.links = self.links, []
        for path in links:
            _unlink(path)


def _unlink(path: str) -> None:
    """Delete a link handed out; the GIL is kept on a tmpfs (one per value,
    in the event loop: see :func:`dask_shm.shared.paths.in_ram`)."""
    _core.unlink_file(path, paths.in_ram(path))


GetData = Callable[..., Awaitable[Any]]


def install_get_data(
    worker: Worker,
    buffer: SharedSpillBuffer,
    registry: PeerRegistry,
    root_tokens: dict[int, str],
    transfer_min_size: int = 0,
) -> GetData:
    """Wrap ``worker``'s get_data handler; returns the handler it replaced.
    ``root_tokens`` maps each tier number of ``buffer`` to its root's identity
    token (a tier without one is never handed over); values in private
    memory smaller than ``transfer_min_size`` bytes are sent as bytes.

    The wrapper shows the replaced handler's signature (``functools.wraps``)
    and passes every keyword through: distributed hands a handler optional
    request fields such as a client's ``serializers`` only when its signature
    names them, so hiding one would change what the worker sends.
    """
    original: GetData = worker.handlers["get_data"]
    offload_bytes = comm_offload_bytes()

    @functools.wraps(original)
    async def get_data(comm: Any, keys: Any = (), who: str | None = None, **kwargs: Any) -> Any:
        try:
            if worker.data is buffer:
                for key in keys:
                    buffer.check_readable(key)
            return await _answer(comm, keys, who, **kwargs)
        except SpillFileError as e:
            raise PeerReadError(str(e)) from e

    async def _answer(comm: Any, keys: Any, who: str | None, **kwargs: Any) -> Any:
        tiers: frozenset[int] = frozenset()
        if worker.data is buffer and comm_serializes(comm):
            shared = registry.shared_roots(who, worker.address, root_tokens.values())
            tiers = frozenset(t for t, token in root_tokens.items() if token in shared)
        if not tiers:
            return await original(comm, keys=keys, who=who, **kwargs)
        proxy = _HandleSwappingComm(comm, buffer, tiers, offload_bytes, transfer_min_size)
        try:
            return await original(proxy, keys=keys, who=who, **kwargs)
        finally:
            proxy.delete_links()

    worker.handlers["get_data"] = get_data
    return original
