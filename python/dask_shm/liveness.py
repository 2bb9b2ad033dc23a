"""Liveness by ``flock``: a directory or file is alive while its owner holds an
exclusive lock on it.

The kernel drops a process's ``flock`` locks when it dies, however it dies
(SIGKILL, the OOM killer), and the lock is seen from every PID namespace and
container sharing the file system, where pids and ``/proc`` say nothing. So a
lock nobody holds marks what a dead process left behind. Three things in
dask-shm live this way: a process's directory under the shared-memory roots
(:mod:`dask_shm.shared.paths`), a worker's peer-registry entry
(:mod:`dask_shm.shared.registry`) and a ``dask_shm.get`` computation's
directory (:mod:`dask_shm.local.directory`). This module is their one
implementation of the two steps that must be right:

- :func:`publish_locked`: create under a temporary name, lock, then rename, so
  that nobody ever sees the final name unlocked (a sweep in another process
  would take it for dead);
- :func:`lock_if_dead`: take the lock of something found by name without
  waiting; holding it, the caller may remove it, and nobody else can judge it
  dead at the same time.

``distributed.diskutils.WorkSpace`` does the same for worker directories, but
with ``.dirlock`` files next to the directories and ``global.lock``/``purge.lock``
files in the parent, switched off by ``distributed.worker.use-file-locking``:
it cannot lock a directory itself or a registry file, and our layouts (and what
``dask shm clean`` counts) would change.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


def try_lock(fd: int, *, shared: bool = False) -> bool:
    """Take the flock on ``fd`` (exclusive, or ``shared``) without waiting;
    False if another open file description holds it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_if_dead(path: str, flags: int = DIRECTORY_FLAGS, *, shared: bool = False) -> int | None:
    """A descriptor of ``path`` (opened with ``flags``) holding its lock if its
    owner is gone, else None: held by a live owner, missing, or not openable.
    Closing the descriptor drops the lock. ``shared`` takes a shared lock
    (enough to tell that nobody holds an exclusive one)."""
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if try_lock(fd, shared=shared):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def still_named(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not replaced or
    removed since it was opened). Never raises."""
    try:
        return os.lstat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def owner_alive(path: str, flags: int, *, remove_if_dead: bool = False) -> bool:
    """Whether someone holds a lock on ``path`` (False if it cannot be
    opened); with ``remove_if_dead`` a file nobody holds is unlinked, unless
    it was replaced meanwhile."""
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        if not try_lock(fd, shared=True):
            return True
        if remove_if_dead and still_named(path, fd):
            try:
                os.unlink(path)
            except OSError:
                pass
        return False
    finally:
        os.close(fd)


def publish_locked(
    tmp: str,
    final: str,
    *,
    directory: bool,
    before_publish: Callable[[int], None] | None = None,
) -> int:
    """Create ``tmp`` (a 0700 directory, or an empty 0600 file that must not
    exist), take its exclusive flock, run ``before_publish(fd)`` (e.g. write
    the content), and rename it to ``final`` (replacing a file there). Returns
    the descriptor that holds the lock; the thing lives until it is closed.
    On any failure ``tmp`` is removed and the exception propagates."""
    if directory:
        os.mkdir(tmp, 0o700)
        try:
            fd = os.open(tmp, DIRECTORY_FLAGS)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    else:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if before_publish is not None:
            before_publish(fd)
        if directory:
            os.rename(tmp, final)
        else:
            os.replace(tmp, final)
    except BaseException:
        os.close(fd)
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    return fd
