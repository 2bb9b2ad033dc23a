"""How much memory this process may really use, and the tier-2 budget.

tmpfs is RAM: a file "spilled" to ``/dev/shm`` is charged to the memory
cgroup of the job (SLURM, a Kubernetes pod, a Docker container) like any
other page and cannot be reclaimed without swap. So shared-memory mode keeps
its tmpfs files (tier 2) within a byte budget and moves what does not fit to
a real file system (tier 3). This module holds the facts that budget is
derived from and the derivation itself:

- :func:`cgroup_memory` -- the limit and usage of this process's memory
  cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, found through
  ``/proc/self/cgroup``), None when there is no limit;
- :func:`tmpfs_space` -- size and free bytes of the shared-memory root;
- :func:`tier2_budget` -- the budget for one worker from the
  ``shm.shared-memory.max-bytes`` setting (``auto``, a byte size, or a
  fraction), and whether the root is too small to be useful
  (:data:`SMALL_ROOT_ADVICE` names the fix).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: ``max-bytes: auto`` gives tier 2 this fraction of the memory available to
#: a worker (its memory limit, else the cgroup's or the host's memory). The
#: worker's memory monitor counts tier 2 against the memory limit, so this
#: leaves the larger part of the limit to private memory below the
#: ``spill`` (0.7) and ``target`` (0.6) thresholds.
AUTO_FRACTION = 0.3

#: Of the tmpfs's free space, at most this fraction is budgeted (other users).
TMPFS_HEADROOM = 0.9

#: A root whose free space is below this and below the budget that would
#: otherwise apply gets the small-root warning.
SMALL_ROOT_BYTES = 256 * 2**20

SMALL_ROOT_ADVICE = (
    "give the container a larger /dev/shm (docker run --shm-size=4g ..., "
    "Kubernetes: mount an emptyDir {medium: Memory, sizeLimit: 4Gi} at /dev/shm) "
    "or set shm.shared-memory.root to a larger tmpfs"
)


def small_root_message(root: str, free: int) -> str:
    """What a worker logs (WARNING) and ``dask shm info`` reports for a root
    whose budget is ``small_root``: tier 3 takes over, nothing fails."""
    return (
        f"the shared-memory root {root} has only {free >> 20} MiB free; spilled data "
        "beyond that goes to disk (tier 3)"
    )


_UNLIMITED_V1 = 2**62  # v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class CgroupMemory:
    """Memory limit of this process's cgroup."""

    #: ``v1`` or ``v2``
    version: str
    #: the cgroup's directory under /sys/fs/cgroup
    path: str
    #: bytes the cgroup may use
    limit: int
    #: bytes it uses now (None if unreadable)
    usage: int | None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_memory(
    proc_cgroup: str = "/proc/self/cgroup", base: str = "/sys/fs/cgroup"
) -> CgroupMemory | None:
    """The memory limit of the process's own cgroup (the tightest one on its
    path up to the root, as the kernel enforces them all), or None when it
    has none or it cannot be read (not Linux, no cgroup file system).

    v1: the ``memory`` controller's hierarchy, ``memory.limit_in_bytes``
    (usage ``memory.usage_in_bytes``); v2: the unified hierarchy (line
    ``0::``), ``memory.max`` (usage ``memory.current``); v2 is looked for at
    ``base`` and ``base/unified`` (hybrid hosts).
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: CgroupMemory | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if "memory" in controllers.split(","):
            candidates = [
                (
                    "v1",
                    os.path.join(base, "memory"),
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                )
            ]
        elif controllers == "":
            candidates = [
                ("v2", base, "memory.max", "memory.current"),
                ("v2", os.path.join(base, "unified"), "memory.max", "memory.current"),
            ]
        else:
            continue
        for version, mount, limit_file, usage_file in candidates:
            path = os.path.join(mount, rel.lstrip("/"))
            while True:
                limit = _read_int(os.path.join(path, limit_file))
                if limit is not None and limit < _UNLIMITED_V1:
                    if best is None or limit < best.limit:
                        usage = _read_int(os.path.join(path, usage_file))
                        best = CgroupMemory(version, path, limit, usage)
                if os.path.normpath(path) == os.path.normpath(mount):
                    break
                path = os.path.dirname(path)
    return best


def host_memory_total() -> int:
    """MemTotal of the host in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_available_to_process() -> int:
    """The memory this process may use: the cgroup limit if there is one,
    else the host's total memory."""
    host = host_memory_total()
    cg = cgroup_memory()
    return host if cg is None else min(host, cg.limit)


