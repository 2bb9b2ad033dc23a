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

What dead processes left is removed by :func:`reclaim` (a worker or nanny
starting on the roots, ``dask shm clean``) and counted by :func:`reclaimable`
(``dask shm info``); only this user's directory is looked at.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import logging
import os
import shutil
import stat
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import psutil

from dask_shm import liveness
from dask_shm._core import is_ram_backed

logger = logging.getLogger(__name__)


class Mount(NamedTuple):
    """A mounted file system, as ``psutil.disk_partitions`` lists it."""

    point: str
    fstype: str
    options: tuple[str, ...]


def mount_of(path: str) -> Mount | None:
    """The mount holding ``path`` (resolved with ``os.path.realpath``): the
    longest mount point that is a prefix of it; of equal ones the last (the
    mount on top). None if the mount table cannot be read or nothing matches.
    The table is ``psutil.disk_partitions(all=True)`` (``/proc/self/mounts``,
    escapes such as ``\\040`` undone)."""
    target = os.path.realpath(path)
    try:
        partitions = psutil.disk_partitions(all=True)
    except OSError:
        return None
    best: Mount | None = None
    for part in partitions:
        point = part.mountpoint
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, part.fstype, tuple(part.opts.split(",")))
    return best


def filesystem_of(path: str) -> tuple[str, str] | None:
    """``(mount point, filesystem type)`` of :func:`mount_of` ``path``, or None."""
    mount = mount_of(path)
    return None if mount is None else (mount.point, mount.fstype)


def in_ram(path: str) -> bool:
    """Whether the file at ``path`` lies in a RAM-backed directory (tmpfs,
    ramfs, hugetlbfs). Each directory is examined once per process: the
    answer decides whether a short call on the file keeps the GIL (see
    :func:`dask_shm._core.file_fingerprint`), on every hand-over."""
    return _directory_in_ram(os.path.dirname(path))


@functools.lru_cache(maxsize=4096)
def _directory_in_ram(directory: str) -> bool:
    return is_ram_backed(directory)


def filesystem_type(path: str) -> str | None:
    """Type of the file system holding ``path`` (from the mount table), or None
    when it cannot be told (no /proc, path missing)."""
    mount = mount_of(path)
    return None if mount is None else mount.fstype


class UnusableRoot(Exception):
    """The shared-memory root cannot be used; the message says why and how to fix it."""


#: What to do about a root that is not on a tmpfs (worker warning and
#: ``dask shm info``). Not "mount a tmpfs there": the directory may be /tmp,
#: where tier 3 (disk) lives by default.
NOT_TMPFS_ADVICE = "set shm.shared-memory.root to a tmpfs such as /dev/shm"
#: What to do about a root on a read-only file system (EROFS).
READ_ONLY_ADVICE = (
    "remount it read-write (`mount -o remount,rw <mount point>` as root; in a "
    "container, do not mount it read-only) or set shm.shared-memory.root to a "
    "writable tmpfs such as /dev/shm"
)
#: What to do about a root this user may not create files in (EACCES).
NOT_WRITABLE_ADVICE = (
    "make it writable for this user (`chmod 1777 <root>` as root, like /dev/shm) "
    "or set shm.shared-memory.root to a writable tmpfs such as /dev/shm"
)


