"""Out-of-core cache for dask's local schedulers."""

from __future__ import annotations

import shutil
import tempfile
from types import TracebackType
from typing import Literal

from dask_shm.local import config
from dask_shm.spill import SpillBuffer


class SpillCache(SpillBuffer):
    """A :class:`dask_shm.SpillBuffer` in a fresh temporary directory, to pass
    as ``cache=`` to dask's local schedulers (``"threads"``, ``"sync"``,
    :func:`dask_shm.get`) or to set with ``dask.config.set(cache=...)``.

    ``dask.local.get_async`` keeps every intermediate result in its ``cache``
    until the last task needing it has run; with this cache, results beyond
    ``target`` bytes (by ``sizeof``) spill to disk, least recently used first,
    and come back when a task needs them, so a computation whose live
    intermediates exceed RAM runs instead of dying.

    Parameters
    ----------
    target:
        Bytes (``int`` or ``"4 GiB"``), a fraction of RAM in ``(0, 1]`` such as
        ``0.5``, or a percentage such as ``"50%"``.
    directory:
        Parent of the spill directory. Default: ``shm.local.spill-directory``,
        else dask's ``temporary-directory``, else the system temporary
        directory. Put it on a disk, not on a tmpfs such as ``/dev/shm``
        (which is RAM).
    max_spill:
        Limit on bytes on disk, or False. Past it values stay in memory.

    Raises ValueError for a bad ``target`` (naming it and the accepted values).

    Note that dask treats keys already in the cache as computed: use a new
    cache per computation, or the same one only for computations whose keys
    are meant to be shared. :meth:`close` (or leaving the ``with`` block)
    deletes every entry and the directory.
    """

    def __init__(
        self,
        target: int | float | str,
        directory: str | None = None,
        max_spill: int | Literal[False] = False,
    ):
        nbytes = config.parse_memory_target(target, "target")
        base = directory or config.spill_directory()
        path = tempfile.mkdtemp(prefix="dask-shm-cache-", dir=base)
        try:
            super().__init__(path, nbytes, max_spill)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._path = path

    def close(self) -> None:
        """Forget every entry (without reading spilled ones back) and delete
        the spill directory. Idempotent; also runs when the cache is garbage
        collected."""
        path = getattr(self, "_path", None)
        if path is None:  # __init__ failed; nothing was created
            return
        for key in list(self.keys()):
            del self[key]
        super().close()
        shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> SpillCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<SpillCache {self._path}: {len(self.fast)} in memory, "
            f"{len(self.slow)} spilled, target {self.n} bytes>"
        )
