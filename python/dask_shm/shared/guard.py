"""The boundary a shared-memory handle must never cross.

A :class:`~dask_shm.shared.store.Handle` stands for a value only on the wire,
between a sender and a receiver that deserializes it (and thereby turns it back
into the value). Over a comm that does not serialize (``inproc://``: workers
of one process, ``LocalCluster(processes=False)``) the receiver would get the
handle object itself. :func:`comm_serializes` tells the sender whether a
connection is safe; :func:`ensure_value` is the loud check where a value
enters a buffer, in case anything ever slips through.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.protocol.serialize import Serialize

if TYPE_CHECKING:
    from dask_shm.shared.store import Handle
    from dask_shm.shared.transfer import Unresolved


class HandleLeakError(TypeError):
    """A shared-memory handle arrived where a value was expected."""


@functools.cache
def _serializing_comm_types() -> tuple[type, ...]:
    """Computed once: a failed import (no websockets) is not cached by
    Python and costs its search on every call; this runs per ``get_data``."""
    from distributed.comm.tcp import TCP

    types: list[type] = [TCP]  # TLS is a subclass
    try:
        from distributed.comm.ws import WS

        types.append(WS)
    except ImportError:  # pragma: no cover - websockets extra absent
        pass
    return tuple(types)


def comm_serializes(comm: Any) -> bool:
    """Whether messages written to ``comm`` go through serialization (and
    hence a handle is deserialized into its value on the other side). Only
    comm types known to serialize qualify; ``inproc://`` and anything unknown
    do not."""
    return isinstance(comm, _serializing_comm_types())


@functools.cache
def _handle_types() -> tuple[type[Handle], type[Unresolved]]:
    """(Handle, Unresolved), imported once, on first use (store and
    transfer import this module)."""
    from dask_shm.shared.store import Handle
    from dask_shm.shared.transfer import Unresolved

    return (Handle, Unresolved)


def ensure_value(key: Key, value: object) -> None:
    """Raise :class:`HandleLeakError` if ``value`` is a handle (bare or
    wrapped for serialization) instead of the value it names."""
    inner = value.data if isinstance(value, Serialize) else value
    handle, unresolved = _handle_types()
    if isinstance(inner, unresolved):
        raise HandleLeakError(
            f"dask-shm: key {key!r} received a shared-memory handle that could not "
            f"be resolved ({inner.reason}) instead of its value"
        )
    if isinstance(inner, handle):
        raise HandleLeakError(
            f"dask-shm: key {key!r} received a shared-memory handle ({inner.path}) "
            "instead of its value; handles may only cross serializing comms "
            "to a shared-memory peer. This is a dask-shm bug: please report it."
        )
