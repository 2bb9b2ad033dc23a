"""dask's local scheduler with shared memory and an out-of-core cache.

- :func:`get`: a process-pool scheduler (``dask.compute(x, scheduler=dask_shm.get)``)
  where large buffers travel through shared-memory files instead of pipes.
- :class:`SpillCache`: a spilling ``cache=`` for the local schedulers, so that
  computations with more live intermediates than RAM spill instead of dying.
- :func:`shutdown_pool`: close the warm pool ``get`` keeps between computations.
- :func:`release_idle_files`: free now the files the idle warm pool keeps for
  the next computation.

The names are imported on first use: pool processes only need
:mod:`dask_shm.local.transport`, and should not pay for importing the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dask_shm.local.cache import SpillCache
    from dask_shm.local.config import parse_memory_target
    from dask_shm.local.pool import release_idle_files, shutdown_pool
    from dask_shm.local.scheduler import get

__all__ = ["SpillCache", "get", "parse_memory_target", "release_idle_files", "shutdown_pool"]

_WHERE = {
    "SpillCache": "dask_shm.local.cache",
    "get": "dask_shm.local.scheduler",
    "parse_memory_target": "dask_shm.local.config",
    "release_idle_files": "dask_shm.local.pool",
    "shutdown_pool": "dask_shm.local.pool",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
