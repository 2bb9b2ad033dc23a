"""Active Memory Manager with a Rust candidate-selection core.

Public API:

- :class:`ActiveMemoryManagerExtension`: drop-in for
  ``distributed.active_memory_manager.ActiveMemoryManagerExtension``.
- :class:`ReduceReplicas`, :class:`RetireWorker`: the stock policies, run in bulk by
  our manager (they still work, unchanged, under the stock manager).
- :class:`KeepReplicas`: keep at least N replicas (or one per running worker) of a
  set of keys.
- :func:`install_scheduler_extension`: put our manager in place of the stock one on a
  running or starting scheduler; :mod:`dask_shm.amm.preload` does it as a scheduler
  preload.
"""

from __future__ import annotations

from distributed.active_memory_manager import ActiveMemoryManagerPolicy, Suggestion

from dask_shm.amm.extension import ActiveMemoryManagerExtension, WorkersMemory
from dask_shm.amm.install import install_scheduler_extension
from dask_shm.amm.policies import KeepReplicas, ReduceReplicas, RetireWorker

__all__ = [
    "ActiveMemoryManagerExtension",
    "ActiveMemoryManagerPolicy",
    "KeepReplicas",
    "ReduceReplicas",
    "RetireWorker",
    "Suggestion",
    "WorkersMemory",
    "install_scheduler_extension",
]
