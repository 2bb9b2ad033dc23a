"""Arrays born shared on workers: the ``shm.shared-memory.born-*`` config,
whether the root's tmpfs makes it pay off, and the worker plugin that runs
every task through the arena (:mod:`.born`).

Whether it pays off depends on the tmpfs: fresh tmpfs pages fault in 4 KiB
units unless the file system serves huge pages, while numpy's ordinary large
allocations get transparent huge pages. Freed blocks are reused (no fresh
pages), but an array handed to a peer or spilled leaves the arena, and the
one made next is a fresh file. See :func:`huge_pages` and docs/shared-memory.md
("Arrays born shared").
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import PeriodicCallback

from dask_shm import _core
from dask_shm.config import setting, setting_bytes, shipped_default
from dask_shm.shared import born, paths
from dask_shm.shared.born import DEFAULT_THRESHOLD, allocating, own_bytes

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

#: The worker's periodic callback that releases the arena's expired cached
#: blocks (:func:`born.release_expired`).
DECAY_CALLBACK = "dask-shm-born-decay"


def huge_pages(root: str) -> bool:
    """True when files on the tmpfs at ``root`` get transparent huge pages:
    the mount says ``huge=always``, ``huge=within_size`` or ``huge=advise``
    (the arena asks with ``madvise``), or the kernel forces them for every
    tmpfs (``shmem_enabled`` is ``force``)."""
    mount = paths.mount_of(root)
    for option in () if mount is None else mount.options:
        if option in ("huge=always", "huge=within_size", "huge=advise"):
            return True
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return "[force]" in f.read()
    except OSError:
        return False


@dataclass(frozen=True)
class BornSettings:
    """``shm.shared-memory.born-*`` config.

    - ``born-shared``: ``auto`` (on when the root serves huge pages, see
      :func:`huge_pages`), ``true`` or ``false``;
    - ``born-threshold``: smallest allocation served from a file (1 MiB);
    - ``born-budget``: most bytes in blocks at once per worker, freed blocks
      kept for reuse included; ``auto`` is the worker's memory limit, capped
      at half the root's free space.
    """

    # Defaults: dask-shm.yaml's.
    mode: bool | Literal["auto"] = field(
        default_factory=lambda: cast(Any, shipped_default("shm.shared-memory.born-shared"))
    )
    threshold: int = DEFAULT_THRESHOLD
    budget: int | Literal["auto"] = field(
        default_factory=lambda: cast(Any, shipped_default("shm.shared-memory.born-budget"))
    )
    #: Seconds a freed block waits in the arena's cache for reuse (not a
    #: config key: the decay of :mod:`.born`).
    cache_decay: float = born.CACHE_DECAY

    @classmethod
    def from_config(cls) -> BornSettings:
        """Read the config. Raises ValueError naming the key and the accepted values."""
        mode = cast(bool | Literal["auto"], setting("shm.shared-memory.born-shared"))
        threshold = setting_bytes("shm.shared-memory.born-threshold", minimum=1)
        budget: int | Literal["auto"] = (
            "auto"
            if setting("shm.shared-memory.born-budget") == "auto"
            else setting_bytes("shm.shared-memory.born-budget")
        )
        return cls(mode, threshold, budget)

    def decision(self, root: str) -> tuple[bool, str]:
        """Whether arrays are born shared on ``root``, and why, as a phrase
        for the worker's log line and ``dask shm info``."""
        if self.mode != "auto":
            value = "true" if self.mode else "false"
            return bool(self.mode), f"shm.shared-memory.born-shared is {value}"
        if huge_pages(root):
            return True, f"{root} serves huge pages (born-shared: auto)"
        return False, (
            f"{root} serves no huge pages, and arrays made for peers or spilled would "
            "fault fresh 4 KiB tmpfs pages in, slower than ordinary memory (mount the "
            "root with huge=within_size, or set shm.shared-memory.born-shared: true)"
        )

    def budget_for(self, root: str, memory_limit: int | None) -> int:
        if self.budget != "auto":
            return self.budget
        st = os.statvfs(root)
        half_free = st.f_bavail * st.f_frsize // 2
        return min(half_free, memory_limit) if memory_limit else half_free


# -- workers ------------------------------------------------------------------------

#: Workers of this process running their tasks through the arena (in-process
#: clusters share one arena: the settings of the last one installed apply).
_installed: set[int] = set()


def install_on_worker(
    worker: Worker,
    directory: str,
    *,
    threshold: int,
    budget: int,
    budget_fn: Callable[[], int] | None = None,
    cache_decay: float = born.CACHE_DECAY,
) -> None:
    """Start the arena in ``directory`` and run every task of ``worker``
    inside :func:`allocating` (its ``execute`` coroutine is wrapped; the
    task's thread inherits the context). ``budget_fn``, if given, is asked
    for the arena's byte budget before each task (e.g. what the tier-2
    budget leaves). Freed blocks wait ``cache_decay`` seconds for reuse.
    Undo with :func:`uninstall_from_worker`."""
    born.start(directory, threshold=threshold, budget=budget, cache_decay=cache_decay)
    if id(worker) in _installed:
        return
    original = worker.execute
    max_blocks = born.default_max_blocks()

    async def execute(key: Any, *, stimulus_id: str) -> Any:
        try:
            if budget_fn is not None:
                _core.born_configure(
                    directory, threshold, budget_fn(), max_blocks, cache_decay=cache_decay
                )
            context: contextlib.AbstractContextManager = allocating()
        except (OSError, ValueError, RuntimeError) as e:
            # E.g. the directory was removed behind our back: the task runs on
            # ordinary memory rather than failing.
            logger.warning("dask-shm: arrays born shared off for %r: %s", key, e)
            context = contextlib.nullcontext()
        with context:
            return await original(key, stimulus_id=stimulus_id)

    execute.__wrapped__ = original  # type: ignore[attr-defined]
    worker.execute = execute  # type: ignore[method-assign]
    _installed.add(id(worker))


