"""Scheduler preload installing dask-shm's Active Memory Manager.

Use with ``dask scheduler --preload dask_shm.amm.preload`` or the config key
``distributed.scheduler.preload: [dask_shm.amm.preload]``.
"""

from __future__ import annotations

from typing import Any

from dask_shm.amm.install import install_scheduler_extension


def dask_setup(scheduler: Any) -> None:
    """Preload hook: replace the scheduler's stock AMM with ours."""
    install_scheduler_extension(scheduler)
