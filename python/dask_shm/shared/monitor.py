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

Only the shared pages of dask-shm's own mappings leave ``rss`` that way
(:func:`own_shared_pages`): shared memory a task maps itself (a
multiprocessing heap, a torch shared tensor, a joblib memmap in
``/dev/shm``) counts as in stock, and so does a spill file whose key is gone
while a view of its mapping lives on (it stays in RAM, and no share counts
it any more): the whole file then counts, as the whole array a view keeps
alive counts in stock.

- on the worker, ``worker.monitor.get_process_memory`` (the hook distributed
  keeps for exactly this purpose) is replaced: spilling, pausing and the
  process/unmanaged memory the worker reports all follow; the buffer also
  compares it with the spill threshold after each unspill through a mapping,
  since such reads can outpace the monitor's 100 ms looks;
- on the nanny, the periodic ``memory_monitor`` that restarts a worker above
  ``distributed.worker.memory.terminate`` is replaced by one reading the
  same figure from outside: the worker's private memory, plus the share its
  buffers publish (:mod:`dask_shm.shared.published_share`; one small file
  per buffer, so the nanny's event loop never lists or stats the files).

Both are O(1) in the number of files: the share is a counter kept by the
Rust ledger (:meth:`dask_shm._core.FileStore.total`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from dask.utils import format_bytes
from distributed.core import Status
from tornado.ioloop import PeriodicCallback

from dask_shm import _core
from dask_shm.procmem import ProcessMemory, process_memory
from dask_shm.shared.born import own_bytes as born_own_bytes
from dask_shm.shared.published_share import (
    NativeSharePublisher,
    SharePublisher,
    read_published,
    share_path,
)

if TYPE_CHECKING:
    from distributed import Nanny, Worker

    from dask_shm.shared.buffer import SharedSpillBuffer

logger = logging.getLogger("distributed.nanny")


class SharedPages(NamedTuple):
    """This process's own mappings of shared-memory files, as a memory
    monitor splits them (bytes, whole pages)."""

    #: mapped by dask-shm (spill-file mappings, blocks of arrays born
    #: shared): at most this much of ``RssShmem`` is pages that count
    #: elsewhere (a share, the arena's own bytes), not as this process's
    mapped: int
    #: files that only these mappings keep in RAM (no store entry of this
    #: process holds them any more), once each: counted as this process's own
    kept: int
    #: the born arena's own blocks (:func:`dask_shm.shared.born.own_bytes`),
    #: part of ``mapped``: a worker's monitor adds them back through
    #: :mod:`~dask_shm.shared.born_worker`
    arena: int


def own_shared_pages() -> SharedPages:
    """:class:`SharedPages` of this process now; O(1)."""
    mapped, kept = _core.mapping_memory()  # born blocks given to a store included
    arena = born_own_bytes()  # the rest of the arena's blocks
    return SharedPages(mapped + arena, kept, arena)


def held_memory(memory: ProcessMemory, pages: SharedPages) -> int:
    """What a process holds beside its share of tmpfs files: its private
    memory, the shared pages that are not dask-shm's (``shmem`` beyond
    ``pages.mapped``) and the files only its mappings keep."""
    return memory.private + max(0, memory.shmem - pages.mapped) + pages.kept


def process_memory_held() -> int:
    """:func:`held_memory` of this process."""
    pages = own_shared_pages()  # first: a mapping made meanwhile shows in neither
    return held_memory(process_memory(), pages)


#: a worker in one of these states needs its threads no more (its publisher
#: and relief end even when no plugin teardown stops them)
_CLOSED = frozenset({Status.closing, Status.closed, Status.failed})


def worker_alive(worker: Worker) -> Callable[[], bool]:
    """A check, for a worker's background threads, that ``worker`` still
    exists and is not closing (holds it weakly)."""
    worker_ref = weakref.ref(worker)

    def alive() -> bool:
        w = worker_ref()
        return w is not None and w.status not in _CLOSED

    return alive


#: the share publisher of each worker with a monitor installed
_publishers: weakref.WeakKeyDictionary[Worker, SharePublisher] = weakref.WeakKeyDictionary()


def install_worker_monitor(worker: Worker, buffer: SharedSpillBuffer) -> None:
    """Worker memory = private memory + ``buffer``'s tier-2 share; the share
    is also published for the nanny, and the link counts behind it kept
    current, by a :class:`~dask_shm.shared.published_share.NativeSharePublisher`
    (a Rust thread publishes, a Python one refreshes). ``buffer`` also
    compares that figure with the worker's spill threshold after each
    unspill through a mapping (see
    :attr:`~dask_shm.shared.buffer.SharedSpillBuffer.over_spill_threshold`)."""

    def worker_memory() -> int:
        return process_memory_held() + buffer.tier2_bytes()

    worker.monitor.get_process_memory = worker_memory  # type: ignore[method-assign]
    monitor, manager = worker.monitor, worker.memory_manager

    def over_spill_threshold() -> bool:
        # As the worker's memory manager decides to spill, read at each call.
        limit, spill = manager.memory_limit, manager.memory_spill_fraction
        if not limit or spill is False:
            return False
        return monitor.get_process_memory() > limit * spill

    buffer.over_spill_threshold = over_spill_threshold
    tiers = buffer.store.tiers
    publisher = NativeSharePublisher(
        share_path(buffer.store.directory),
        tiers.ram_stores,
        tiers.refresh_links,
        share=tiers.ram_bytes,
        pages=_published_pages,
        # Twice per look of the nanny (every 100 ms): it counts shared
        # pages only on figures stamped after its last look.
        interval=0.05,
        alive=worker_alive(worker),
    )
    publisher.start()
    _publishers[worker] = publisher


def _published_pages() -> tuple[int, int]:
    """``(mapped, kept)`` for the nanny: :func:`own_shared_pages`, with the
    born arena's own bytes in ``kept``, as the worker's monitor counts them."""
    pages = own_shared_pages()
    return pages.mapped, pages.kept + pages.arena


def uninstall_worker_monitor(worker: Worker) -> None:
    worker.monitor.__dict__.pop("get_process_memory", None)
    if hasattr(worker.data, "over_spill_threshold"):
        worker.data.over_spill_threshold = None
    publisher = _publishers.pop(worker, None)
    if publisher is not None:
        publisher.stop()


class _PrivateMemoryTerminator:
    """The nanny's terminate check, on what the worker holds (as its own
    monitor counts it, :func:`held_memory`) plus its share of its tmpfs
    files (stock's logic otherwise: SIGTERM first, SIGKILL if the same
    process is still over the limit)."""

    def __init__(self, nanny: Nanny, root: str | None):
        self.nanny = nanny
        self.root = root
        self.last_terminated_pid = -1
        #: pid, shared pages and time of the last look at that worker
        self._last: tuple[int, int, float] = (-1, 0, 0.0)

    def parts(self, pid: int) -> tuple[int, int]:
        """What worker process ``pid`` holds and the share of tmpfs files it
        publishes; O(1) in its number of files. Raises ProcessLookupError
        if it is gone.

        What the worker published is up to 50 ms old (more if its
        publisher waits for the GIL or the root is full), and a mapping it
        made since has pages in its ``RssShmem`` that the figures do not
        name. So the shared pages that are not dask-shm's count only when
        the figures were read after the last look, and only as far as that
        look saw them too; else none count, and the files only its
        mappings keep neither (the count of old: never more than it holds)."""
        now = time.monotonic()
        memory = process_memory(pid)
        if self.root is None:
            return memory.private, 0
        published = read_published(self.root, pid)
        last_pid, last_shmem, last_time = self._last
        self._last = (pid, memory.shmem, now)
        stamp = published.stamp
        if last_pid != pid or stamp is None or stamp <= last_time:
            return memory.private, published.share
        # Each look's pages against figures that name every mapping made
        # before the last look: what both leave over is not dask-shm's.
        foreign = max(0, min(memory.shmem, last_shmem) - published.mapped)
        return memory.private + foreign + published.kept, published.share

    def memory(self, pid: int) -> int:
        """:meth:`parts` summed: what is held against the limit."""
        return sum(self.parts(pid))

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
            private, share = self.parts(process.pid)
        except ProcessLookupError:
            return
        memory = private + share
        if memory / limit <= fraction:
            return
        if self.last_terminated_pid != process.pid:
            logger.warning(
                "Worker %s (pid=%d) exceeded %.0f%% memory budget (private memory "
                "%s plus its share of shared-memory files %s, limit %s). Restarting...",
                nanny.worker_address,
                process.pid,
                fraction * 100,
                format_bytes(private),
                format_bytes(share),
                format_bytes(limit),
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


#: nanny -> (its stock terminate check, ours in its place)
_replaced: weakref.WeakKeyDictionary[Nanny, tuple[PeriodicCallback, PeriodicCallback]] = (
    weakref.WeakKeyDictionary()
)


def install_nanny_monitor(nanny: Nanny, root: str | None) -> bool:
    """Replace the nanny's terminate check (counting the worker's share of
    files under ``root`` too, unless None); False if the nanny has none (no
    memory limit, or terminate disabled). Undo with :func:`uninstall_nanny_monitor`."""
    stock = nanny.periodic_callbacks.get("memory_monitor")
    if stock is None:
        return False
    if nanny in _replaced:
        return True
    was_running = stock.is_running()
    stock.stop()
    ours = PeriodicCallback(_PrivateMemoryTerminator(nanny, root), stock.callback_time)
    nanny.periodic_callbacks["memory_monitor"] = ours
    _replaced[nanny] = (stock, ours)
    if was_running:
        ours.start()
    return True


def uninstall_nanny_monitor(nanny: Nanny) -> None:
    """Give the nanny its stock terminate check back (running if ours was)."""
    replaced = _replaced.pop(nanny, None)
    if replaced is None:
        return
    stock, ours = replaced
    if nanny.periodic_callbacks.get("memory_monitor") is not ours:
        return  # replaced by someone else since: theirs now
    was_running = ours.is_running()
    ours.stop()
    nanny.periodic_callbacks["memory_monitor"] = stock
    if was_running:
        stock.start()
