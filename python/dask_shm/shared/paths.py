"""Where shared-memory files live, and cleaning up after dead processes.

Layout under the configured root (``/dev/shm`` by default)::

    <root>/dask-shm-<uid>/               0700, one per user
        p-<pid>-<start>/                 one per process that uses shared memory
            <worker directory>/          one SpillBuffer's files (tier 2)
            outgoing/                    short-lived links handed to peers
        peers/<address>                  who on this host accepts hard-link handles

    <disk root>/dask-shm-<uid>/p-.../    the same for tier 3 (no ``peers/``)

A process directory is named after its pid, the process start time (clock
ticks since boot) and a random suffix, for people reading the root. Whether
its process is alive is told by a lock, not by the name: the process holds an
exclusive ``flock`` on its directory for the directory's whole life, and the
kernel drops it when the process dies. Pids and /proc say nothing about a
process in another PID namespace (a container sharing the root); a lock does.
Registry entries under ``peers/`` are locked the same way.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import re
import shutil
import stat
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from dask_shm._core import is_ram_backed

logger = logging.getLogger(__name__)


def _unescape_mount(text: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def filesystem_of(path: str, mounts: str = "/proc/mounts") -> tuple[str, str] | None:
    """``(mount point, filesystem type)`` of the mount holding ``path``
    (resolved with ``os.path.realpath``): the longest mount point in
    ``mounts`` that is a prefix of it; of equal ones the last (the mount on
    top). None if ``mounts`` cannot be read or nothing matches."""
    target = os.path.realpath(path)
    best: tuple[str, str] | None = None
    try:
        with open(mounts, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point, fs_type = _unescape_mount(fields[1]), fields[2]
        inside = (
            mount_point == "/"
            or target == mount_point
            or target.startswith(mount_point.rstrip("/") + "/")
        )
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, fs_type)
    return best


def filesystem_type(path: str) -> str | None:
    """Type of the file system holding ``path`` (from /proc/mounts), or None
    when it cannot be told (no /proc, path missing)."""
    mount = filesystem_of(path)
    return None if mount is None else mount[1]


class UnusableRoot(Exception):
    """The shared-memory root cannot be used; the message says why and how to fix it."""


def check_root(root: str) -> None:
    """Raise :class:`UnusableRoot` unless ``root`` is an existing, writable
    directory on a tmpfs of a Linux host."""
    if not sys.platform.startswith("linux"):
        raise UnusableRoot(
            f"shared-memory mode needs Linux (tmpfs, hard links, /proc); this is {sys.platform}"
        )
    if not os.path.isdir(root):
        raise UnusableRoot(
            f"shared-memory root {root} does not exist; create it or set "
            "shm.shared-memory.root to a tmpfs such as /dev/shm"
        )
    # The one RAM-backed rule (statfs magic: tmpfs, ramfs, hugetlbfs), shared
    # with the Rust store; /proc/mounts only names the file system in the message.
    if not is_ram_backed(root):
        fstype = filesystem_type(root)
        raise UnusableRoot(
            f"shared-memory root {root} is on {fstype or 'an unknown file system'}, not tmpfs; "
            "mount a tmpfs there or set shm.shared-memory.root to /dev/shm"
        )
    if not os.access(root, os.W_OK | os.X_OK):
        raise UnusableRoot(f"shared-memory root {root} is not writable by this user")
    _check_user_dir(os.path.join(root, f"dask-shm-{os.geteuid()}"))


def _check_user_dir(path: str) -> None:
    """Raise UnusableRoot if this user's directory exists but is not a real
    directory of ours (another user made it first, or it is a symlink)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UnusableRoot(f"{path} cannot be examined: {e}") from e
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
    elif st.st_uid != os.geteuid():
        what = f"a directory of uid {st.st_uid}, not of this user (uid {os.geteuid()})"
    else:
        return
    raise UnusableRoot(
        f"{path} is {what}: this user's shared-memory files cannot go there. "
        "Remove it (as its owner or root), or set shm.shared-memory.root to another tmpfs"
    )


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


@dataclass(frozen=True)
class ProcessIdentity:
    """Who made a process directory (for people reading the root; liveness is
    never judged by it: pids mean nothing across PID namespaces)."""

    pid: int
    start: int

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, process_start_time(pid) or 0)

    @property
    def dirname(self) -> str:
        return f"p-{self.pid}-{self.start}"

    @classmethod
    def from_dirname(cls, name: str) -> ProcessIdentity | None:
        parts = name.split("-")
        if len(parts) not in (3, 4) or parts[0] != "p" or not (parts[1] + parts[2]).isdigit():
            return None
        return cls(int(parts[1]), int(parts[2]))


def _make_private_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if st.st_uid != os.geteuid() or not os.path.isdir(path) or os.path.islink(path):
        raise UnusableRoot(f"{path} exists and is not a directory owned by this user")
    os.chmod(path, 0o700)
    return path


def user_dir_path(root: str) -> str:
    """``<root>/dask-shm-<uid>``: this user's directory under ``root`` (not created)."""
    return os.path.join(root, f"dask-shm-{os.geteuid()}")


