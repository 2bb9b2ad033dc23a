"""One preload for everything dask-shm installs.

``dask scheduler --preload dask_shm`` / ``dask worker --preload dask_shm``
(and ``--preload-nanny dask_shm``), or config alone:
``distributed.{scheduler,worker,nanny}.preload: [dask_shm]``. What gets
installed follows the ``shm.*`` config (see ``dask-shm.yaml``):

- scheduler: dask-shm's Active Memory Manager (``shm.amm``) and span extension
  (``shm.spans``), and the dashboard's shared-memory page
  (:mod:`dask_shm.dashboard`; when the scheduler serves a dashboard);
- worker: with ``shm.shared-memory.enabled``, shared-memory mode
  (:class:`dask_shm.SharedMemoryPlugin`); otherwise :class:`dask_shm.SpillBuffer`
  sized from the worker's own memory limit (``shm.spill-buffer``); and the worker
  span extension (``shm.spans``);
- nanny: with ``shm.shared-memory.enabled``, :class:`dask_shm.SharedMemoryNannyPlugin`.

Every worker also gets :mod:`dask_shm.status_guard`: once closing, it ignores
the scheduler's status changes, so that it closes once.

A worker also logs a warning for each ``shm.*`` key that dask-shm does not
know (a typo), naming the closest key it knows (:func:`warn_unknown_keys`).

The preload replaces stock components that the server has and never adds
what it was built without: a scheduler or worker constructed with no
``"amm"`` / ``"spans"`` extension (e.g. ``extensions={}``) keeps none, and a
worker whose data mapping is not stock's SpillBuffer (a ``data=`` mapping of
the user's, or a dict because spilling is off) keeps it. So turning dask-shm on
changes how things are done, not what a server runs.

Plugins the preload sets up are not listed in ``server.plugins`` (user code
and distributed's own tests see the plugin lists a server had without
dask-shm): :func:`dask_teardown`, which distributed calls when the server
closes, tears them down; :func:`preloaded_plugins` tells which are on.

An invalid ``shm.*`` value stops the server from starting: distributed only
logs exceptions raised by a preload, so the preload makes the server's start
fail with :class:`InvalidConfig` (naming the key, the value and what is
accepted) as the cause (:mod:`dask_shm.startup_refusal`): ``LocalCluster()``
raises at once, with processes or without, and ``dask worker`` /
``dask scheduler`` exit with status 1.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Mapping
from typing import Any

from dask_shm.config import SharedMemorySettings, closest_known_key, enabled, unknown_keys
from dask_shm.startup_refusal import refuse_to_start

logger = logging.getLogger(__name__)

#: server -> {plugin name: plugin} set up by this preload, in setup order.
_preloaded: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
#: Unknown ``shm.*`` keys this process warned about.
_warned_unknown_keys: set[str] = set()


class InvalidConfig(ValueError):
    """An ``shm.*`` config value is invalid; the server must not start."""


async def dask_setup(server: Any) -> None:
    """Preload entry point (distributed awaits it while the server starts).

    For an invalid ``shm.*`` value, installs nothing and makes the server's
    start fail with :class:`InvalidConfig` (see the module docstring). Raises
    TypeError for a server that is not a Scheduler, Worker or Nanny.
    """
    from distributed import Nanny, Scheduler, Worker

    if not isinstance(server, (Scheduler, Worker, Nanny)):
        raise TypeError(
            f"dask_shm preload runs on a Scheduler, Worker or Nanny, not {type(server).__name__}"
        )
    if isinstance(server, Worker):
        warn_unknown_keys()
    try:
        await _setup(server)
    except ValueError as e:
        logger.critical("dask-shm: invalid configuration: %s", e)
        refuse_to_start(server, InvalidConfig(f"dask-shm: invalid configuration: {e}"))


def warn_unknown_keys() -> None:
    """Log a warning for each ``shm.*`` key the schema does not know (a typo
    such as ``shm.shared-memory.enable`` is otherwise ignored without a
    word), naming the closest known key; once per key and process, so a
    cluster of in-process workers says it once."""
    for key in unknown_keys():
        if key in _warned_unknown_keys:
            continue
        _warned_unknown_keys.add(key)
        closest = closest_known_key(key)
        logger.warning(
            "dask-shm: unknown config key %s is ignored%s",
            key,
            f"; did you mean {closest}?" if closest else "",
        )


async def _setup(server: Any) -> None:
    from distributed import Nanny, Scheduler

    if isinstance(server, Scheduler):
        switches = {name: enabled(name) for name in ("amm", "spans")}
        if switches["amm"] and "amm" in server.extensions:
            from dask_shm.amm import install_scheduler_extension as install_amm

            install_amm(server)
        if switches["spans"] and "spans" in server.extensions:
            from dask_shm.spans import install_scheduler_extension as install_spans

            install_spans(server)
        from dask_shm.dashboard import DashboardPage

        await _add_plugin(server, DashboardPage())
        return
    shared = SharedMemorySettings.from_config().enabled
    if shared:
        from dask_shm.shared.born_worker import BornSettings

        BornSettings.from_config()  # refuse a bad shm.shared-memory.born-* value now
    if isinstance(server, Nanny):
        if shared:
            from dask_shm.shared import SharedMemoryNannyPlugin

            await _add_plugin(server, SharedMemoryNannyPlugin())
        return
    from dask_shm import status_guard

    # Our teardowns run inside Worker.close; keep that close the only one.
    status_guard.install(server)
    switches = {name: enabled(name) for name in ("spill-buffer", "spans")}
    if shared and _has_stock_spill_buffer(server):
        from dask_shm.shared import SharedMemoryPlugin

        await _add_plugin(server, SharedMemoryPlugin())
    elif shared:
        why, fix = kept_data_mapping(server)
        logger.warning("dask-shm: shared-memory mode off on %s: %s; %s", server.address, why, fix)
    elif switches["spill-buffer"] and _has_stock_spill_buffer(server):
        from dask_shm.worker import SpillBufferPlugin

        SpillBufferPlugin().setup(server)
    if switches["spans"] and "spans" in server.extensions:
        from dask_shm.spans import install_worker_extension

        install_worker_extension(server)


def _has_stock_spill_buffer(worker: Any) -> bool:
    from distributed.spill import SpillBuffer as StockSpillBuffer

    return isinstance(worker.memory_manager.data, StockSpillBuffer)


def kept_data_mapping(worker: Any) -> tuple[str, str]:
    """``(why, fix)``: why the preload leaves ``worker``'s data mapping as it
    is (it is not stock's SpillBuffer, so shared-memory mode stays off), and
    what turns shared-memory mode on, each in a phrase."""
    data = worker.memory_manager.data
    manager = worker.memory_manager
    if type(data) is dict and not manager.memory_limit:
        why = "the worker has no memory limit"
    elif type(data) is dict and not (
        manager.memory_target_fraction or manager.memory_spill_fraction
    ):
        why = "distributed.worker.memory.target and .spill are both False"
    else:
        kind = f"{type(data).__module__}.{type(data).__qualname__}"
        return (
            f"its data mapping is the user's ({kind}), which dask-shm keeps",
            "register dask_shm.SharedMemoryPlugin() to replace it",
        )
    return (
        f"{why}, so distributed gave it a plain dict, which dask-shm keeps as stock does",
        "give it a memory limit and leave spilling on to share values through the "
        "shared-memory root",
    )


async def dask_teardown(server: Any) -> None:
    """Preload exit point, run by distributed when ``server`` closes: tears
    down the plugins :func:`dask_setup` set up, last first. A plugin whose
    teardown fails is logged and the others are still torn down, as
    distributed does for registered plugins."""
    for name, plugin in reversed(list(_preloaded.pop(server, {}).items())):
        try:
            result = plugin.teardown(server)
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("dask-shm: plugin %s failed to tear down", name)


def preloaded_plugins(server: Any) -> Mapping[str, Any]:
    """The plugins this preload set up on ``server`` (not listed in
    ``server.plugins``), by name; empty once the server closed."""
    return dict(_preloaded.get(server, {}))


async def _add_plugin(server: Any, plugin: Any) -> None:
    """Set ``plugin`` up on ``server``, to be torn down by :func:`dask_teardown`.

    Unlike ``register_plugin`` this leaves ``server.plugins`` as it was: code
    that lists a server's plugins (distributed's tests among it) sees what it
    registered. A ``register_plugin`` of the same plugin class later still
    works: its setup finds the mode on and does nothing.
    """
    result = plugin.setup(server)
    if inspect.isawaitable(result):
        await result
    _preloaded.setdefault(server, {})[plugin.name] = plugin
