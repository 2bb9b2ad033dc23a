"""Configuration of the local scheduler: its keys, read and validated through
:mod:`dask_shm.config` (defaults: ``dask-shm.yaml``).

Keys (all under ``shm.local``, settable with ``dask.config.set``):

``shm-directory``
    Directory under which each computation creates its own 0700 directory of
    shared-memory files. Default None: ``/dev/shm``, or the system temporary
    directory (with a warning) if ``/dev/shm`` is missing or not writable.
    Directories left there by computations whose process was killed are
    removed by the next computation (see :mod:`dask_shm.local.directory`).
``shm-threshold``
    Buffers of at least this many bytes travel through files; smaller ones go
    through the pipe inside the pickle. Default ``"64 KiB"``.
``memory-target``
    When set and no ``cache=`` is given, :func:`dask_shm.local.get` keeps
    intermediate results in a :class:`~dask_shm.local.SpillCache` that spills to
    disk above this size: bytes (int or ``"4 GiB"``), a fraction of RAM
    (``0.5``) or a percentage (``"50%"``). Default None: a plain dict.
``spill-directory``
    Where that cache spills. Default None: dask's ``temporary-directory``, else
    the system temporary directory.
``recycle-bytes``
    Files of intermediates no longer needed are kept, up to this many bytes,
    and given to pool processes to overwrite with their next results instead
    of being deleted (see :mod:`dask_shm.local.transport`): on a tmpfs,
    allocating and freeing pages costs several times the copy itself. Bytes
    (int or ``"256 MiB"``); 0 deletes them at once. Default ``"256 MiB"``.
``warm-pool``
    True (default): keep the process pool :func:`dask_shm.local.get` creates
    between computations (see :mod:`dask_shm.local.pool`); False: a pool per
    computation, as ``scheduler="processes"`` does.
``idle-file-timeout``
    How long the warm pool keeps the files the last computation left for
    reuse (at most ``recycle-bytes`` in the parent plus as much in each pool
    process, none of them mapped): a computation started meanwhile overwrites
    them instead of allocating new pages, and the one that ended did not
    spend its time deleting them. A duration (``"5 s"``) or seconds; 0
    deletes them when the computation ends. Default ``"5 s"``.
``queued-tasks``
    Tasks sent ahead to the pool for each pool process, beyond the one it is
    running (in batches of ``chunksize``), so that a process that finishes a
    task starts the next at once instead of waiting for the parent to handle
    its result and send another. Default 1; 0 keeps one task in flight per
    process, as ``scheduler="processes"`` does.
"""

from __future__ import annotations

from typing import cast

import psutil

from dask_shm.config import (
    byte_size,
    invalid,
    setting,
    setting_bytes,
    setting_duration,
    setting_path,
    temporary_directory,
)

PREFIX = "shm.local"


def parse_size(value: object, key: str) -> int:
    """A positive byte count from an int or a string such as ``"64 KiB"``.

    Raises ValueError naming ``key`` and the accepted values.
    """
    try:
        n = byte_size(value, key)
    except (TypeError, ValueError):
        n = 0
    if n <= 0:
        raise ValueError(
            f"{key} must be a positive number of bytes (an int or a string such as "
            f"'64 KiB'); got {value!r}"
        )
    return n


def parse_memory_target(value: object, key: str = "memory_target") -> int:
    """Bytes from an int, a byte string (``"4 GiB"``), a fraction of RAM in
    ``(0, 1]`` (``0.5``) or a percentage string (``"50%"``).

    Raises ValueError naming ``key`` and the accepted values.
    """
    error = ValueError(
        f"{key} must be a number of bytes (an int or a string such as '4 GiB'), a fraction "
        f"of RAM in (0, 1] such as 0.5, or a percentage such as '50%'; got {value!r}"
    )
    total = psutil.virtual_memory().total
    if isinstance(value, bool):
        raise error
    if isinstance(value, float):
        if 0 < value <= 1:
            return max(1, int(total * value))
        raise error
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            raise error from None
        if 0 < percent <= 100:
            return max(1, int(total * percent / 100))
        raise error
    try:
        return parse_size(value, key)
    except ValueError:
        raise error from None


def shm_threshold(value: object = None) -> int:
    """The threshold from the argument, else ``shm.local.shm-threshold``."""
    if value is not None:
        return parse_size(value, "shm_threshold")
    return setting_bytes(f"{PREFIX}.shm-threshold", minimum=1)


def recycle_bytes(value: object = None) -> int:
    """Bytes of freed files kept for reuse, from the argument, else
    ``shm.local.recycle-bytes``; 0 turns reuse off.

    Raises ValueError naming the key when it is not a byte count >= 0.
    """
    if value is None:
        return setting_bytes(f"{PREFIX}.recycle-bytes")
    if value == 0 or value == "0":
        return 0
    return parse_size(value, "recycle_bytes")


def memory_target(value: object = None) -> int | None:
    """The cache target from the argument, else the config; None if neither."""
    if value is not None:
        return parse_memory_target(value, "memory_target")
    key = f"{PREFIX}.memory-target"
    configured = setting(key)
    if configured is None:
        return None
    try:
        return parse_memory_target(configured, key)
    except ValueError:
        raise invalid(key, configured) from None


def spill_directory() -> str:
    """Parent directory for spilling caches: ``shm.local.spill-directory``,
    else dask's ``temporary-directory``, else the system's."""
    return setting_path(f"{PREFIX}.spill-directory", absolute=False) or temporary_directory()


def shm_directory_base() -> str | None:
    """``shm.local.shm-directory``, validated; None if unset."""
    return setting_path(f"{PREFIX}.shm-directory", absolute=False)


def warm_pool() -> bool:
    """``shm.local.warm-pool``.

    Raises ValueError naming the key when it is not a boolean.
    """
    return bool(setting(f"{PREFIX}.warm-pool"))


def queued_tasks(value: object = None) -> int:
    """Tasks queued per pool process beyond the running one, from the argument,
    else ``shm.local.queued-tasks``.

    Raises ValueError naming the key when it is not an int >= 0.
    """
    if value is None:
        return cast(int, setting(f"{PREFIX}.queued-tasks"))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"queued_tasks must be an integer >= 0; got {value!r}")
    return value


def idle_file_timeout() -> float:
    """``shm.local.idle-file-timeout`` in seconds (0: off).

    Raises ValueError naming the key when it is not a duration >= 0.
    """
    return setting_duration(f"{PREFIX}.idle-file-timeout")
