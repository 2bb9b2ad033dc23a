"""The sending side: ``get_data`` answered with hard-link handles.

:func:`install_get_data` wraps the worker's ``get_data`` handler. For a
requester in the :class:`~dask_shm.shared.registry.PeerRegistry` (a worker on
this host in shared-memory mode) the stock handler runs unchanged (throttling,
accounting, the two-step handshake) over a comm proxy that, just before the
message is written, swaps each value for a :class:`~dask_shm.shared.store.Handle`
to a fresh hard link of its file. The links are deleted once the handshake is
over (the receiver has linked the file by then) or the transfer failed. Values
that cannot be handed over (not worth sharing, link failure) are sent as bytes.
Anyone else (clients, other hosts, workers without shared memory) gets bytes,
and so does everyone over a comm that does not serialize messages
(``inproc://``): there a handle would reach the receiver as an object, not as
the value it names (see :mod:`dask_shm.shared.guard`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from distributed.metrics import context_meter
from distributed.protocol.serialize import Serialize, to_serialize

from dask_shm.shared.guard import comm_serializes
from dask_shm.shared.registry import PeerRegistry

if TYPE_CHECKING:
    from distributed import Worker

    from dask_shm.shared.buffer import SharedSpillBuffer

logger = logging.getLogger(__name__)


class _HandleSwappingComm:
    """Delegates to ``comm``; ``write`` replaces values by handles."""

    def __init__(self, comm: Any, buffer: SharedSpillBuffer):
        self._comm = comm
        self._buffer = buffer
        self.links: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    async def write(self, msg: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg, dict) and msg.get("status") == "OK" and "data" in msg:
            msg = {**msg, "data": self._swap(msg["data"])}
        return await self._comm.write(msg, *args, **kwargs)

    def _swap(self, data: dict) -> dict:
        counters = self._buffer.shm_counters
        out = {}
        for key, wrapped in data.items():
            value = wrapped.data if isinstance(wrapped, Serialize) else wrapped
            handle = self._buffer.export(key)
            if handle is None:
                counters["fallback_transfers"] += 1
                counters["fallback_bytes"] += _nbytes(value)
                context_meter.digest_metric("shm-send-bytes", 1, "count")
                out[key] = wrapped
                continue
            self.links.append(handle.path)
            counters["link_transfers"] += 1
            counters["link_bytes"] += handle.size
            context_meter.digest_metric("shm-send-link", 1, "count")
            context_meter.digest_metric("shm-send-link", handle.size, "bytes")
            out[key] = to_serialize(handle)
        return out

    def delete_links(self) -> None:
        for path in self.links:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.links.clear()


def _nbytes(value: object) -> int:
    from distributed.sizeof import safe_sizeof

    return safe_sizeof(value)


GetData = Callable[..., Awaitable[Any]]


def install_get_data(worker: Worker, buffer: SharedSpillBuffer, registry: PeerRegistry) -> GetData:
    """Wrap ``worker``'s get_data handler; returns the handler it replaced.

    The wrapper shows the replaced handler's signature (``functools.wraps``)
    and passes every keyword through: distributed hands a handler optional
    request fields such as a client's ``serializers`` only when its signature
    names them, so hiding one would change what the worker sends.
    """
    original: GetData = worker.handlers["get_data"]

    @functools.wraps(original)
    async def get_data(comm: Any, keys: Any = (), who: str | None = None, **kwargs: Any) -> Any:
        if (
            worker.data is not buffer
            or not comm_serializes(comm)
            or not registry.accepts_handles(who)
        ):
            return await original(comm, keys=keys, who=who, **kwargs)
        proxy = _HandleSwappingComm(comm, buffer)
        try:
            return await original(proxy, keys=keys, who=who, **kwargs)
        finally:
            proxy.delete_links()

    worker.handlers["get_data"] = get_data
    return original
