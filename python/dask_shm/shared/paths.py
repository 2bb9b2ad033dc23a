"""Where shared-memory files live, and cleaning up after dead processes.

Layout under the configured root (``/dev/shm`` by default)::

    <root>/dask-shm-<uid>/               0700, one per user
        p-<pid>-<start>/                 one per process that uses shared memory
            <worker directory>/          one SpillBuffer's files
            incoming/                    files received from peers, not yet claimed
            outgoing/                    short-lived links handed to peers
        peers/<address>                  who on this host accepts hard-link handles

A process directory is named after its pid and the process start time (clock
ticks since boot), so a recycled pid never makes a dead process look alive.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TMPFS_TYPES = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


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
    fstype = filesystem_type(root)
    if fstype not in TMPFS_TYPES:
        raise UnusableRoot(
            f"shared-memory root {root} is on {fstype or 'an unknown file system'}, not tmpfs; "
            "mount a tmpfs there or set shm.shared-memory.root to /dev/shm"
        )
    if not os.access(root, os.W_OK | os.X_OK):
        raise UnusableRoot(f"shared-memory root {root} is not writable by this user")


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
        if len(parts) != 3 or parts[0] != "p" or not (parts[1] + parts[2]).isdigit():
            return None
        return cls(int(parts[1]), int(parts[2]))

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start


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


def process_dir(root: str) -> str:
    """This process's directory under the user root, created if needed."""
    return _make_private_dir(os.path.join(user_root(root), ProcessIdentity.current().dirname))


def subdir(root: str, name: str) -> str:
    """``<process dir>/<name>``, created 0700 if needed."""
    return _make_private_dir(os.path.join(process_dir(root), name))


def sweep_dead_processes(root: str) -> list[str]:
    """Remove the directories of processes that are no longer running (a
    worker killed with SIGKILL cannot clean up after itself). Returns the
    directories removed. Files still mapped or linked elsewhere live on until
    their last user goes (Unix semantics)."""
    removed = []
    base = user_root(root)
    for name in os.listdir(base):
        ident = ProcessIdentity.from_dirname(name)
        if ident is None or ident.alive():
            continue
        path = os.path.join(base, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("dask-shm: removed %d directories of dead processes", len(removed))
    return removed
