"""Fixtures shared by several test modules."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory on /dev/shm (a real tmpfs), removed afterwards."""
    path = tempfile.mkdtemp(prefix="dask-shm-test-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
