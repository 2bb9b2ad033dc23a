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

from dataclasses import dataclass

from dask.typing import Key

from dask_shm import _core
from dask_shm._core import SpillFileError
from dask_shm.shared import paths


@dataclass(frozen=True)
class Fingerprint:
    size: int
    mtime_ns: int
    inode: int


# Both run in Rust in one call each, keeping the GIL for a file on a tmpfs:
# they run on every hand-over, often in the worker's event loop, and four
# system calls through ``os`` would release and retake the GIL four times,
# each a wait of up to the switch interval while a task runs Python.


def seal(path: str) -> Fingerprint:
    """Make the file at ``path`` read-only and return its fingerprint, with
    one path lookup (never through a symlink, never blocking on open).
    Raises OSError (ELOOP for a symlink, which is left as it is)."""
    return Fingerprint(*_core.seal_file(path, paths.in_ram(path)))


def fingerprint(path: str) -> Fingerprint:
    return Fingerprint(*_core.file_fingerprint(path, paths.in_ram(path)))


def verify(key: Key, path: str, expected: Fingerprint | None) -> None:
    """Raise SpillFileError naming ``key`` if the file at ``path`` is no
    longer the one recorded in ``expected`` (truncated, overwritten, replaced).
    Nothing is checked when ``expected`` is None (a file we never recorded).
    A missing file is left to the reader (FileNotFoundError there)."""
    if expected is None:
        return
    try:
        now = fingerprint(path)
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
