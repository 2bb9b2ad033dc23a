"""Shared-memory mode: spill files on a tmpfs, zero-copy unspill, and
same-host transfers by hard link. See ``shared/shm-design.md`` in the project
and the README section "Shared-memory mode".

Modules, one concern each: :mod:`.paths` (directories, cleanup),
:mod:`.payload` (what is worth sharing), :mod:`.store` (the slow store),
:mod:`.transfer` (handles, receiving), :mod:`.sender` (get_data),
:mod:`.registry` (same-host peers), :mod:`.monitor` (memory monitors),
:mod:`.metrics`, :mod:`.plugin`.
"""

from dask_shm.shared.metrics import shm_metrics
from dask_shm.shared.plugin import SharedMemoryNannyPlugin, SharedMemoryPlugin

__all__ = ["SharedMemoryNannyPlugin", "SharedMemoryPlugin", "shm_metrics"]
