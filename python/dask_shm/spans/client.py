"""Client-side view of the per-span memory figures."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dask_shm.spans.protocol import RPC_NAME

if TYPE_CHECKING:
    import pandas as pd
    from distributed import Client

#: Columns of :func:`span_memory`, after the ``span`` index
COLUMNS = (
    "span_id",
    "parent_id",
    "done",
    "memory",
    "spilled",
    "spilled_disk",
    "shared",
    "spill_bytes",
    "spill_seconds",
    "spill_count",
    "unspill_bytes",
    "unspill_seconds",
    "unspill_count",
)


def _frame(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame.from_records(list(records), columns=["span", *COLUMNS])
    return df.set_index("span")


def span_memory(client: Client, *, own: bool = False) -> Any:
    """Which spans hold memory and cause spilling, as a pandas DataFrame indexed by
    span name (tags joined with ``" / "``; names may repeat, e.g. successive default
    spans, ``span_id`` tells them apart), one row per span in creation order.

    Columns: ``span_id``, ``parent_id``, ``done``; bytes currently held on the cluster
    (as of the workers' last heartbeats) ``memory``, ``spilled``, ``spilled_disk``,
    ``shared`` (see :class:`dask_shm.spans.SpanMemory`); cumulative ``spill_*`` /
    ``unspill_*`` ``bytes``, ``seconds`` and ``count`` (see
    :attr:`dask_shm.spans.Span.spill_metrics`).

    By default each row covers the span and its sub-spans; with ``own=True`` only the
    span itself, so that the rows add up to the cluster totals.

    With an asynchronous client, returns an awaitable.

    Raises
    ------
    TypeError
        ``client`` is not a ``distributed.Client`` or ``own`` is not a bool.
    RuntimeError
        The scheduler does not run the dask-shm spans extension.
    ImportError
        pandas is not installed (the ``spans`` extra installs it).
    """
    from distributed import Client

    try:
        import pandas  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "dask_shm.spans.span_memory needs pandas: pip install 'dask-shm[spans]'"
        ) from e

    if not isinstance(client, Client):
        raise TypeError(f"span_memory needs a distributed.Client; got {client!r}")
    if not isinstance(own, bool):
        raise TypeError(f"own must be True or False; got {own!r}")
    return client.sync(_span_memory_checked, client, own)


async def _span_memory_checked(client: Client, own: bool) -> pd.DataFrame:
    records = await getattr(client.scheduler, RPC_NAME)(own=own)
    if records is None:
        # A scheduler without the handler logs "No handler ... found" and answers None
        raise RuntimeError(
            "The scheduler does not run the dask-shm spans extension; install it "
            "with dask_shm.spans.install_scheduler_extension"
        )
    return _frame(records)
