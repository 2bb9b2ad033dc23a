"""Kernel settings dask-shm sizes itself by, read from ``/proc/sys``.

psutil and distributed do not read these; each is read in this one place."""

from __future__ import annotations

#: The kernel's default ``vm.max_map_count``.
DEFAULT_MAX_MAP_COUNT = 65530


def max_map_count() -> int:
    """``vm.max_map_count`` (mappings one process may hold), or the kernel's
    default when it cannot be read (not Linux, no /proc)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT
