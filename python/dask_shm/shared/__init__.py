"""Shared-memory mode: spill files on a tmpfs, zero-copy unspill, and
same-host transfers by hard link. See ``shared/shm-design.md`` in the project
and the README section "Shared-memory mode".

Modules, one concern each: :mod:`.buffer` (:class:`SharedSpillBuffer`, the
spill buffer), :mod:`.store` (its files), :mod:`.tiers` (the file tiers as
an ordered list: tmpfs tier 2, then disk tier 3), :mod:`.limits` (cgroup,
tmpfs space, the tier-2 budget),
:mod:`.paths` (directories, cleanup), :mod:`.payload` (what is worth sharing),
:mod:`.transfer` (handles, receiving), :mod:`.sender` (get_data),
:mod:`.registry` (same-host peers), :mod:`.monitor` (memory monitors),
:mod:`.relief` (tier 2 gives way under memory pressure),
:mod:`.metrics`, :mod:`.plugin`.
"""

from dask_shm.shared.buffer import SharedSpillBuffer
from dask_shm.shared.metrics import shm_metrics
from dask_shm.shared.plugin import SharedMemoryNannyPlugin, SharedMemoryPlugin

__all__ = ["SharedMemoryNannyPlugin", "SharedMemoryPlugin", "SharedSpillBuffer", "shm_metrics"]
