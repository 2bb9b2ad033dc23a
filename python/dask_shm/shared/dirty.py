"""Has a mapped value been written to since it was mapped?

A value unspilled from a shared file lives in a private (copy-on-write)
mapping of it. A task that writes to it in place gets private copies of the
pages it wrote; the file keeps the old bytes. Evicting the value by keeping
the file (writing nothing) would then silently revert the write, and handing
the file to a peer would send the old value. :func:`written_in_place` tells.

How, cheaply: :func:`dask_shm._core.mapped_ranges` gives the address ranges
of this process's spill-file mappings (``MappedFile``, what every retained
value lives in) of the file's inode, kept as mappings come and go (reading
``/proc/self/maps`` instead would cost O(mappings) per check: milliseconds
for a worker holding thousands of values), and ``/proc/self/pagemap`` one
64-bit entry per page of them. A page the process wrote is no longer the file's page but an
anonymous copy: present (bit 63) or swapped (bit 62) without the "file page"
flag (bit 61). Nothing has to be reset or armed beforehand (unlike soft-dirty
bits, which ``/proc/self/clear_refs`` clears for the whole process), nothing
changes for the value (unlike mapping it read-only, which would break tasks
that write to their inputs, which stock allows), and the cost is reading 8
bytes per 4 KiB page when the value is evicted or exported
(``benches/bench_dirty.py``). When ``/proc`` cannot tell, the answer is "written":
the value is then written out from memory, which is always correct.
"""

from __future__ import annotations

import os

from dask_shm import _core
from dask_shm.shared import paths


def mapped_ranges(inode: int, device: int, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """``(start, end)`` addresses of all of this process's mappings of one
    inode, from ``/proc/self/maps`` (O(mappings); for diagnostics)."""
    dev = f"{os.major(device):02x}:{os.minor(device):02x}"
    ranges = []
    with open(maps, encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and fields[4] == str(inode) and fields[3] == dev:
                start, end = fields[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def written_in_place(path: str) -> bool:
    """Whether any page of this process's spill-file mappings of the file at
    ``path`` was written by this process (True too when it cannot be told;
    False when the file is not mapped at all). One Rust call, keeping the GIL
    for a file on a tmpfs (see :func:`dask_shm.shared.paths.in_ram`): it runs
    on every eviction and export of a mapped value."""
    return _core.written_in_place(path, paths.in_ram(path))
