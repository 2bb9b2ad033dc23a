"""dask-shm: Rust-accelerated spilling and shared memory for Dask workers.

Public API:

- :class:`SpillBuffer`: drop-in for ``distributed.spill.SpillBuffer``.
- :func:`worker_data`, :func:`spill_buffer_for_worker`, :class:`SpillBufferPlugin`:
  ways to give workers a :class:`SpillBuffer`.
- :class:`SharedMemoryPlugin`, :class:`SharedMemoryNannyPlugin`: shared-memory
  mode (tmpfs spill files, zero-copy unspill, same-host hard-link transfers).
- :class:`SpillFileError`: a spill file could not be read back.
- :func:`get`: dask's local scheduler on a process pool passing large buffers
  through shared-memory files (``dask.compute(x, scheduler=dask_shm.get)``).
- ``dask_shm.amm``, ``dask_shm.spans``: Active Memory Manager and span extensions.
- :func:`dask_setup`: makes ``--preload dask_shm`` install everything the
  ``shm.*`` config switches enable.
"""

from __future__ import annotations

from distributed.spill import SpilledSize

from dask_shm._core import FileStore, SpillFileError
from dask_shm._core import __version__ as __version__
from dask_shm.compat import warn_if_hooks_missing
from dask_shm.config import load_defaults

load_defaults()
warn_if_hooks_missing()

from dask_shm.local import get  # noqa: E402
from dask_shm.preload import dask_setup  # noqa: E402
from dask_shm.shared import SharedMemoryNannyPlugin, SharedMemoryPlugin  # noqa: E402
from dask_shm.spill import SpillBuffer  # noqa: E402
from dask_shm.worker import (  # noqa: E402
    SpillBufferPlugin,
    spill_buffer_for_worker,
    worker_data,
)

__all__ = [
    "FileStore",
    "SharedMemoryNannyPlugin",
    "SharedMemoryPlugin",
    "SpillBuffer",
    "SpillBufferPlugin",
    "SpillFileError",
    "SpilledSize",
    "dask_setup",
    "get",
    "spill_buffer_for_worker",
    "worker_data",
]
