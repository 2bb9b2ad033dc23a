"""Memory monitors that count what a shared-memory worker really holds.

A worker that maps shared files touches tmpfs pages; Linux counts them in the
process RSS (as ``RssShmem``) of every process that maps them, so counting
RSS double counts them, and leaving them out hides RAM from every limit
(the memory cgroup charges tmpfs pages like any other). Here a worker's
memory is its private memory (``rss - shmem``,
:attr:`dask_shm.procmem.ProcessMemory.private`) plus its 1/k share of the
tmpfs files it holds, mapped or not (a file with k hard links counts 1/k on
each holder): summed over a host's workers that is the host's real use, so
the spill, pause and terminate thresholds behave as in stock.

- on the worker, ``worker.monitor.get_process_memory`` (the hook distributed
  keeps for exactly this purpose) is replaced: spilling, pausing and the
  process/unmanaged memory the worker reports all follow;
- on the nanny, the periodic ``memory_monitor`` that restarts a worker above
  ``distributed.worker.memory.terminate`` is replaced by one reading the
  same figure from outside (:func:`tmpfs_share` of the worker's process
  directory under the root).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from dask_shm.procmem import process_memory

if TYPE_CHECKING:
    from distributed import Nanny, Worker

    from dask_shm.shared.buffer import SharedSpillBuffer

logger = logging.getLogger("distributed.nanny")


def private_process_memory() -> int:
    """This process's resident memory minus its shared-memory pages."""
    return process_memory().private


def tmpfs_share(root: str, pid: int) -> int:
    """Bytes of tmpfs files under the directories of process ``pid`` in
    ``root``'s per-user directory, each file counted ``size / links``; 0 if
    there are none."""
    base = os.path.join(root, f"dask-shm-{os.geteuid()}")
    total = 0
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(f"p-{pid}-")]
    except OSError:
        return 0
    stack = [e.path for e in entries]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        total += st.st_size // max(st.st_nlink, 1)
                except OSError:
                    continue
    return total


def install_worker_monitor(worker: Worker, buffer: SharedSpillBuffer) -> None:
    """Worker memory = private memory + ``buffer``'s tier-2 share."""

    def worker_memory() -> int:
        return private_process_memory() + buffer.tier2_bytes()

    worker.monitor.get_process_memory = worker_memory  # type: ignore[method-assign]


def uninstall_worker_monitor(worker: Worker) -> None:
    worker.monitor.__dict__.pop("get_process_memory", None)


class _PrivateMemoryTerminator:
    """The nanny's terminate check, on private memory plus the worker's share of
    its tmpfs files (stock's logic otherwise:
    SIGTERM first, SIGKILL if the same process is still over the limit)."""

    def __init__(self, nanny: Nanny, root: str | None):
        self.nanny = nanny
        self.root = root
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
        if self.root is not None:
            memory += tmpfs_share(self.root, process.pid)
        if memory / limit <= fraction:
            return
        if self.last_terminated_pid != process.pid:
            logger.warning(
                "Worker %s (pid=%d) exceeded %.0f%% memory budget (private memory "
                "plus its share of shared-memory files). Restarting...",
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


def install_nanny_monitor(nanny: Nanny, root: str | None) -> bool:
    """Replace the nanny's terminate check (counting the worker's share of
    files under ``root`` too, unless None); False if the nanny has none (no
    memory limit, or terminate disabled)."""
    stock = nanny.periodic_callbacks.get("memory_monitor")
    if stock is None:
        return False
    was_running = stock.is_running()
    stock.stop()
    ours = PeriodicCallback(_PrivateMemoryTerminator(nanny, root), stock.callback_time)
    nanny.periodic_callbacks["memory_monitor"] = ours
    if was_running:
        ours.start()
    return True
