"""dask-shm: Rust-accelerated spilling and shared memory for Dask workers.

Public API:

- :class:`SpillBuffer`: drop-in for ``distributed.spill.SpillBuffer``.
- :func:`worker_data`, :func:`spill_buffer_for_worker`, :class:`SpillBufferPlugin`:
  ways to give workers a :class:`SpillBuffer`.
- :class:`SpillFileError`: a spill file could not be read back.
"""

from __future__ import annotations

from distributed.spill import SpilledSize

from dask_shm._core import FileStore, SpillFileError
from dask_shm._core import __version__ as __version__
from dask_shm.spill import SpillBuffer
from dask_shm.worker import SpillBufferPlugin, spill_buffer_for_worker, worker_data

__all__ = [
    "FileStore",
    "SpillBuffer",
    "SpillBufferPlugin",
    "SpillFileError",
    "SpilledSize",
    "spill_buffer_for_worker",
    "worker_data",
]
