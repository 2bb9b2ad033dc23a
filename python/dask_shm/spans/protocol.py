"""What the span extensions say to each other over the wire.

The worker and scheduler extensions and the client all depend on these names;
they live here, with no dependency on any of them, so that none of those
modules has to import another for a constant.
"""

from __future__ import annotations

from dask.typing import Key

#: Name of the ``Worker.metrics`` entry carrying the per-span memory report
#: (sent with the worker's heartbeat, read by the scheduler extension).
METRIC_NAME = "dask_shm_span_memory"
#: Scheduler -> worker stream message carrying span ids of reported keys.
HINTS_OP = "dask_shm_span_hints"
#: Scheduler RPC handler answering :func:`dask_shm.spans.span_memory`.
RPC_NAME = "dask_shm_span_memory"


def as_key(key: object) -> Key:
    """Undo msgpack turning tuple keys into lists."""
    if isinstance(key, list):
        return tuple(as_key(k) for k in key)
    return key  # type: ignore[return-value]
