"""Guarding shared-memory files against truncation and overwriting.

A value in memory that lives in a private mapping of a spill file still reads
the file's pages it has not written to: truncating the file makes the next
access to a page beyond the new end raise SIGBUS (the worker dies), and
overwriting it changes the value. Two defences (see docs/shared-memory.md, "Tampering with
shared files", for the measured alternative of sealed memfds and why it was
not chosen):

- every shared file is made read-only (0400) as soon as it is written, so a
  process of the same user that is not root cannot open it for writing or
  truncate it (``open``/``truncate`` fail with EACCES). Links, mappings and
  unlinking need no write permission on the file;
- each file's fingerprint (size, modification time, inode) is recorded when it
  is written or adopted and checked before it is read back, handed to a peer
  or reused as the spilled copy of an evicted value:
  :func:`verify` raises :class:`~dask_shm.SpillFileError` naming the key.

Residual risk: root (or a process that chmods the file first) can still
truncate a file behind a mapped value (SIGBUS on next access) or overwrite
it; such a change is detected only at the next check, and a write within the
file system's timestamp granularity of our own write may go unseen by it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dask.typing import Key

from dask_shm._core import SpillFileError

READ_ONLY = 0o400


@dataclass(frozen=True)
class Fingerprint:
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> Fingerprint:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


#: How :func:`seal` opens a file: never through a symlink, never blocking.
_SEAL_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def seal(path: str) -> Fingerprint:
    """Make the file at ``path`` read-only and return its fingerprint.
    Raises OSError (ELOOP for a symlink, which is left as it is)."""
    # One path lookup: os.chmod(follow_symlinks=False) costs four system calls
    # here (glibc emulates it through /proc/self/fd), and lstat one more.
    fd = os.open(path, _SEAL_FLAGS)
    try:
        st = os.fstat(fd)
        os.fchmod(fd, READ_ONLY)
    finally:
        os.close(fd)
    return Fingerprint.of(st)


def fingerprint(path: str) -> Fingerprint:
    return Fingerprint.of(os.lstat(path))


def verify(key: Key, path: str, expected: Fingerprint | None) -> None:
    """Raise SpillFileError naming ``key`` if the file at ``path`` is no
    longer the one recorded in ``expected`` (truncated, overwritten, replaced).
    Nothing is checked when ``expected`` is None (a file we never recorded).
    A missing file is left to the reader (FileNotFoundError there)."""
    if expected is None:
        return
    try:
        now = Fingerprint.of(os.lstat(path))
    except FileNotFoundError:
        return
    if now == expected:
        return
    if now.inode != expected.inode:
        what = "replaced by another file"
    elif now.size != expected.size:
        what = f"truncated or extended from {expected.size} to {now.size} bytes"
    else:
        what = "overwritten"
    raise SpillFileError(
        f"the shared-memory file of key {key!r} ({path}) was {what} behind dask-shm's "
        "back; its value can no longer be trusted (delete the key and recompute it)"
    )
