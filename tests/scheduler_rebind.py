"""pytest plugin (``-p scheduler_rebind``): every local dask scheduler is one ``get``.

``DASK_SHM_REBIND`` names it: ``dask_shm`` (:func:`dask_shm.get`) or
``processes`` (``dask.multiprocessing.get``). Before collection, every name
``compute(scheduler=...)`` accepts, the default scheduler and the module
attributes dask's own tests import (``dask.local.get_sync``,
``dask.threaded.get``, ``dask.multiprocessing.get``) are bound to it, so that
dask's tests of its local schedulers run on that one scheduler unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import dask
import dask.base
import dask.local
import dask.multiprocessing
import dask.threaded

VARIABLE = "DASK_SHM_REBIND"


def chosen_get() -> Callable[..., Any]:
    name = os.environ.get(VARIABLE)
    if name == "dask_shm":
        import dask_shm

        return dask_shm.get
    if name == "processes":
        return dask.multiprocessing.get
    raise ValueError(f"{VARIABLE} must be 'dask_shm' or 'processes', not {name!r}")


def pytest_configure(config: Any) -> None:
    get = chosen_get()
    for name in list(dask.base.named_schedulers):
        dask.base.named_schedulers[name] = get
    dask.local.get_sync = get
    dask.threaded.get = get
    dask.multiprocessing.get = get
    dask.config.set(scheduler=get)
