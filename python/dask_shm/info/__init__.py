"""What ``dask-shm info`` reports: is this host ready for shared-memory mode?

- :mod:`~dask_shm.info.facts` gathers the facts as data (:class:`HostInfo`),
  each from the module that owns it;
- :mod:`~dask_shm.info.checks` judges them: a list of :class:`Problem` s,
  each with a fix;
- :mod:`~dask_shm.info.render` renders them as text (:func:`format_info`);
- :mod:`~dask_shm.info.command` is the ``info`` command.

Nothing here changes the system; the command exits 1 when it reports a
problem, else 0 (``--json`` too).

Checked: the shared-memory root (``shm.shared-memory.root``, default
``/dev/shm``) exists, is on a tmpfs, is writable and has room; the per-user
directory under it (``dask-shm-<uid>``) is safe if it exists; whether a
worker on it would have arrays born shared, and why (not a problem either
way); the open-files
limit against what a worker of this host would need and ``vm.max_map_count``
against what a worker could map (held values and born-shared blocks);
the platform (shared memory needs Linux); the ``shm`` config validates; and,
given a scheduler address, which workers have the shared-memory plugin
installed (off is a problem only where the worker's config enables it),
whether each has arrays born shared (and why not) and hands P2P batches to
same-host peers as files, and the bytes each holds in tier 2 (tmpfs) and
tier 3 (disk); the versions of
dask, distributed and dask-shm and every hooked distributed internal; and
the bytes that dead processes' directories (left by a SIGKILL) hold on the
shared-memory root and the disk root.
"""

from __future__ import annotations

from dask_shm.info.checks import Problem, find_problems
from dask_shm.info.facts import (
    PLUGIN_NAME,
    DeadFiles,
    HostInfo,
    OpenFilesLimit,
    WorkerInfo,
    filesystem_of,
    gather_facts,
)
from dask_shm.info.render import format_info

__all__ = [
    "PLUGIN_NAME",
    "DeadFiles",
    "HostInfo",
    "OpenFilesLimit",
    "Problem",
    "WorkerInfo",
    "collect_info",
    "filesystem_of",
    "format_info",
]


def collect_info(
    root: str | None = None,
    scheduler_address: str | None = None,
    *,
    timeout: float = 10.0,
) -> HostInfo:
    """Inspect this host (and, given ``scheduler_address``, the workers of that
    scheduler) for shared-memory mode: the facts, with ``problems`` filled in.

    ``root`` defaults to ``shm.shared-memory.root`` (``/dev/shm``); if the
    config is invalid, the raw configured root is still inspected. Connecting
    to the scheduler waits up to ``timeout`` seconds; failing to connect is
    reported in ``scheduler_error`` and as a problem. Never raises for what it
    finds; nothing on the system is changed (writability is probed by
    creating and removing an empty file in the root).
    """
    info = gather_facts(root, scheduler_address, timeout=timeout)
    info.problems = find_problems(info)
    return info
