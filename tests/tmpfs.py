"""A real, small tmpfs for tests (as a container's 64 MiB /dev/shm)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest


def shmem_forced_huge() -> bool:
    """The kernel gives every tmpfs huge pages (``shmem_enabled`` is
    ``force``): then no root is without them."""
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        return "[force]" in f.read()


@contextlib.contextmanager
def small_tmpfs(
    size: str = "64m", *, read_only: bool = False, huge: str | None = None
) -> Iterator[str]:
    """A real tmpfs of ``size`` mounted on a fresh directory (root only),
    read-only if asked (as a container's read-only mount), with the ``huge=``
    option given (as a root made for arrays born shared)."""
    path = tempfile.mkdtemp(prefix="dask-shm-tmpfs-")
    try:
        proc = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={size},mode=1777"
                + (",ro" if read_only else "")
                + (f",huge={huge}" if huge else ""),
                "tmpfs",
                path,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", path], check=False)
    finally:
        shutil.rmtree(path, ignore_errors=True)
