"""Routes that put the spans extensions into running servers.

- ``client.register_plugin(SpansSchedulerPlugin())`` and
  ``client.register_plugin(SpansWorkerPlugin())`` (workers started later get it too);
- ``--preload dask_shm.spans`` (or ``dask_shm.spans.plugins``) on ``dask scheduler`` /
  ``dask worker`` (or the ``distributed.scheduler.preload`` /
  ``distributed.worker.preload`` config): calls :func:`dask_setup`, which
  ``dask_shm.spans`` re-exports so that distributed's preload finds it there;
- or pass the classes at construction: ``Scheduler(extensions={**DEFAULT_EXTENSIONS,
  "spans": SpansSchedulerExtension})``, likewise for workers.

All of them end in :func:`~dask_shm.spans.install_scheduler_extension` /
:func:`~dask_shm.spans.install_worker_extension`, which are idempotent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from dask_shm.spans.scheduler import install_scheduler_extension
from dask_shm.spans.worker import install_worker_extension

if TYPE_CHECKING:
    from distributed import Scheduler, Worker
    from distributed.core import Server


class SpansSchedulerPlugin(SchedulerPlugin):
    """Scheduler plugin installing :class:`dask_shm.spans.SpansSchedulerExtension`."""

    name = "dask-shm-spans-install"
    idempotent = True

    async def start(self, scheduler: Scheduler) -> None:
        install_scheduler_extension(scheduler)


class SpansWorkerPlugin(WorkerPlugin):
    """Worker plugin installing :class:`dask_shm.spans.SpansWorkerExtension`."""

    name = "dask-shm-spans-install"
    idempotent = True

    def setup(self, worker: Worker) -> None:
        install_worker_extension(worker)


def dask_setup(server: Server) -> None:
    """Preload entry point: install the extension matching ``server`` in place
    of its stock one. A server built without a ``"spans"`` extension (e.g.
    ``extensions={}``) is left without one, as it would be without the preload.

    Raises
    ------
    TypeError
        ``server`` is neither a Scheduler nor a Worker (e.g. a Nanny: preload the
        worker instead, with ``--preload`` rather than ``--preload-nanny``).
    """
    from distributed import Scheduler, Worker

    if isinstance(server, Scheduler):
        if "spans" in server.extensions:
            install_scheduler_extension(server)
    elif isinstance(server, Worker):
        if "spans" in server.extensions:
            install_worker_extension(server)
    else:
        raise TypeError(
            f"dask_shm.spans.plugins preloads into a Scheduler or a Worker, not {server!r}"
        )
