"""A worker preload (by path, before ``dask_shm``) for test_shared_shuffle:
the first worker process to load it cannot make its P2P batch directory, as
on a root out of inodes, so that worker takes no shard files while its peer
does. Which process is first is decided by creating the file named by the
config key ``tests.p2p-refusing-flag``."""

from __future__ import annotations

import errno
import os
from typing import Any

import dask


def dask_setup(worker: Any) -> None:
    try:
        os.close(os.open(dask.config.get("tests.p2p-refusing-flag"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    from dask_shm.shared import p2p

    def cannot_make_directory(*args: Any, **kwargs: Any) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")

    p2p.enable = cannot_make_directory
