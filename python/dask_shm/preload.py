"""One preload for everything dask-shm installs.

``dask scheduler --preload dask_shm`` / ``dask worker --preload dask_shm``, or
config alone: ``distributed.scheduler.preload: [dask_shm]`` and
``distributed.worker.preload: [dask_shm]``. What gets installed follows the
``shm.*`` switches (see ``dask-shm.yaml``):

- scheduler: dask-shm's Active Memory Manager (``shm.amm``) and span extension
  (``shm.spans``);
- worker: :class:`dask_shm.SpillBuffer` sized from the worker's own memory limit
  (``shm.spill-buffer``) and the worker span extension (``shm.spans``).
"""

from __future__ import annotations

from typing import Any

from dask_shm.config import enabled


def dask_setup(server: Any) -> None:
    """Preload entry point.

    Raises ValueError for an invalid ``shm.*`` value and TypeError for a server
    that is neither a Scheduler nor a Worker (preload the worker, not the nanny).
    """
    from distributed import Scheduler, Worker

    if isinstance(server, Scheduler):
        switches = {name: enabled(name) for name in ("amm", "spans")}
        if switches["amm"]:
            from dask_shm.amm import install_scheduler_extension as install_amm

            install_amm(server)
        if switches["spans"]:
            from dask_shm.spans import install_scheduler_extension as install_spans

            install_spans(server)
    elif isinstance(server, Worker):
        switches = {name: enabled(name) for name in ("spill-buffer", "spans")}
        if switches["spill-buffer"]:
            from dask_shm.worker import SpillBufferPlugin

            SpillBufferPlugin().setup(server)
        if switches["spans"]:
            from dask_shm.spans import install_worker_extension

            install_worker_extension(server)
    else:
        raise TypeError(
            f"dask_shm preload runs on a Scheduler or a Worker, not {type(server).__name__}; "
            "use --preload (not --preload-nanny)"
        )
