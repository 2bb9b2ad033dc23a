"""The distributed internals dask-shm hooks, checked when first used.

dask-shm plugs into stock distributed without forking it, and a few of its
hooks are not public API. :func:`missing_hooks` lists the ones this
distributed lacks, with what stops working; :func:`warn_if_hooks_missing`
turns that into one :class:`DistributedCompatibilityWarning` when the
first distributed-facing name of ``dask_shm`` is used (``dask_shm.SpillBuffer``,
``dask_shm.dask_setup`` as ``--preload dask_shm`` looks it up, a subpackage
such as ``dask_shm.shared``; not ``dask_shm.get``, whose pool processes must
not import distributed), and ``dask shm info`` reports it as a problem with
a fix, so a distributed that moved an internal never gives a silent
half-install.

Public distributed API we import (``distributed.spill.SpilledSize``,
``distributed.spans``, ``distributed.active_memory_manager``, ...) needs no
check here: an import of a name that is gone fails with ImportError.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple


class DistributedCompatibilityWarning(UserWarning):
    """An internal of distributed that dask-shm hooks is missing."""


class Hook(NamedTuple):
    """An internal we rely on: where it is, who uses it, and a test.
    ``needs``: a module that a process using the hooked feature has imported
    already; a process without it is not checked at first use (the check
    would import it: distributed's dashboard costs a worker ~18 MiB with bokeh)."""

    where: str
    used_by: str
    present: Callable[[], bool]
    needs: str = ""


def _code_mentions(func: object, name: str) -> bool:
    """Whether ``func``'s code (nested functions included) uses the string
    constant (a dict key included) or global/attribute ``name``: cheap, no
    source needed."""
    code = getattr(inspect.unwrap(func), "__code__", None)  # type: ignore[arg-type]
    stack = [code] if code is not None else []
    while stack:
        current = stack.pop()
        if name in current.co_names or name in current.co_consts:
            return True
        # the keys of a dict display are one tuple constant
        if any(isinstance(c, tuple) and name in c for c in current.co_consts):
            return True
        stack.extend(c for c in current.co_consts if inspect.iscode(c))
    return False


def _worker_get_data() -> bool:
    from distributed.worker import Worker

    return callable(getattr(Worker, "get_data", None)) and _code_mentions(
        Worker.__init__, "get_data"
    )


def _worker_process_memory_hook() -> bool:
    from distributed.system_monitor import SystemMonitor

    return callable(getattr(SystemMonitor, "get_process_memory", None))


def _nanny_memory_monitor() -> bool:
    from distributed import worker_memory

    manager = getattr(worker_memory, "NannyMemoryManager", None)
    return (
        manager is not None
        and callable(getattr(manager, "memory_monitor", None))
        and _code_mentions(manager.__init__, "memory_monitor")
        and {"memory_limit", "memory_terminate_fraction"} <= set(manager.__annotations__)
    )


def _scheduler_amm_global() -> bool:
    import distributed.scheduler as scheduler

    return hasattr(scheduler, "ActiveMemoryManagerExtension") and _code_mentions(
        scheduler.Scheduler.retire_workers, "ActiveMemoryManagerExtension"
    )


def _prometheus_collectors() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return True  # no /metrics at all: nothing to hook
    from distributed.http.scheduler.prometheus import core as scheduler_core
    from distributed.http.worker.prometheus import core as worker_core

    return hasattr(getattr(scheduler_core, "PrometheusHandler", None), "_collectors") and hasattr(
        getattr(worker_core, "PrometheusHandler", None), "_collector"
    )


def _dashboard_page() -> bool:
    try:
        from distributed.dashboard import core, scheduler
    except ImportError:
        return True  # no bokeh, no dashboard: nothing to hook
    from distributed.http.routing import RoutingApplication

    variables = scheduler.template_variables
    return (
        list(inspect.signature(core.BokehApplication).parameters)[:4]
        == ["applications", "server", "prefix", "template_variables"]
        # memoized (toolz.memoize keeps a "cache"): one dict per scheduler
        and "cache" in getattr(getattr(variables, "__code__", None), "co_freevars", ())
        and _code_mentions(variables, "pages")
        and callable(getattr(RoutingApplication, "add_application", None))
    )


def dashboard_hooks_present() -> bool:
    """Whether distributed's dashboard can take dask-shm's page (the check
    behind the dashboard entry of :data:`HOOKS`; False if it fails to run)."""
    try:
        return _dashboard_page()
    except Exception:
        return False


def shuffle_run_methods_present() -> bool:
    """Whether the ShuffleRun methods :mod:`dask_shm.shared.p2p` wraps are
    there, as it expects them (a failing check counts as missing)."""
    try:
        return _shuffle_run_methods()
    except Exception:
        return False


def worker_pending_plugins_hook() -> bool:
    """Whether ``Worker.start_unsafe`` sets up ``Worker._pending_plugins``
    (the ``plugins=`` argument) after the preloads, raising their errors."""
    from distributed.worker import Worker

    return "_pending_plugins" in getattr(Worker, "__annotations__", {}) and _code_mentions(
        Worker.start_unsafe, "_pending_plugins"
    )


def nanny_instantiate_hook() -> bool:
    """Whether ``Nanny.start_unsafe`` starts the worker process with
    ``self.instantiate()`` after the preloads."""
    from distributed.nanny import Nanny

    return callable(getattr(Nanny, "instantiate", None)) and _code_mentions(
        Nanny.start_unsafe, "instantiate"
    )


def nanny_kill_after_teardown() -> bool:
    """Whether ``Nanny.close`` ends the worker process with ``self.kill()``
    (looked up on the instance) after its plugins' teardown."""
    from distributed.nanny import Nanny

    return callable(getattr(Nanny, "kill", None)) and _code_mentions(Nanny.close, "kill")


def worker_status_change_handler() -> bool:
    """Whether ``Worker.__init__`` registers ``handle_worker_status_change`` as
    the ``"worker-status-change"`` stream handler, and ``Worker.close`` stops
    at a worker already closing (what :mod:`dask_shm.status_guard` keeps so)."""
    from distributed.worker import Worker

    return (
        callable(getattr(Worker, "handle_worker_status_change", None))
        and _code_mentions(Worker.__init__, "worker-status-change")
        and _code_mentions(Worker.close, "closing")
    )


def _shuffle_run_methods() -> bool:
    from distributed.shuffle._core import ShuffleRun
    from distributed.shuffle._memory import MemoryShardsBuffer  # noqa: F401
    from distributed.shuffle._worker_plugin import ShuffleWorkerPlugin

    send = getattr(ShuffleRun, "_send", None)
    return (
        all(
            inspect.iscoroutinefunction(getattr(ShuffleRun, name, None))
            for name in ("_send", "receive", "close")
        )
        and list(inspect.signature(send).parameters) == ["self", "address", "shards"]  # type: ignore[arg-type]
        and list(inspect.signature(ShuffleRun.receive).parameters) == ["self", "data"]
        and _code_mentions(send, "shuffle_receive")
        and _code_mentions(ShuffleWorkerPlugin.shuffle_receive, "receive")
        and "_disk_buffer" in ShuffleRun.__annotations__
    )


def _protocol_msgpack() -> bool:
    import msgpack

    from dask_shm.shared.pack_buffers import SMALL_BUFFER_MSGPACK, protocol_modules

    core, serialize = protocol_modules()
    return all(
        getattr(module, "msgpack", None) in (msgpack, SMALL_BUFFER_MSGPACK)
        for module in (core, serialize)
    ) and all(_code_mentions(f, "msgpack") for f in (core.dumps, serialize.serialize_bytelist))


def _serialized_passthrough() -> bool:
    from distributed.comm.core import Comm
    from distributed.protocol import core

    return _code_mentions(core.dumps, "Serialized") and _code_mentions(
        Comm.__init__, "handshake_options"
    )


HOOKS: tuple[Hook, ...] = (
    Hook(
        'distributed.worker.Worker.handlers["get_data"]',
        "shared-memory mode's same-host transfers by hard link",
        _worker_get_data,
    ),
    Hook(
        "distributed.shuffle._core.ShuffleRun._send / .receive / .close "
        '(the "shuffle_receive" RPC) and ._disk_buffer (MemoryShardsBuffer or not)',
        "shared-memory mode's P2P shuffle and rechunk batches by file",
        _shuffle_run_methods,
    ),
    Hook(
        "distributed.system_monitor.SystemMonitor.get_process_memory",
        "shared-memory mode: shared pages left out of the worker's memory",
        _worker_process_memory_hook,
    ),
    Hook(
        'distributed.worker_memory.NannyMemoryManager ("memory_monitor" callback)',
        "shared-memory mode: the nanny's restart check on private memory",
        _nanny_memory_monitor,
    ),
    Hook(
        "distributed.scheduler.ActiveMemoryManagerExtension (module global read by "
        "Scheduler.retire_workers)",
        "dask_shm.amm during retire_workers",
        _scheduler_amm_global,
    ),
    Hook(
        "distributed.http.{scheduler,worker}.prometheus.core.PrometheusHandler collectors",
        "per-span Prometheus series",
        _prometheus_collectors,
    ),
    Hook(
        "distributed.dashboard.core.BokehApplication and "
        'distributed.dashboard.scheduler.template_variables (memoized, its "pages" '
        "list is every page's nav bar)",
        "the dashboard's shared-memory page",
        _dashboard_page,
        # A dashboard's scheduler imported it; the page checks again at setup.
        needs="distributed.dashboard.core",
    ),
    Hook(
        "distributed.worker.Worker._pending_plugins (set up after the preloads)",
        "an invalid shm.* value stopping an in-process worker from starting",
        worker_pending_plugins_hook,
    ),
    Hook(
        "distributed.protocol.{core,serialize}.msgpack (module globals used by dumps)",
        "shared-memory mode: packing messages without a 256 KiB mapping each",
        _protocol_msgpack,
    ),
    Hook(
        "distributed.nanny.Nanny.instantiate (called after the preloads)",
        "an invalid shm.* value stopping an in-process nanny from starting",
        nanny_instantiate_hook,
    ),
    Hook(
        'distributed.worker.Worker.stream_handlers["worker-status-change"]',
        "a closing worker (dask_shm preloaded, or in shared-memory mode) ignoring the "
        "scheduler's status changes (else it may close twice and wait 30 s for its threads)",
        worker_status_change_handler,
    ),
    Hook(
        "distributed.protocol.core.dumps (sends a Serialized value's frames as they are) "
        "and distributed.comm.core.Comm.handshake_options",
        "shared-memory mode: a value not worth sharing sent from the frames that told so, "
        "not serialized a second time",
        _serialized_passthrough,
    ),
    Hook(
        "distributed.nanny.Nanny.kill (awaited by Nanny.close after its plugins' teardown)",
        "shared-memory mode: a nanny removing the files of a worker it had to kill",
        nanny_kill_after_teardown,
    ),
)


def missing_hooks(*, in_use: bool = False) -> list[Hook]:
    """The hooks this distributed lacks (a check that fails to run counts
    as missing). ``in_use``: only those this process can use now, leaving
    out a hook whose :attr:`Hook.needs` module is not imported."""
    missing = []
    for hook in HOOKS:
        if in_use and hook.needs and hook.needs not in sys.modules:
            continue
        try:
            ok = hook.present()
        except Exception:
            ok = False
        if not ok:
            missing.append(hook)
    return missing


def describe(missing: list[Hook]) -> str:
    """One message naming the distributed version, each missing hook and what
    stops working."""
    import distributed

    lines = [
        f"dask-shm cannot hook into distributed {distributed.__version__}; missing:",
        *(f"  - {hook.where} (used by {hook.used_by})" for hook in missing),
        "Those features will not work; install a distributed version dask-shm "
        "supports (see its pyproject.toml) or a newer dask-shm.",
    ]
    return "\n".join(lines)


def warn_if_hooks_missing() -> list[Hook]:
    """Warn once (DistributedCompatibilityWarning) if any hook this process
    can use is missing (:func:`missing_hooks` ``in_use``); returns those."""
    missing = missing_hooks(in_use=True)
    if missing:
        warnings.warn(describe(missing), DistributedCompatibilityWarning, stacklevel=2)
    return missing