def uninstall_from_worker(worker: Worker) -> None:
    """Stop wrapping ``worker``'s tasks; stop the arena when no worker of this
    process uses it any more (arrays already born stay valid)."""
    if id(worker) not in _installed:
        return
    _installed.discard(id(worker))
    if getattr(worker.execute, "__wrapped__", None) is not None:
        del worker.execute  # the instance attribute; the class's method shows again
    if not _installed:
        born.stop()


def _release_expired() -> None:
    born.release_expired()


class BornSharedPlugin(WorkerPlugin):
    """Arrays born shared on a worker in shared-memory mode (install it after
    :class:`~dask_shm.shared.plugin.SharedMemoryPlugin`).

    Follows :class:`BornSettings` (``shm.shared-memory.born-*``): with
    ``born-shared: auto`` (the default) it turns on only when the root serves
    huge pages, and otherwise logs why it stays off. Blocks go to a 0700
    directory in this process's directory on the root (removed on teardown;
    one left by a killed worker goes with its process directory). Their
    bytes count as the worker's own memory (the monitor ignores shared pages,
    so they are added back) until a store adopts them, and so do freed blocks
    the arena keeps for reuse (``cached_bytes``).

    After setup, :attr:`state` says in a phrase whether it is on and why
    not; it is logged at INFO unless ``announce`` is False
    (:class:`~dask_shm.shared.plugin.SharedMemoryPlugin` puts it in its own
    line instead). Raises ValueError at setup for an invalid config value.
    """

    name = "dask-shm-born-shared"
    idempotent = True

    #: What setup did, e.g. "arrays born shared off: ..." (None before setup).
    state: str | None = None

    def __init__(self, settings: BornSettings | None = None, *, announce: bool = True):
        self.settings = settings
        self.announce = announce

    def _report(self, worker: Worker, state: str) -> None:
        self.state = state
        if self.announce:
            logger.info("dask-shm: %s: %s", worker.address, state)

    def setup(self, worker: Worker) -> None:
        from dask_shm.shared.buffer import SharedSpillBuffer

        settings = self.settings or BornSettings.from_config()
        if id(worker) in _installed:
            # already on (e.g. SharedMemoryPlugin turned it on from config)
            self.state = "arrays born shared on"
            return
        buffer = worker.data
        if not isinstance(buffer, SharedSpillBuffer):
            self._report(worker, "arrays born shared need shared-memory mode; off")
            return
        root = buffer.store.root
        on, why = settings.decision(root)
        if not on:
            self._report(worker, f"arrays born shared off: {why}")
            return
        try:
            _core.born_handler()
        except (RuntimeError, ImportError) as e:
            self.state = f"arrays born shared off: they need numpy >= 1.22 ({e})"
            logger.warning("dask-shm: %s", self.state)
            return
        self._directory = paths.subdir(root, f"born-{uuid.uuid4().hex[:12]}")
        budget = settings.budget_for(root, worker.memory_manager.memory_limit)
        # Blocks live on the first tier's root and share its budget.
        first = buffer.store.tiers.tiers[0].budget

        def room() -> int:
            if first is None:  # a single, unbounded tier
                return budget
            return max(0, min(budget, first.limit - first.used))

        install_on_worker(
            worker,
            self._directory,
            threshold=settings.threshold,
            budget=room(),
            budget_fn=room,
            cache_decay=settings.cache_decay,
        )
        self._monitor = worker.monitor.get_process_memory

        def process_memory() -> int:
            return self._monitor() + own_bytes()

        worker.monitor.get_process_memory = process_memory  # type: ignore[method-assign]
        self._buffer = buffer
        evict_key = buffer.evict

        def evict() -> int:
            # Under memory pressure the cached blocks go first: releasing
            # them writes nothing, and spilling a key would not free them.
            released = born.release_cache()
            return released if released else evict_key()

        buffer.evict = evict  # type: ignore[method-assign]
        # Freed blocks unused for the cache's decay go at the next allocation
        # or free; this releases them from a worker that sits idle.
        interval = max(settings.cache_decay, 0.05) * 1000
        decay = PeriodicCallback(_release_expired, interval)
        worker.periodic_callbacks[DECAY_CALLBACK] = decay
        decay.start()
        self._report(
            worker, f"arrays of {settings.threshold} bytes or more born shared ({self._directory})"
        )

    def teardown(self, worker: Worker) -> None:
        directory = getattr(self, "_directory", None)
        if directory is None:
            return
        decay = worker.periodic_callbacks.pop(DECAY_CALLBACK, None)
        if decay is not None:
            decay.stop()
        uninstall_from_worker(worker)
        worker.monitor.get_process_memory = self._monitor  # type: ignore[method-assign]
        self._buffer.__dict__.pop("evict", None)  # the class's method shows again
        shutil.rmtree(directory, ignore_errors=True)