@dataclass(frozen=True)
class TmpfsSpace:
    size: int
    free: int


def tmpfs_space(root: str) -> TmpfsSpace:
    """Size and free bytes (for an unprivileged user) of the file system of
    ``root``. Raises OSError if it cannot be read."""
    st = os.statvfs(root)
    return TmpfsSpace(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


@dataclass(frozen=True)
class Budget:
    """The tier-2 budget of one worker and how it was decided."""

    #: bytes of tmpfs files the worker keeps before moving files to tier 3
    limit: int
    #: human-readable derivation, for logs and ``dask-shm info``
    reason: str
    #: the root is too small for a useful tier 2 (warn with SMALL_ROOT_ADVICE)
    small_root: bool


def tier2_budget(
    max_bytes: int | float | None,
    root: str,
    memory_limit: int | None,
    *,
    held: int = 0,
    target_fraction: float | None = None,
) -> Budget:
    """The tier-2 budget of a worker with ``memory_limit`` bytes (None: no
    limit) on ``root``.

    ``max_bytes``: None for ``auto`` (:data:`AUTO_FRACTION` of the memory
    limit, else of the memory available to the process -- the cgroup limit or
    the host's memory -- which also caps a larger memory limit); a float in
    (0, 1] for that fraction instead; an int for an absolute number of bytes.
    Every result is capped by :data:`TMPFS_HEADROOM` of the root's free space
    now.

    With ``auto``, a memory limit and ``target_fraction`` (the worker's
    ``distributed.worker.memory.target``), the budget is also capped so that
    ``held`` (the private bytes the process holds already: interpreter,
    libraries) plus a full tier 2 stays below that target: tmpfs files count
    in the worker's memory, and a tier 2 that alone keeps the worker above its
    target would have it spill, pause and be restarted with nothing left to
    spill. Small memory limits then spill mostly to disk, as stock does.
    """
    # A memory limit above what the process may use (distributed's "auto"
    # ignores a cgroup it cannot see at /sys/fs/cgroup, as under SLURM: no
    # cgroup namespace) is capped by it: tmpfs pages are charged to the cgroup.
    available = memory_available_to_process()
    if memory_limit and memory_limit <= available:
        base, base_name = memory_limit, "memory limit"
    else:
        base, base_name = available, "available memory"
    if max_bytes is None:
        wanted, how = int(AUTO_FRACTION * base), f"{AUTO_FRACTION:g} x {base_name}"
        if memory_limit and target_fraction:
            room = max(0, int(target_fraction * memory_limit) - held)
            if room < wanted:
                wanted = room
                how = f"{target_fraction:g} x memory limit - {held} bytes already held"
    elif isinstance(max_bytes, float):
        wanted, how = int(max_bytes * base), f"{max_bytes:g} x {base_name}"
    else:
        wanted, how = int(max_bytes), "shm.shared-memory.max-bytes"
    try:
        free = tmpfs_space(root).free
    except OSError:
        free = 0
    cap = int(TMPFS_HEADROOM * free)
    small = free < SMALL_ROOT_BYTES and free < wanted
    if cap < wanted:
        return Budget(cap, f"{TMPFS_HEADROOM:g} x free space of {root} (< {how})", small)
    return Budget(wanted, how, small)


def summary(root: str, max_bytes: int | float | None, memory_limit: int | None = None) -> dict:
    """Facts for ``dask-shm info``: ``cgroup`` (None or version, path, limit,
    usage), ``memory_available`` (bytes this process may use), ``tmpfs``
    (size and free bytes of ``root``, None if unreadable) and ``budget`` (the
    tier-2 budget a worker with ``memory_limit`` would get: limit, reason,
    small_root). Never raises for an unreadable fact."""
    cg = cgroup_memory()
    try:
        space: TmpfsSpace | None = tmpfs_space(root)
    except OSError:
        space = None
    budget = tier2_budget(max_bytes, root, memory_limit)
    return {
        "cgroup": None if cg is None else cg.__dict__.copy(),
        "memory_available": memory_available_to_process(),
        "tmpfs": None if space is None else space.__dict__.copy(),
        "budget": budget.__dict__.copy(),
    }
