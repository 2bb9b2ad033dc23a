"""Turning shared-memory mode on: worker and nanny plugins."""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes
from distributed.core import Status
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

from dask_shm import status_guard
from dask_shm.config import SharedMemorySettings, spill_compression
from dask_shm.shared import (
    born_worker,
    fetches,
    limits,
    metrics,
    monitor,
    p2p,
    pack_buffers,
    paths,
    relief,
    root_id,
    transfer,
)
from dask_shm.shared.buffer import SharedSpillBuffer
from dask_shm.shared.registry import PeerRegistry
from dask_shm.shared.sender import install_get_data
from dask_shm.shared.tiers import FileTier, TierSpec, tiers_of

if TYPE_CHECKING:
    from distributed import Nanny, Worker

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dask-shm-shared-memory"


class SharedMemoryPlugin(WorkerPlugin):
    """Put a worker in shared-memory mode.

    On setup: removes directories left by dead processes on the root and
    the tier-3 root (before sizing the tier-2 budget from free space); gives
    the worker a :class:`~dask_shm.shared.SharedSpillBuffer` (sized from the
    worker's memory limit and config like the stock buffer; a worker whose
    config disables spilling still gets one, that never spills on its own,
    so it can exchange files); answers same-host peers' ``get_data`` with
    hard-link handles and accepts theirs into its buffer; hands P2P shuffle
    and rechunk batches to those peers as files (:mod:`~dask_shm.shared.p2p`);
    makes the memory
    monitor count private memory plus the worker's 1/k share of its tmpfs
    files (tier 2, within a budget from ``shm.shared-memory.max-bytes``; one
    warning if the root is too small); publishes metrics (``get_metrics()["shm"]``, Prometheus
    ``dask_shm_worker_*``). On teardown (worker closing) it undoes that and
    deletes the worker's files (links held by peers keep their data alive);
    removed from a running worker (``client.unregister_worker_plugin``), it
    first moves the worker's keys into a private :class:`~dask_shm.SpillBuffer`.

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

    @property
    def born_state(self) -> str | None:
        """What this plugin's setup did about arrays born shared, as a phrase
        (e.g. "arrays born shared off: <why>"); None when this instance did
        not put its worker in shared-memory mode (not set up, or the mode
        was already on)."""
        born = getattr(self, "_born", None)
        return None if born is None else born.state

    async def setup(self, worker: Worker) -> None:
        if isinstance(worker.data, SharedSpillBuffer):
            return
        # Our teardown runs inside Worker.close; keep that close the only one.
        status_guard.install(worker)
        settings = SharedMemorySettings.from_config()
        born_settings = born_worker.BornSettings.from_config()
        root = self.root or settings.root
        # Before the budget, which is capped by the root's free space: what
        # dead processes left there is not taken. O(their files): in a thread,
        # off the event loop (an in-process cluster shares it with the client).
        await sweep_off_the_loop(tiers_of(settings, root))
        if isinstance(worker.data, SharedSpillBuffer):  # set up meanwhile
            return
        self._install(worker, settings, born_settings, root)

    def _install(
        self,
        worker: Worker,
        settings: SharedMemorySettings,
        born_settings: born_worker.BornSettings,
        root: str,
    ) -> None:
        from dask_shm.worker import SpillBufferPlugin, install_spill_buffer, target_from_config

        memory_limit = worker.memory_manager.memory_limit
        budget = limits.tier2_budget(
            settings.max_bytes,
            root,
            memory_limit,
            held=monitor.process_memory_held(),
            target_fraction=(
                worker.memory_manager.memory_target_fraction
                or worker.memory_manager.memory_spill_fraction
                or None
            ),
        )
        target = target_from_config(memory_limit) or sys.maxsize
        try:
            # The one check of the root (on_tiers raises UnusableRoot).
            specs = tiers_of(settings, root)
            buffer = SharedSpillBuffer.on_tiers(
                target,
                specs,
                {specs[0].name: budget.limit},
                min_size=settings.min_size,
                min_shared_fraction=settings.min_shared_fraction,
                max_spill=worker.memory_manager.max_spill,
                name=f"w-{uuid.uuid4().hex[:12]}",
                # read here, as stock's SpillBuffer does when it is built
                compression=spill_compression(),
            )
        except (paths.UnusableRoot, OSError) as e:
            logger.warning("dask-shm: %s; this worker spills privately", e)
            SpillBufferPlugin().setup(worker)
            return
        _warn_small_root(root, budget)
        install_spill_buffer(worker, buffer)
        self._buffer = buffer
        self._registry = PeerRegistry(root)
        tokens = _root_tokens(buffer.store.tiers.tiers)
        self._original_gather_dep = fetches.receive_fetches_into(
            worker, buffer, self._registry, tokens
        )
        self._original_gather = fetches.drop_unresolved_updates(
            worker, buffer, self._registry, tokens
        )
        transfer.enable_receiving(buffer)
        # Under min-size a value goes as bytes anyway (not worth sharing, found
        # by serializing it): the size check only decides above it.
        transfer_min_size = settings.transfer_min_size
        if transfer_min_size <= settings.min_size:
            transfer_min_size = 0
        self._original_get_data = install_get_data(
            worker, buffer, self._registry, tokens, transfer_min_size
        )
        if settings.write_ahead:
            buffer.start_writing_ahead(max(settings.transfer_min_size, settings.min_size))
        pack_buffers.install()
        first = buffer.store.tiers.tiers[0].number
        takes_shard_files = False
        if first in tokens:
            try:
                takes_shard_files = p2p.enable(
                    worker.address, buffer, self._registry, root, tokens[first]
                )
                if not takes_shard_files:
                    logger.info("dask-shm: P2P shard batches go as bytes (see dask shm info)")
            except OSError as e:
                logger.info("dask-shm: P2P shard batches go as bytes: %s", e)
        # Peers send shard files only to a worker that published p2p: a
        # worker whose enable failed has no receiver for them.
        self._registry.register(worker.address, tokens.values(), p2p=takes_shard_files)
        monitor.install_worker_monitor(worker, buffer)
        self._relief = relief.start_for_worker(worker, buffer)
        metrics.install(worker)
        # After the monitor: born-shared bytes are added on top of it.
        self._born = born_worker.BornSharedPlugin(born_settings, announce=False)
        self._born.setup(worker)
        # The worker's one INFO line about dask-shm: everything set up above.
        logger.info(
            "dask-shm: shared-memory mode on %s: root %s, budget %s (%s); %s; %s",
            worker.address,
            root,
            format_bytes(budget.limit),
            budget.reason,
            ", ".join(f"tier {t.number} {t.directory}" for t in buffer.store.tiers.tiers),
            self._born.state,
        )

    def teardown(self, worker: Worker) -> None:
        registry = getattr(self, "_registry", None)
        if registry is None:
            return
        registry.unregister(worker.address)
        p2p.disable(worker.address)
        self._born.teardown(worker)
        worker.handlers["get_data"] = self._original_get_data
        worker.__dict__.pop("gather_dep", None)
        worker.__dict__.pop("update_data", None)
        worker.handlers["gather"] = self._original_gather
        monitor.uninstall_worker_monitor(worker)
        if (tier2_relief := getattr(self, "_relief", None)) is not None:
            tier2_relief.stop()
        metrics.uninstall(worker)
        buffer = self._buffer
        if transfer.receiver() is buffer:
            transfer.enable_receiving(None)
        if worker.data is buffer and worker.status not in (Status.closing, Status.closed):
            from dask_shm.worker import install_spill_buffer, private_spill_buffer

            # Removed from a running worker: its keys move to a private
            # buffer (read back one at a time) before their files go.
            private = private_spill_buffer(worker)
            install_spill_buffer(worker, {} if private is None else private)
        buffer.close()
        for tier in buffer.store.tiers.tiers:
            shutil.rmtree(tier.directory, ignore_errors=True)
        # A clean close leaves nothing: the process directories go too once
        # no other buffer of this process uses them (their locks are dropped).
        for tier in buffer.store.tiers.tiers:
            paths.release_process_dir(tier.root)


_warned_small_root = False


def _warn_small_root(root: str, budget: limits.Budget) -> None:
    """One warning per process for a root too small for a useful tier 2."""
    global _warned_small_root
    if budget.small_root and not _warned_small_root:
        _warned_small_root = True
        logger.warning(
            "dask-shm: %s. To share more in memory, %s.",
            limits.small_root_message(root, limits.tmpfs_space(root).free),
            limits.SMALL_ROOT_ADVICE,
        )


def _root_tokens(tiers: Iterable[FileTier]) -> dict[int, str]:
    """The identity tokens of the linkable tiers' roots, by tier number (see
    :mod:`~dask_shm.shared.root_id`); a tier whose token cannot be made is
    left out (its files then always go to peers as bytes)."""
    tokens = {}
    for tier in tiers:
        if not tier.linkable:
            continue
        try:
            tokens[tier.number] = root_id.root_token(tier.root)
        except OSError as e:
            logger.info(
                "dask-shm: no identity token for %s (%s); its files go as bytes", tier.root, e
            )
    return tokens


class SharedMemoryNannyPlugin(NannyPlugin):
    """Nanny side of shared-memory mode: the nanny's terminate check reads the
    worker's private memory plus its 1/k share of its tmpfs files (as the
    worker's own monitor does), and directories of dead
    worker processes are removed from both roots when the nanny starts and
    closes, and after each time it kills its worker process.

    The last is what stock's nanny does for a worker's local directory: a
    worker that does not end within the nanny's close timeout (stuck in a
    task, a plugin's teardown, a P2P send to a dead peer) is killed, and its
    files, which its own close would have removed, would otherwise stay on
    the tmpfs (RAM) until some later process starts on that root.

    >>> client.register_plugin(SharedMemoryNannyPlugin())  # doctest: +SKIP
    """

    name = PLUGIN_NAME + "-nanny"
    idempotent = True

    def __init__(self, root: str | None = None):
        self.root = root
        #: the tiers whose roots are swept, once set up (a first tier whose
        #: root is unusable left out); nothing if the setup failed on the config
        self._tiers: list[TierSpec] | None = None
        #: the nanny's own kill and the one that sweeps after it, once set up
        self._kill: tuple[Callable[..., Awaitable[None]], Callable[..., Awaitable[None]]] | None
        self._kill = None

    def _usable(self, root: str) -> bool:
        try:
            paths.check_root(root)
        except paths.UnusableRoot:
            return False
        return True

    async def _sweep(self) -> None:
        # O(files) of dead processes: in a thread, so that the nanny's event
        # loop (in a LocalCluster also the scheduler's and the client's) runs on.
        if self._tiers is not None:
            await sweep_off_the_loop(self._tiers)

    async def setup(self, nanny: Nanny) -> None:
        settings = SharedMemorySettings.from_config()
        specs = tiers_of(settings, self.root)
        # A RAM tier on an unusable root is left alone (its worker says why).
        self._tiers = [t for t in specs if not t.ram or self._usable(t.root)]
        await self._sweep()
        # The worker publishes its share of its tmpfs files next to the registry.
        monitor.install_nanny_monitor(
            nanny, next((t.root for t in self._tiers if t.registry), None)
        )
        self._sweep_after_kill(nanny)

    def _sweep_after_kill(self, nanny: Nanny) -> None:
        """Make ``nanny.kill`` sweep once the worker process is gone. Nanny.close
        tears its plugins down first and kills its worker after, so teardown
        alone cannot remove the files of a worker that had to be killed."""
        kill = nanny.kill

        @functools.wraps(kill)
        async def kill_then_sweep(*args: Any, **kwargs: Any) -> None:
            try:
                await kill(*args, **kwargs)
            finally:
                await self._sweep()

        nanny.kill = kill_then_sweep  # type: ignore[method-assign]
        self._kill = (kill, kill_then_sweep)

    async def teardown(self, nanny: Nanny) -> None:
        await self._sweep()
        # A closing nanny kills its worker after this: keep the sweep after it.
        # Removed from a running nanny, the plugin gives the nanny its kill back.
        if self._kill is not None and nanny.status not in (Status.closing, Status.closed):
            kill, kill_then_sweep = self._kill
            if nanny.kill is kill_then_sweep:
                nanny.kill = kill  # type: ignore[method-assign,assignment]
            self._kill = None
            monitor.uninstall_nanny_monitor(nanny)


async def sweep_off_the_loop(tiers: list[TierSpec]) -> int:
    """:func:`reclaim_dead_processes` in the event loop's default executor, so
    that the loop runs on meanwhile; in the loop itself when that executor is
    already shut down (a cluster closed while its process exits: nothing else
    is left for the loop to run, and stock closes quietly there too).

    When a few lock probes on the loop find nothing to reclaim (the usual
    start), returns 0 without the executor: a server's start then runs on
    the loop without a thread's round trip, as stock's does. In an
    in-process cluster that round trip let each worker register with the
    scheduler in a loop turn of its own, and the cluster's own list of
    workers lagged behind the scheduler's when its ``async with`` began
    (in 14 of 15 starts of four in-process workers; distributed's
    ``test_worker_keys`` then failed in 2 of 30 runs)."""
    if all(paths.nothing_to_reclaim(t.root, peers=t.registry) for t in tiers):
        return 0
    loop = asyncio.get_running_loop()
    try:
        swept = loop.run_in_executor(None, reclaim_dead_processes, tiers)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return reclaim_dead_processes(tiers)
    return await swept


def reclaim_dead_processes(tiers: Iterable[TierSpec]) -> int:
    """Remove the directories of dead processes on the roots of ``tiers``
    (and the peer registry's dead entries on the one that holds it), as a
    worker or nanny starting there does; returns the bytes given back. A
    root that cannot be swept is logged, not raised: it does not stop a
    server from starting."""
    freed = 0
    for tier in tiers:
        where, peers = tier.root, tier.registry
        try:
            freed += paths.reclaim(where, peers=peers).bytes
        except paths.UnusableRoot as e:
            # The worker's buffer meets the same root and warns, naming the fix.
            logger.debug("dask-shm: cannot remove dead processes' files under %s: %s", where, e)
        except OSError as e:
            logger.info("dask-shm: cannot remove dead processes' files under %s: %s", where, e)
    return freed
