"""Memory monitors that do not count shared pages as a worker's own memory.

A worker that maps shared files touches tmpfs pages; Linux counts them in the
process RSS (as ``RssShmem``) although they belong to the host's shared files,
are counted once host-wide and already appear as "spilled". Stock distributed
compares RSS with the memory limit, so a worker would spill, pause and be
restarted for memory it does not own. Here process memory is ``rss - shmem``
(:attr:`dask_shm.procmem.ProcessMemory.private`):

- on the worker, ``worker.monitor.get_process_memory`` (the hook distributed
  keeps for exactly this purpose) is replaced: spilling, pausing and the
  process/unmanaged memory the worker reports all follow;
- on the nanny, the periodic ``memory_monitor`` that restarts a worker above
  ``distributed.worker.memory.terminate`` is replaced by one reading private memory.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from dask_shm.procmem import process_memory

if TYPE_CHECKING:
    from distributed import Nanny, Worker

logger = logging.getLogger("distributed.nanny")


def private_process_memory() -> int:
    """This process's resident memory minus its shared-memory pages."""
    return process_memory().private


def install_worker_monitor(worker: Worker) -> None:
    worker.monitor.get_process_memory = private_process_memory  # type: ignore[method-assign]


def uninstall_worker_monitor(worker: Worker) -> None:
    worker.monitor.__dict__.pop("get_process_memory", None)


class _PrivateMemoryTerminator:
    """The nanny's terminate check, on private memory (stock's logic otherwise:
    SIGTERM first, SIGKILL if the same process is still over the limit)."""

    def __init__(self, nanny: Nanny):
        self.nanny = nanny
        self.last_terminated_pid = -1

    def __call__(self) -> None:
        nanny = self.nanny
        manager = nanny.memory_manager
        process = nanny.process.process if nanny.process is not None else None
        if nanny.status != Status.running or process is None or process.pid is None:
            return
        limit, fraction = manager.memory_limit, manager.memory_terminate_fraction
        if not limit or fraction is False:
            return
        try:
            memory = process_memory(process.pid).private
        except ProcessLookupError:
            return
        if memory / limit <= fraction:
            return
        if self.last_terminated_pid != process.pid:
            logger.warning(
                "Worker %s (pid=%d) exceeded %.0f%% memory budget (private memory, "
                "shared pages excluded). Restarting...",
                nanny.worker_address,
                process.pid,
                fraction * 100,
            )
            self.last_terminated_pid = process.pid
            nanny.log_event(
                "worker-restart-memory",
                {"worker": nanny.worker_address, "pid": process.pid, "rss": memory},
            )
            process.terminate()
        else:
            logger.warning(
                "Worker %s (pid=%d) is slow to terminate; killing it",
                nanny.worker_address,
                process.pid,
            )
            process.kill()


def install_nanny_monitor(nanny: Nanny) -> bool:
    """Replace the nanny's terminate check; False if the nanny has none
    (no memory limit, or terminate disabled)."""
    stock = nanny.periodic_callbacks.get("memory_monitor")
    if stock is None:
        return False
    was_running = stock.is_running()
    stock.stop()
    ours = PeriodicCallback(_PrivateMemoryTerminator(nanny), stock.callback_time)
    nanny.periodic_callbacks["memory_monitor"] = ours
    if was_running:
        ours.start()
    return True