def is_read_only(path: str) -> bool:
    """Whether ``path``'s file system is mounted read-only (statvfs ST_RDONLY)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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
            + NOT_TMPFS_ADVICE
        )
    if not os.access(root, os.W_OK | os.X_OK):
        if is_read_only(root):
            raise UnusableRoot(
                f"shared-memory root {root} is on a read-only file system; {READ_ONLY_ADVICE}"
            )
        raise UnusableRoot(
            f"shared-memory root {root} is not writable by this user; {NOT_WRITABLE_ADVICE}"
        )
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


def _makedirs_private(path: str) -> None:
    """``os.makedirs`` with every directory it creates mode 0700, the missing
    parents too (``os.makedirs`` gives those the umask's mode)."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _makedirs_private(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _make_private_dir(path: str) -> str:
    _makedirs_private(path)
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

_DIR_FLAGS = liveness.DIRECTORY_FLAGS


@dataclass
class _Held:
    path: str
    fd: int
    pid: int


#: user root -> this process's directory there and the descriptor locking it
_held: dict[str, _Held] = {}
_held_lock = threading.RLock()


def _create_locked_dir(base: str) -> _Held:
    """A new process directory in ``base``, locked before anyone can see it
    under its final name (:func:`dask_shm.liveness.publish_locked`)."""
    name = f"{ProcessIdentity.current().dirname}-{uuid.uuid4().hex[:8]}"
    path = os.path.join(base, name)
    fd = liveness.publish_locked(os.path.join(base, f".new-{name}"), path, directory=True)
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
    if not liveness.still_named(held.path, held.fd):
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
_SCAFFOLDING = ("outgoing", "p2p")


def release_process_dir(root: str) -> bool:
    """Remove this process's directory under ``root`` if nothing is left in it
    but empty ``outgoing`` and ``p2p`` directories, and drop its lock.
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


def _lock_of_dead_dir(base: str, name: str) -> int | None:
    """A descriptor of the process directory ``base/name`` holding its lock,
    if its process is gone; None if it is alive, still being set up
    (``.new-``, within :data:`NEW_DIR_GRACE_SECONDS`) or vanished. Closing the
    descriptor drops the lock."""
    path = os.path.join(base, name)
    fd = liveness.lock_if_dead(path)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        fresh = name.startswith(".new-") and time.time() - st.st_mtime < NEW_DIR_GRACE_SECONDS
        if not fresh and liveness.still_named(path, fd):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _freed_bytes(directories: list[str]) -> int:
    """Bytes the file system gets back when ``directories`` are removed: the
    allocated blocks of every file all of whose links are inside them (a file
    a live peer has linked elsewhere stays; one a live process still maps
    goes when it unmaps it)."""
    # (device, inode) -> [links, links seen here, allocated bytes]
    files: dict[tuple[int, int], list[int]] = {}
    for directory in directories:
        for dirpath, _, filenames in os.walk(directory):
            for filename in filenames:
                try:
                    st = os.lstat(os.path.join(dirpath, filename))
                except OSError:
                    continue
                entry = files.setdefault(
                    (st.st_dev, st.st_ino), [st.st_nlink, 0, st.st_blocks * 512]
                )
                entry[1] += 1
    return sum(size for links, seen, size in files.values() if seen >= links)


@dataclass(frozen=True)
class Reclaim:
    """Directories of dead processes under one root, and the bytes removing
    them gives back (see :func:`_freed_bytes`)."""

    directories: list[str]
    bytes: int


@contextmanager
def _sweeping(base: str) -> Iterator[None]:
    """Hold the sweep lock of the user directory ``base`` (an exclusive flock
    on the directory itself; waits for another process's sweep to end). A
    process sizing its budget from the free space after its own sweep then
    sees what a concurrent sweep removed: removing is done when it returns.
    Nothing if ``base`` does not exist."""
    try:
        fd = os.open(base, _DIR_FLAGS)
    except FileNotFoundError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _dead_dirs(base: str) -> Iterator[tuple[str, int]]:
    """``(path, descriptor holding its lock)`` of each dead process directory
    in the user directory ``base``, never this process's own (see
    :func:`_lock_of_dead_dir`); the caller closes the descriptors."""
    own = _current(base)
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(("p-", ".new-p-")):
            continue
        path = os.path.join(base, name)
        if own is not None and path == own.path:
            continue
        fd = _lock_of_dead_dir(base, name)
        if fd is not None:
            yield path, fd


def _reclaim(base: str, *, remove: bool) -> Reclaim:
    """Find (and with ``remove``, remove) the directories of dead processes in
    the user directory ``base``, never this process's own. One process sweeps
    a user directory at a time (:func:`_sweeping`), and the dead directories'
    locks are held from the check to the end, so nothing is counted or
    removed twice."""
    held: list[tuple[str, int]] = []
    with _held_lock, _sweeping(base):
        try:
            for dead in _dead_dirs(base):
                held.append(dead)
            directories = [path for path, _ in held]
            freed = _freed_bytes(directories)
            if remove:
                for path in directories:
                    shutil.rmtree(path, ignore_errors=True)
        finally:
            for _, fd in held:
                os.close(fd)
    return Reclaim(directories, freed)


def _usable_user_dir_path(root: str) -> str:
    """:func:`user_dir_path`, after checking that it is not another user's,
    a symbolic link or a file (raises :class:`UnusableRoot`)."""
    base = user_dir_path(root)
    problem = user_dir_problem(base)
    if problem:
        raise UnusableRoot(f"{base} {problem}")
    return base


def reclaimable(root: str) -> Reclaim:
    """The directories of dead processes under ``root`` (this user's) and the
    bytes removing them would give back; nothing is changed or created.
    Raises :class:`UnusableRoot` if this user's directory there is not a
    directory of this user's."""
    base = _usable_user_dir_path(root)
    return _reclaim(base, remove=False)


def nothing_to_reclaim(root: str, *, peers: bool = True) -> bool:
    """Whether :func:`reclaim` of ``root`` would neither remove anything nor
    wait: no other sweep of this user's directory is under way (in this
    process or another), no process directory there is dead, and
    (``peers``) no registry entry is dead or a stale half-written one.
    O(directories and registry entries) non-blocking lock probes; never
    waits, changes nothing. False whenever it cannot tell (an unusable root,
    an error, a sweep of another root in another thread of this process):
    the caller then sweeps as usual, which logs why."""
    try:
        base = _usable_user_dir_path(root)
        try:
            fd = os.open(base, _DIR_FLAGS)
        except FileNotFoundError:
            return True
        try:
            # A sweep holds this lock while it removes: not ours to skip then.
            if not liveness.try_lock(fd):
                return False
            # _dead_dirs reads this process's own directories, which a sweep
            # in another thread (of another root) may be changing: the probe
            # does not wait for it, so it cannot tell then.
            if not _held_lock.acquire(blocking=False):
                return False
            try:
                for _, dead in _dead_dirs(base):
                    os.close(dead)
                    return False
            finally:
                _held_lock.release()
        finally:
            os.close(fd)
        directory = os.path.join(base, "peers")
        if peers and os.path.isdir(directory):
            return next(_gone_entries(directory, remove=False), None) is None
        return True
    except (UnusableRoot, OSError):
        return False


def reclaim(root: str, *, peers: bool = True) -> Reclaim:
    """Remove the directories of processes that are gone (a process killed
    with SIGKILL cannot clean up after itself), and (``peers``) the
    peer-registry entries of workers that are gone. The same rule holds for
    the tier-3 root on disk (reclaimed with ``peers=False``: it has no registry).
    A directory is gone when nobody holds its flock: the kernel drops the
    lock when its process dies, in whatever PID namespace or container; a
    live process's directory is never touched. Returns what was removed and
    the bytes that gave back. Files still mapped or linked elsewhere live on
    until their last user goes (Unix semantics). Creates nothing. Raises
    :class:`UnusableRoot` if this user's directory under ``root`` is not a
    directory of this user's, OSError if it cannot be read."""
    base = _usable_user_dir_path(root)
    done = _reclaim(base, remove=True)
    if done.directories:
        logger.info(
            "dask-shm: removed %d directories of dead processes under %s (%d MiB)",
            len(done.directories),
            root,
            done.bytes >> 20,
        )
    if peers and os.path.isdir(os.path.join(base, "peers")):
        sweep_peers(root)
    return done


# -- the peer registry's directory (its entries: dask_shm.shared.registry) ---

#: A half-written registry entry (``*.tmp``) older than this is removed by sweeps.
TMP_GRACE_SECONDS = 60.0

#: How registry entries are opened (never following a link, never blocking).
ENTRY_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def peers_directory(root: str) -> str:
    """``<root>/dask-shm-<uid>/peers``, created 0700 if needed."""
    path = os.path.join(user_root(root), "peers")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def sweep_peers(root: str) -> list[str]:
    """Remove registry entries whose worker is gone (nobody holds their
    lock), and half-written ones older than :data:`TMP_GRACE_SECONDS`;
    returns their file names."""
    return list(_gone_entries(peers_directory(root), remove=True))


def _gone_entries(directory: str, *, remove: bool) -> Iterator[str]:
    """Names of the registry entries in ``directory`` whose worker is gone
    (nobody holds their lock) and of half-written ones older than
    :data:`TMP_GRACE_SECONDS` that nobody holds; with ``remove`` each is
    unlinked as it is found."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith(".tmp"):
            try:
                old = time.time() - os.lstat(path).st_mtime > TMP_GRACE_SECONDS
            except OSError:
                continue
            if not old:
                continue
        if not liveness.owner_alive(path, ENTRY_FLAGS, remove_if_dead=remove):
            yield name


def sweep_dead_processes(root: str, *, peers: bool = True) -> list[str]:
    """:func:`reclaim`, returning the directories removed."""
    return reclaim(root, peers=peers).directories
