"""The per-computation directory of shared-memory files, and its cleanup.

Each computation creates ``dask-shm-local-*`` (mode 0700), or takes over the
one the warm pool kept from the previous computation, and holds an exclusive
``flock`` on the ``.lock`` file inside it for as long as the directory exists
(the warm pool holds it while it keeps the directory). The kernel drops that
lock when the process dies, however it dies, so a directory
whose lock can be taken was left behind by a process killed before it could
clean up (e.g. SIGKILL, OOM killer): the next computation using the same parent
directory removes it. The lock works across PID namespaces sharing the mount.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import warnings
from types import TracebackType

from dask_shm import liveness
from dask_shm.local import config

PREFIX = "dask-shm-local-"
LOCK = ".lock"


def _try_lock(path: str) -> int | None:
    """An fd holding the flock of ``path/.lock``; None if it is held or missing."""
    return liveness.lock_if_dead(os.path.join(path, LOCK), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)


def remove_stale(base: str) -> list[str]:
    """Remove the directories under ``base`` left by dead computations of this
    user (their lock is free); return their paths. Never raises for a
    directory it cannot inspect: it is left alone."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        fd = _try_lock(entry.path)
        if fd is None:
            continue  # alive (or not ours to judge)
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


class ShmDirectory:
    """This computation's directory; :meth:`close` removes it with everything in it.

    Created under ``shm.local.shm-directory`` if set (OSError if that
    fails), else under ``/dev/shm``, else, with a RuntimeWarning, under the
    system temporary directory. Stale directories of dead computations in the
    same parent are removed first.
    """

    def __init__(self) -> None:
        #: ``shm.local.shm-directory`` when it was created (None: the default).
        self.base = base = config.shm_directory_base()
        if base is None:
            try:
                self.path = self._create("/dev/shm")
            except OSError as e:
                fallback = tempfile.gettempdir()
                warnings.warn(
                    f"/dev/shm is not usable ({e}); dask_shm.get puts its files in "
                    f"{fallback}, which may be a disk: large transfers will be slower",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.path = self._create(fallback)
        else:
            self.path = self._create(base)

    def _create(self, base: str) -> str:
        remove_stale(base)
        path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
        try:
            # Locked before it appears under its name: remove_stale in another
            # process can never take the lock of a live computation.
            fd = liveness.publish_locked(
                os.path.join(path, LOCK + ".new"), os.path.join(path, LOCK), directory=False
            )
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._fd: int | None = fd
        return path

    def close(self) -> None:
        """Remove the directory, then release the lock. Idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ShmDirectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
