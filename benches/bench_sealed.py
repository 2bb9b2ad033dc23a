"""Issue 12 item 5: what would sealed files cost against hard links on tmpfs?

One value of ``SIZE`` bytes goes from a writer to a reader on the same host,
the way shared-memory mode hands a value over; each round writes it, hands it
over, maps it in the reader and reads every page:

- ``stock``: no shared memory, two copies (serialize into a message, read it
  into the receiver's buffer): the reference the ratios are against;
- ``ours``: today's design: a 0600 file on /dev/shm, a hard link for the
  reader, a private mapping of it;
- ``ours-memfd``: a ``memfd`` sealed with F_SEAL_SHRINK|GROW|WRITE after
  writing, handed over with ``pidfd_getfd`` (the reader duplicates the
  writer's descriptor) and mapped privately. Sealed, no one can truncate or
  overwrite it, so a mapped value can neither SIGBUS nor change.

Run: ``pytest benches/bench_sealed.py``. The data path is the same (tmpfs pages
either way); the handover differs by a few system calls. What decides between
them is not measured here (see docs/shared-memory.md, "Tampering with shared files").
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import tempfile

import numpy as np
import pytest

SIZE = 64 * 2**20
_SYS_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    new = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if new < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(new)


def _read_mapped(fd: int) -> float:
    with mmap.mmap(fd, SIZE, flags=mmap.MAP_PRIVATE) as m:
        return float(np.frombuffer(m, dtype=np.float64).sum())


def _stock(payload: np.ndarray, _dir: str) -> float:
    message = payload.tobytes()  # serialize: one copy
    received = bytearray(message)  # read into the receiver: another
    return float(np.frombuffer(received, dtype=np.float64).sum())


def _hard_link(payload: np.ndarray, directory: str) -> float:
    path = os.path.join(directory, "value")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, memoryview(payload).cast("B"))
    finally:
        os.close(fd)
    linked = os.path.join(directory, "linked")
    os.link(path, linked)
    os.unlink(path)
    fd = os.open(linked, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return _read_mapped(fd)
    finally:
        os.close(fd)
        os.unlink(linked)


def _sealed_memfd(payload: np.ndarray, _dir: str) -> float:
    fd = os.memfd_create("value", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    pidfd = os.pidfd_open(os.getpid())
    try:
        os.write(fd, memoryview(payload).cast("B"))
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        theirs = _pidfd_getfd(pidfd, fd)
        try:
            return _read_mapped(theirs)
        finally:
            os.close(theirs)
    finally:
        os.close(pidfd)
        os.close(fd)


IMPLS = {"stock": _stock, "ours": _hard_link, "ours-memfd": _sealed_memfd}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_handover(benchmark, impl: str) -> None:
    payload = np.random.default_rng(0).random(SIZE // 8)
    expected = float(payload.sum())
    run = IMPLS[impl]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        got = benchmark.pedantic(run, args=(payload, directory), rounds=15, warmup_rounds=2)
    assert got == pytest.approx(expected)
    benchmark.extra_info["bytes"] = SIZE


def test_sealed_memfd_refuses_truncate_and_write() -> None:
    """The guarantee sealing would buy: neither truncation nor writes."""
    fd = os.memfd_create("value", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, b"x" * 4096)
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        )
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # as another process could
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(again, 0)
            with pytest.raises(PermissionError):
                os.pwrite(again, b"y", 0)
        finally:
            os.close(again)
    finally:
        os.close(fd)
