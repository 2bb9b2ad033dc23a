"""Make a server fail to start, from inside its preload.

distributed awaits a preload's ``dask_setup`` inside ``Server.start`` but only
logs an Exception it raises (``PreloadManager.start``), so the server would
start without what the preload was to install. A BaseException such as
SystemExit does get out, but past ``Server.start``'s clean-up and out of the
event loop: a ``dask worker`` process exits, while a server in a LocalCluster
(whose nanny, and with ``processes=False`` whose workers, share the cluster's
loop thread) takes that loop down, and the cluster hangs or fails with
"IOLoop is closed".

So :func:`refuse_to_start` makes the next step of the server's start that
does propagate errors raise ``error``; ``Server.start`` then closes the
server and raises ``RuntimeError("<Server> failed to start.")`` from it,
which LocalCluster (``from`` chain) and the CLI (traceback) show:

- Scheduler: a scheduler plugin whose ``start`` raises (``Scheduler.start_unsafe``
  starts its plugins after the preloads; public API).
- Worker: a worker plugin whose ``setup`` raises, queued with the plugins
  given as ``Worker(plugins=...)``, which ``Worker.start_unsafe`` sets up after
  the preloads with ``catch_errors=False``.
- Nanny: its ``instantiate`` (the start of the worker process, right after
  the preloads) raises, so that no worker process is spawned.

The last two are internals of distributed (``dask_shm.compat`` checks them);
where one is missing, ``error`` is raised as a SystemExit, which still stops a
server that has a process of its own.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin


class _FailingSchedulerPlugin(SchedulerPlugin):
    """Raises ``error`` when the scheduler starts its plugins."""

    name = "dask-shm-refuse-start"

    def __init__(self, error: Exception):
        self.error = error

    async def start(self, scheduler: Any) -> None:
        raise self.error


class _FailingWorkerPlugin(WorkerPlugin):
    """Raises ``error`` when the worker sets its plugins up."""

    name = "dask-shm-refuse-start"

    def __init__(self, error: Exception):
        self.error = error

    def setup(self, worker: Any) -> None:
        raise self.error


def refuse_to_start(server: Any, error: Exception) -> None:
    """Make ``server`` (a Scheduler, Worker or Nanny whose preloads are
    running) fail to start with ``error`` as the cause (see the module
    docstring). Raises SystemExit(str(error)) where distributed lacks the
    internal this needs."""
    from distributed import Nanny, Scheduler, Worker

    from dask_shm.compat import nanny_instantiate_hook, worker_pending_plugins_hook

    if isinstance(server, Scheduler):
        server.add_plugin(_FailingSchedulerPlugin(error))
    elif isinstance(server, Worker) and worker_pending_plugins_hook():
        server._pending_plugins = (*server._pending_plugins, _FailingWorkerPlugin(error))
    elif isinstance(server, Nanny) and nanny_instantiate_hook():

        async def instantiate() -> Any:
            raise error

        server.instantiate = instantiate  # type: ignore[method-assign]  # this instance only
    else:
        raise SystemExit(str(error)) from error
