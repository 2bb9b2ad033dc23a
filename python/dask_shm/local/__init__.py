"""dask's local scheduler with shared memory and an out-of-core cache.

- :func:`get`: a process-pool scheduler (``dask.compute(x, scheduler=dask_shm.get)``)
  where large buffers travel through shared-memory files instead of pipes.
- :class:`SpillCache`: a spilling ``cache=`` for the local schedulers, so that
  computations with more live intermediates than RAM spill instead of dying.
"""

from __future__ import annotations

from dask_shm.local.cache import SpillCache
from dask_shm.local.config import parse_memory_target
from dask_shm.local.scheduler import get

__all__ = ["SpillCache", "get", "parse_memory_target"]
