"""Fixtures shared by several test modules."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask
import pytest

from dask_shm.local import release_idle_files


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory on /dev/shm (a real tmpfs), removed afterwards."""
    path = tempfile.mkdtemp(prefix="dask-shm-test-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shared_buffer_256mib(shm_dir: str, tmp_path: Path) -> Iterator[Any]:
    """A SharedSpillBuffer with a 256 MiB target on a fresh root (tier 3 in
    ``tmp_path``), closed afterwards; receiving is switched off again."""
    from dask_shm.shared import SharedSpillBuffer, transfer

    settings = {"shm.shared-memory.root": shm_dir, "shm.shared-memory.disk-root": str(tmp_path)}
    with dask.config.set(settings):
        buf = SharedSpillBuffer.from_config(256 * 2**20)
        yield buf
        buf.close()
    transfer.enable_receiving(None)


@pytest.fixture
def shm_base() -> Iterator[Path]:
    """A fresh directory on /dev/shm as ``shm.local.shm-directory`` (the local
    scheduler's); the test fails if anything is left in it once the warm pool
    has let go of the files it keeps for the next computation."""
    base = Path("/dev/shm") / f"dask-shm-test-{uuid.uuid4().hex[:12]}"
    base.mkdir(mode=0o700)
    try:
        with dask.config.set({"shm.local.shm-directory": str(base)}):
            yield base
        release_idle_files()
        leftovers = sorted(str(p.relative_to(base)) for p in base.rglob("*"))
        assert leftovers == [], f"files left behind: {leftovers}"
    finally:
        for p in sorted(base.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        base.rmdir()


@pytest.fixture
def shared_spill_buffer(shm_dir: str, tmp_path: Any) -> Iterator[Callable[..., Any]]:
    """Factory of shared-memory buffers on a private root on /dev/shm, small
    values included (min-size 0) and a tier-2 budget that never pushes files
    to disk, through the public constructor. Skips if the host cannot run
    shared mode."""
    from dask_shm.shared import SharedSpillBuffer
    from dask_shm.shared.paths import UnusableRoot

    made: list[Any] = []

    def make(target: int, max_spill: int | bool = False) -> Any:
        try:
            buf = SharedSpillBuffer.create(
                target,
                root=shm_dir,
                disk_root=str(tmp_path / "tier3"),
                budget=2**40,
                min_size=0,
                min_shared_fraction=0.5,
                max_spill=max_spill,
            )
        except UnusableRoot as e:
            pytest.skip(f"shared-memory mode unavailable on this host: {e}")
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()
