"""Turning shared-memory mode on: worker and nanny plugins."""

from __future__ import annotations

import logging
import shutil
import sys
import uuid
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

from dask_shm.config import SharedMemorySettings
from dask_shm.shared import metrics, monitor, paths, transfer
from dask_shm.shared.registry import PeerRegistry
from dask_shm.shared.sender import install_get_data

if TYPE_CHECKING:
    from distributed import Nanny, Worker

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dask-shm-shared-memory"


class SharedMemoryPlugin(WorkerPlugin):
    """Put a worker in shared-memory mode.

    On setup: removes directories left by dead processes on the root; gives
    the worker a shared-mode :class:`~dask_shm.SpillBuffer` (sized from the
    worker's memory limit and config like the stock buffer; a worker whose
    config disables spilling still gets one, that never spills on its own,
    so it can exchange files); answers same-host peers' ``get_data`` with
    hard-link handles and accepts theirs; leaves shared pages out of the
    memory monitor; publishes metrics (``get_metrics()["shm"]``, Prometheus
    ``dask_worker_shm_*``). On teardown (worker closing) it undoes that and
    deletes the worker's files (links held by peers keep their data alive).

    Raises ValueError at setup for an invalid ``shm.shared-memory.*`` value.
    When the root is unusable (not Linux, missing, not tmpfs) it logs a
    warning saying why and installs the private :class:`~dask_shm.SpillBuffer`.

    >>> client.register_plugin(SharedMemoryPlugin())  # doctest: +SKIP
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, root: str | None = None):
        #: None: ``shm.shared-memory.root`` on the worker
        self.root = root

    def setup(self, worker: Worker) -> None:
        from dask_shm.spill import SpillBuffer
        from dask_shm.worker import SpillBufferPlugin, install_spill_buffer, target_from_config

        settings = SharedMemorySettings.from_config()
        root = self.root or settings.root
        if isinstance(worker.data, SpillBuffer) and worker.data.shared:
            return
        try:
            paths.check_root(root)
        except paths.UnusableRoot as e:
            logger.warning("dask-shm: %s; this worker spills privately", e)
            SpillBufferPlugin().setup(worker)
            return
        paths.sweep_dead_processes(root)
        target = target_from_config(worker.memory_manager.memory_limit) or sys.maxsize
        directory = paths.subdir(root, f"w-{uuid.uuid4().hex[:12]}")
        with dask.config.set({"shm.shared-memory.root": root}):
            buffer = SpillBuffer(
                directory, target, max_spill=worker.memory_manager.max_spill, shared=True
            )
        install_spill_buffer(worker, buffer)
        transfer.enable_receiving(root)
        self._directory = directory
        self._shm_root = root
        self._registry = PeerRegistry(root)
        self._original_get_data = install_get_data(worker, buffer, self._registry)
        self._registry.register(worker.address)
        monitor.install_worker_monitor(worker)
        metrics.install(worker)
        logger.info("dask-shm: shared-memory mode on %s (files in %s)", worker.address, directory)

    def teardown(self, worker: Worker) -> None:
        registry = getattr(self, "_registry", None)
        if registry is None:
            return
        registry.unregister(worker.address)
        worker.handlers["get_data"] = self._original_get_data
        monitor.uninstall_worker_monitor(worker)
        metrics.uninstall(worker)
        shutil.rmtree(self._directory, ignore_errors=True)
        paths.release_process_dir(self._shm_root)


class SharedMemoryNannyPlugin(NannyPlugin):
    """Nanny side of shared-memory mode: the nanny's terminate check reads the
    worker's private memory (shared pages excluded), and directories of dead
    worker processes are removed when the nanny starts and closes.

    >>> client.register_plugin(SharedMemoryNannyPlugin())  # doctest: +SKIP
    """

    name = PLUGIN_NAME + "-nanny"
    idempotent = True

    def __init__(self, root: str | None = None):
        self.root = root

    def _root(self) -> str | None:
        root = self.root or SharedMemorySettings.from_config().root
        try:
            paths.check_root(root)
        except paths.UnusableRoot:
            return None
        return root

    def setup(self, nanny: Nanny) -> None:
        monitor.install_nanny_monitor(nanny)
        root = self._root()
        if root is not None:
            paths.sweep_dead_processes(root)

    def teardown(self, nanny: Nanny) -> Any:
        root = self._root()
        if root is not None:
            paths.sweep_dead_processes(root)
