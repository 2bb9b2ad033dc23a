"""Which workers on this host accept hard-link handles.

A worker in shared-memory mode writes one small file under
``<root>/dask-shm-<uid>/peers/`` named after its address and holds an
exclusive ``flock`` on it while it is registered. Because the file lives on the
root itself, a peer found there shares our file system (hard links work) and
our uid (the directory is 0700). An entry nobody holds a lock on belongs to a
worker that is gone (killed with SIGKILL, say, in whatever PID namespace): it
is ignored and removed. The file's content (pid, start time) is informative
only.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from urllib.parse import quote

from dask_shm.shared import paths

#: How long a positive or negative answer is trusted before the file is re-read.
CACHE_SECONDS = 2.0

#: A half-written registration (``*.tmp``) older than this is removed by sweeps.
TMP_GRACE_SECONDS = 60.0

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _serializing_address(address: str) -> bool:
    return not address.startswith("inproc://")


def peers_directory(root: str) -> str:
    path = os.path.join(paths.user_root(root), "peers")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _entry_is_live(path: str, remove_if_dead: bool) -> bool:
    """Whether someone holds the lock of the registry entry ``path``; a dead
    entry is unlinked when ``remove_if_dead`` (unless it was replaced meanwhile)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        if remove_if_dead:
            try:
                if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
            except OSError:
                pass
        return False
    finally:
        os.close(fd)


def sweep_peers(root: str) -> list[str]:
    """Remove registry entries whose worker is gone; returns their file names."""
    directory = peers_directory(root)
    removed = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith(".tmp"):
            try:
                old = time.time() - os.lstat(path).st_mtime > TMP_GRACE_SECONDS
            except OSError:
                continue
            if old and not _entry_is_live(path, remove_if_dead=True):
                removed.append(name)
            continue
        if not _entry_is_live(path, remove_if_dead=True):
            removed.append(name)
    return removed


class PeerRegistry:
    def __init__(self, root: str):
        self.directory = peers_directory(root)
        self._cache: dict[str, tuple[float, bool]] = {}
        #: address -> descriptor holding the lock of our entry
        self._held: dict[str, int] = {}

    def _path(self, address: str) -> str:
        return os.path.join(self.directory, quote(address, safe=""))

    def register(self, address: str) -> None:
        """Announce that the worker at ``address`` (this process) accepts handles,
        until :meth:`unregister` or this process's death. An ``inproc://``
        address is never announced: its messages are not serialized, so it
        could not turn a handle back into a value."""
        if not _serializing_address(address):
            return
        self.unregister(address)
        me = paths.ProcessIdentity.current()
        tmp = f"{self._path(address)}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            # Locked before it is visible under its name: never seen dead.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps({"pid": me.pid, "start": me.start}).encode())
            os.replace(tmp, self._path(address))
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._held[address] = fd
        self._cache.pop(address, None)

    def unregister(self, address: str) -> None:
        """Withdraw our entry for ``address`` (nothing if it is not ours)."""
        self._cache.pop(address, None)
        fd = self._held.pop(address, None)
        if fd is None:
            return
        try:
            path = self._path(address)
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)

    def accepts_handles(self, address: str | None) -> bool:
        """Whether ``address`` is a live worker of this host in shared-memory mode."""
        if not address or not _serializing_address(address):
            return False
        now = time.monotonic()
        cached = self._cache.get(address)
        if cached is not None and now - cached[0] < CACHE_SECONDS:
            return cached[1]
        answer = _entry_is_live(self._path(address), remove_if_dead=True)
        self._cache[address] = (now, answer)
        return answer