def user_dir_problem(path: str) -> str:
    """What keeps dask-shm from using the existing private directory ``path``
    (a symbolic link, not a directory, another user's), as a phrase; "" when
    nothing does, including when it does not exist yet (it is created 0700
    when first needed, and a wrong mode is fixed then). Never raises."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    return ""


def user_root(root: str) -> str:
    """``<root>/dask-shm-<uid>``, created 0700 if needed."""
    return _make_private_dir(user_dir_path(root))


# -- process directories, alive while their lock is held -------------------------

#: A directory still being set up (``.new-*``) is left alone this long.
NEW_DIR_GRACE_SECONDS = 60.0

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


@dataclass
class _Held:
    path: str
    fd: int
    pid: int


#: user root -> this process's directory there and the descriptor locking it
_held: dict[str, _Held] = {}
_held_lock = threading.RLock()


def _lock_is_free(fd: int, shared: bool = False) -> bool:
    """Try to take the flock on ``fd`` without waiting."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _create_locked_dir(base: str) -> _Held:
    """A new process directory in ``base``, locked before anyone can see it
    under its final name: made under a ``.new-`` name, flocked, renamed."""
    name = f"{ProcessIdentity.current().dirname}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(base, f".new-{name}")
    os.mkdir(tmp, 0o700)
    fd = os.open(tmp, _DIR_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = os.path.join(base, name)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _Held(path, fd, os.getpid())


def _current(base: str) -> _Held | None:
    held = _held.get(base)
    if held is None:
        return None
    if held.pid != os.getpid():
        # Inherited through fork: the parent's lock, not ours.
        os.close(held.fd)
        del _held[base]
        return None
    try:
        still_ours = os.stat(held.path).st_ino == os.fstat(held.fd).st_ino
    except OSError:
        still_ours = False
    if not still_ours:
        os.close(held.fd)
        del _held[base]
        return None
    return held


def process_dir(root: str) -> str:
    """This process's directory under the user root, created if needed. The
    process holds an exclusive flock on it until it exits or
    :func:`release_process_dir`; sweeps (from any PID namespace or container
    sharing the root) remove only directories whose lock is free."""
    base = user_root(root)
    with _held_lock:
        held = _current(base)
        if held is None:
            held = _held[base] = _create_locked_dir(base)
        return held.path


def subdir(root: str, name: str) -> str:
    """``<process dir>/<name>``, created 0700 if needed."""
    with _held_lock:
        return _make_private_dir(os.path.join(process_dir(root), name))


#: Subdirectories a process directory may hold when nothing else uses it.
_SCAFFOLDING = ("outgoing",)


def release_process_dir(root: str) -> bool:
    """Remove this process's directory under ``root`` if nothing is left in it
    but an empty ``outgoing`` directory, and drop its lock.
    Returns True if it was removed. A later :func:`process_dir` makes a new one."""
    base = os.path.join(root, f"dask-shm-{os.geteuid()}")
    with _held_lock:
        held = _current(base)
        if held is None:
            return False
        for sub in _SCAFFOLDING:
            try:
                os.rmdir(os.path.join(held.path, sub))
            except OSError:
                pass
        try:
            os.rmdir(held.path)
        except OSError:
            return False  # still in use by a buffer of this process
        os.close(held.fd)
        del _held[base]
        return True


@atexit.register
def _remove_own_dirs() -> None:
    """At interpreter exit, this process's directories go (links that peers
    made to its files keep those files alive)."""
    with _held_lock:
        for base, held in list(_held.items()):
            if held.pid == os.getpid():
                shutil.rmtree(held.path, ignore_errors=True)
                os.close(held.fd)
            del _held[base]


def _sweep_entry(base: str, name: str) -> bool:
    """Remove the process directory ``base/name`` if its lock is free."""
    path = os.path.join(base, name)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return False
    try:
        if not _lock_is_free(fd):
            return False
        st = os.fstat(fd)
        if name.startswith(".new-") and time.time() - st.st_mtime < NEW_DIR_GRACE_SECONDS:
            return False  # between mkdir and flock of a starting process
        try:
            if os.lstat(path).st_ino != st.st_ino:
                return False
        except OSError:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def sweep_dead_processes(root: str, *, peers: bool = True) -> list[str]:
    """Remove the directories of processes that are gone (a worker killed
    with SIGKILL cannot clean up after itself), and (``peers``) the
    peer-registry entries of workers that are gone. The same rule holds for
    the tier-3 root on disk (swept with ``peers=False``: it has no registry).
    A directory is gone when nobody holds its flock: the kernel drops the
    lock when its process dies, in whatever PID namespace or container.
    Returns the directories removed. Files still mapped or linked elsewhere
    live on until their last user goes (Unix semantics)."""
    from dask_shm.shared.registry import sweep_peers

    removed = []
    base = user_root(root)
    with _held_lock:
        own = _current(base)
        for name in os.listdir(base):
            if not name.startswith(("p-", ".new-p-")):
                continue
            if own is not None and os.path.join(base, name) == own.path:
                continue
            if _sweep_entry(base, name):
                removed.append(os.path.join(base, name))
    if removed:
        logger.info("dask-shm: removed %d directories of dead processes", len(removed))
    if peers:
        sweep_peers(root)
    return removed
