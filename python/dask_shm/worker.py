"""Putting :class:`dask_shm.SpillBuffer` into a Worker.

Three routes, from most to least explicit:

- ``Worker(data=dask_shm.worker_data(memory_limit="4GiB"))`` (also
  ``LocalCluster(data=...)``, which passes it on to every worker): built when the
  worker starts, sized from ``memory_limit`` and the worker's memory config
  exactly as ``WorkerMemoryManager`` sizes the stock buffer;
- ``client.register_plugin(dask_shm.SpillBufferPlugin())``: swaps the buffer of
  running workers, using each worker's own memory limit;
- :func:`spill_buffer_for_worker`, the function both of them call.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from dask.system import CPU_COUNT
from dask.typing import Key
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.worker_memory import parse_memory_limit

from dask_shm.config import worker_max_spill, worker_memory_fractions
from dask_shm.spill import SpillBuffer

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)


def target_from_config(memory_limit: int | None) -> int | None:
    """Spill target in bytes for a worker with ``memory_limit`` bytes, following
    ``distributed.worker.memory.target`` / ``.spill`` as WorkerMemoryManager does.
    None means the worker should not spill at all (a plain dict)."""
    target_fraction, spill_fraction = worker_memory_fractions()
    if not memory_limit or not (target_fraction or spill_fraction):
        return None
    if target_fraction:
        return int(memory_limit * target_fraction)
    # Spilling only through the memory monitor, never on insertion.
    return sys.maxsize


def spill_buffer_for_worker(
    worker_local_directory: str,
    memory_limit: str | float | None = "auto",
    nthreads: int = 1,
    total_cores: int = CPU_COUNT,
) -> MutableMapping[Key, object]:
    """Build the data mapping a worker with this memory limit would get from
    stock distributed, with :class:`SpillBuffer` in place of the stock one.

    ``memory_limit`` accepts what ``Worker(memory_limit=...)`` accepts ("auto",
    a byte count, a string like "4GiB", a fraction of system memory, None).
    Returns a plain dict when the configuration disables spilling.
    Raises ValueError for an invalid memory configuration.
    """
    limit = parse_memory_limit(memory_limit, nthreads, total_cores, logger=logger)
    target = target_from_config(limit)
    if target is None:
        return {}
    return SpillBuffer(
        os.path.join(worker_local_directory, "storage"),
        target=target,
        max_spill=worker_max_spill(),
    )


def worker_data(
    memory_limit: str | float | None = "auto", nthreads: int = 1
) -> tuple[Callable[..., MutableMapping[Key, object]], dict[str, Any]]:
    """Value for ``Worker(data=...)``: builds a :class:`SpillBuffer` in the
    worker's local directory when the worker starts.

    Pass the same ``memory_limit`` and ``nthreads`` you give the worker.
    """
    return spill_buffer_for_worker, {"memory_limit": memory_limit, "nthreads": nthreads}


def install_spill_buffer(worker: Worker, buffer: MutableMapping[Key, object]) -> None:
    """Make ``buffer`` the data mapping of a running worker, moving every key
    the worker already holds into it (unspilling them one at a time).

    Runs on the worker's event loop, where all writes to ``worker.data`` happen.
    """
    old = worker.memory_manager.data
    for key in list(old):
        buffer[key] = old[key]
    worker.memory_manager.data = buffer
    worker.state.data = buffer
    for key in list(old):
        del old[key]


class SpillBufferPlugin(WorkerPlugin):
    """Worker plugin that replaces each worker's spill buffer with
    :class:`dask_shm.SpillBuffer`, sized from the worker's own memory limit and
    memory config. Workers whose configuration disables spilling are left alone.

    >>> client.register_plugin(SpillBufferPlugin())  # doctest: +SKIP
    """

    name = "dask-shm-spill-buffer"
    idempotent = True

    def setup(self, worker: Worker) -> None:
        if isinstance(worker.memory_manager.data, SpillBuffer):
            return
        buffer = private_spill_buffer(worker)
        if buffer is None:
            logger.info("dask-shm: spilling is disabled on %s; keeping its data mapping", worker)
            return
        install_spill_buffer(worker, buffer)


def private_spill_buffer(worker: Worker) -> SpillBuffer | None:
    """A new :class:`dask_shm.SpillBuffer` for ``worker``, sized from its
    memory limit and memory config; None where those disable spilling."""
    target = target_from_config(worker.memory_manager.memory_limit)
    if target is None:
        return None
    return SpillBuffer(
        os.path.join(worker.local_directory, "storage-dask-shm"),
        target=target,
        max_spill=worker.memory_manager.max_spill,
    )
