"""The facts ``dask-shm info`` reports, gathered as data (:class:`HostInfo`).

Each fact comes from the module that owns it: the shared-memory root and the
``shm`` config from :mod:`dask_shm.config`, the filesystem and the per-user
directory rules from :mod:`dask_shm.shared.paths`, ``vm.max_map_count`` from
:mod:`dask_shm.shared.store`, the plugin's name from
:mod:`dask_shm.shared.plugin`. Nothing here judges what it finds (see
:mod:`dask_shm.info.checks`) or changes the system (writability is probed by
creating and removing an empty file in the root).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import errno
import os
import platform
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dask_shm._core import is_ram_backed
from dask_shm.config import (
    DEFAULTS,
    SWITCHES,
    SharedMemorySettings,
    configured,
    configured_namespace,
    enabled,
    unknown_keys,
)
from dask_shm.preload import kept_data_mapping, preloaded_plugins
from dask_shm.shared import p2p
from dask_shm.shared.born_worker import BornSettings
from dask_shm.shared.limits import summary
from dask_shm.shared.metrics import TierFigures, file_tiers
from dask_shm.shared.paths import (
    UnusableRoot,
    filesystem_of,
    reclaimable,
    user_dir_path,
    user_dir_problem,
)
from dask_shm.shared.plugin import PLUGIN_NAME
from dask_shm.shared.tiers import FIRST_FILE_TIER, tiers_of
from dask_shm.sysctl import max_map_count


class OpenFilesLimit(NamedTuple):
    """RLIMIT_NOFILE; None means unlimited."""

    soft: int | None
    hard: int | None


@dataclass
class WorkerInfo:
    """One worker as seen through the scheduler."""

    address: str
    #: Whether the plugin named :data:`PLUGIN_NAME` is installed (registered,
    #: or set up by the preload); None when the worker could not be asked
    #: (see ``error``).
    plugin_active: bool | None
    #: Class of the worker's ``data`` mapping, e.g. ``dask_shm.spill.SpillBuffer``.
    data_class: str | None
    error: str | None = None
    #: ``shm.shared-memory.enabled`` in the worker's config: whether anything
    #: asked for the plugin (None: unknown or invalid there).
    requested: bool | None = None
    #: What the worker publishes in ``get_metrics()["shm"]``
    #: (:func:`dask_shm.shared.metrics.shm_metrics`): private bytes of values
    #: in memory (tier 1, ``memory_bytes``; None when the worker publishes
    #: none: plugin off) and each file tier's name, number, bytes, budget
    #: and moves in (:func:`dask_shm.shared.metrics.file_tiers`), fastest
    #: first (by default ``shared``, tier 2, on the tmpfs, then ``disk``).
    tier1_bytes: int | None = None
    file_tiers: list[TierFigures] = field(default_factory=list)
    #: The bytes of the file tiers numbered 2 and 3 and the budget of tier 2
    #: (None if there is no such tier), from ``file_tiers``: the keys of
    #: the JSON from when there were always two file tiers.
    tier2_bytes: int | None = None
    tier3_bytes: int | None = None
    tier2_budget: int | None = None
    #: Where the worker asked for the plugin and has neither it nor a spill
    #: buffer: why its data mapping was kept (see
    #: :func:`dask_shm.preload.kept_data_mapping`).
    kept_mapping: str | None = None
    #: What the plugin did about arrays born shared on this worker, as the
    #: phrase of its log line (e.g. "arrays born shared off: <why>"); None
    #: where the plugin is not active or could not say.
    born_shared: str | None = None
    #: Whether the worker hands P2P shuffle and rechunk batches to same-host
    #: peers as files (False: as bytes, the stock way; None: plugin not active).
    p2p_by_file: bool | None = None


class HookStatus(NamedTuple):
    """One distributed internal dask-shm hooks (:data:`dask_shm.compat.HOOKS`)
    and whether this distributed has it."""

    where: str
    used_by: str
    present: bool


class DeadFiles(NamedTuple):
    """What dead processes (killed, so they could not clean up) left under a
    root: ``dask shm clean`` removes it."""

    #: "tier <n>": the root of file tier n (see :mod:`dask_shm.shared.tiers`;
    #: tier 2 is the shared-memory root, tier 3 the disk root)
    tier: str
    root: str
    #: Directories of dead processes and the bytes removing them gives back
    #: (0 and 0 when the root or this user's directory there does not exist).
    directories: int
    bytes: int
    #: Why the root could not be examined (then the counts are 0), or None.
    error: str | None = None


@dataclass
class HostInfo:
    """Everything ``dask-shm info`` found; ``problems`` (a list of
    :class:`dask_shm.info.checks.Problem`) is derived from the rest."""

    #: ``platform.system()``: "Linux", "Darwin", "Windows", ...
    platform: str
    is_linux: bool
    #: The shared-memory root as configured or given, and its resolved path.
    root: str
    root_realpath: str
    root_exists: bool
    root_is_dir: bool
    #: Mount point and filesystem type holding the root (None if unknown).
    mount_point: str | None
    fs_type: str | None
    #: Whether ``fs_type`` is one shared-memory mode accepts
    #: (``dask_shm._core.is_ram_backed``: tmpfs, ramfs, hugetlbfs).
    on_tmpfs: bool
    #: Size of and space available to this user on the root's filesystem.
    total_bytes: int | None
    free_bytes: int | None
    #: Whether a file could be created in the root (None: not tried), and
    #: if not, why (message and errno: EROFS, EACCES, ...).
    writable: bool | None
    writable_error: str | None
    #: ``<root>/dask-shm-<uid>`` and what keeps dask-shm from using it ("" if
    #: nothing, including when it does not exist yet).
    user_dir: str | None
    user_dir_problem: str
    #: RAM of the host and ``MemTotal - MemAvailable``.
    memory_total: int | None
    memory_used: int | None
    #: RLIMIT_NOFILE of this process (None: unknown on this platform).
    open_files: OpenFilesLimit | None
    #: vm.max_map_count as the shared store reads it (None: not Linux).
    max_map_count: int | None
    #: ``dask.config.get("shm")`` over the shipped defaults (a deep copy).
    config: dict[str, Any]
    #: The validated ``shm.shared-memory.*`` settings (None if invalid).
    settings: SharedMemorySettings | None
    #: ValueError messages of invalid ``shm.*`` config values.
    config_errors: list[str]
    #: :func:`dask_shm.shared.limits.summary` for the root: the memory cgroup
    #: (None outside one), the memory this process may use and the tier-2
    #: budget a worker without a memory limit would get (None if unknown).
    limits: dict[str, Any] | None = None
    #: Dead processes' files on the shared-memory root and on the disk root.
    dead_files: list[DeadFiles] = field(default_factory=list)
    scheduler_address: str | None = None
    scheduler_error: str | None = None
    workers: list[WorkerInfo] = field(default_factory=list)
    problems: list[Any] = field(default_factory=list)
    writable_errno: int | None = None
    #: Versions of dask, distributed and dask-shm ("unknown" if unreadable).
    versions: dict[str, str] = field(default_factory=dict)
    #: Every distributed internal dask-shm hooks, present or not.
    hooks: list[HookStatus] = field(default_factory=list)
    #: Whether a shared-mode worker on the root would have arrays born shared,
    #: and why: "on: ..." or "off: ..." (None: not Linux, not a tmpfs
    #: directory, or an invalid ``born-*`` value, which ``config_errors`` names).
    born_shared: str | None = None


def configured_root() -> str:
    """``shm.shared-memory.root``; when the config is invalid, the raw
    configured root (or the default), so that it can still be inspected."""
    try:
        return SharedMemorySettings.from_config().root
    except ValueError:
        raw = configured("shm.shared-memory.root")
        if isinstance(raw, str) and raw:
            return raw
        return str(DEFAULTS["shm"]["shared-memory"]["root"])


def _probe_writable(directory: str) -> tuple[bool, str | None, int | None]:
    """(writable, why not, errno) from creating and removing an empty file."""
    try:
        fd, path = tempfile.mkstemp(prefix=".dask-shm-info-", dir=directory)
    except OSError as e:
        name = errno.errorcode.get(e.errno or 0, type(e).__name__)
        return False, f"{name}: {e.strerror or e}", e.errno
    os.close(fd)
    os.unlink(path)
    return True, None, None


def versions() -> dict[str, str]:
    """Versions of dask, distributed and dask-shm (the package, else the
    extension's)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("dask", "distributed", "dask-shm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    if found["dask-shm"] == "unknown":
        import dask_shm

        found["dask-shm"] = str(getattr(dask_shm, "__version__", "unknown"))
    return found


def hook_status() -> list[HookStatus]:
    """Every hooked distributed internal and whether it is present."""
    from dask_shm.compat import HOOKS, missing_hooks

    missing = {hook.where for hook in missing_hooks()}
    return [HookStatus(h.where, h.used_by, h.where not in missing) for h in HOOKS]


def _open_files_limit() -> OpenFilesLimit | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def norm(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY else v

    return OpenFilesLimit(norm(soft), norm(hard))


def _memory() -> tuple[int | None, int | None]:
    try:
        import psutil

        from dask_shm.procmem import host_memory_used

        return int(psutil.virtual_memory().total), host_memory_used()
    except Exception:
        return None, None


def _config_errors() -> tuple[SharedMemorySettings | None, BornSettings | None, list[str]]:
    """The validated shared-memory and born-shared settings (None where
    invalid) and the messages of every invalid ``shm.*`` value."""
    from dask_shm.local import config as local_config

    errors: list[str] = [
        f"config {key} is not a dask-shm setting (a typo? see dask-shm-schema.yaml); it is ignored"
        for key in unknown_keys()
    ]
    settings: SharedMemorySettings | None = None
    try:
        settings = SharedMemorySettings.from_config()
    except ValueError as e:
        errors.append(str(e))
    born: BornSettings | None = None
    try:
        born = BornSettings.from_config()
    except ValueError as e:
        errors.append(str(e))
    for switch in SWITCHES:
        try:
            enabled(switch)
        except ValueError as e:
            errors.append(str(e))
    for check in (
        local_config.shm_threshold,
        local_config.memory_target,
        local_config.spill_directory,
        local_config.shm_directory_base,
    ):
        try:
            check()
        except ValueError as e:
            errors.append(str(e))
    # once each (a section set to a scalar fails every check that reads under it)
    return settings, born, list(dict.fromkeys(errors))


def dead_files(tier: str, root: str) -> DeadFiles:
    """:class:`DeadFiles` of this user's directory under ``root``; never raises."""
    try:
        found = reclaimable(root)
    except (OSError, UnusableRoot) as e:
        return DeadFiles(tier, root, 0, 0, str(e))
    return DeadFiles(tier, root, len(found.directories), found.bytes)


def _worker_report(dask_worker: Any) -> dict[str, Any]:
    """Run on each worker by :func:`ask_workers`."""
    from distributed.spill import SpillBuffer as StockSpillBuffer

    from dask_shm.spill import SpillBuffer

    data = dask_worker.data
    requested = configured("shm.shared-memory.enabled")
    published = dask_worker.metrics.get("shm")
    figures = published(dask_worker) if callable(published) else None
    preloaded = preloaded_plugins(dask_worker)
    active = PLUGIN_NAME in dask_worker.plugins or PLUGIN_NAME in preloaded
    kept = requested is True and not active and not isinstance(data, StockSpillBuffer | SpillBuffer)
    # The instance that installed the mode: the preload's, or a registered one.
    instances = (dask_worker.plugins.get(PLUGIN_NAME), preloaded.get(PLUGIN_NAME))
    born_states = [getattr(plugin, "born_state", None) for plugin in instances]
    return {
        "born_shared": next((state for state in born_states if state is not None), None),
        "p2p_by_file": p2p.by_file(dask_worker.address) if active else None,
        "plugin_active": active,
        "data_class": f"{type(data).__module__}.{type(data).__qualname__}",
        "requested": requested if isinstance(requested, bool) else None,
        "metrics": figures,
        "kept_mapping": kept_data_mapping(dask_worker)[0] if kept else None,
    }


async def _run_on_workers(address: str, timeout: float) -> dict[str, Any]:
    from distributed import Client

    # An asynchronous client on our own loop: a synchronous Client that fails
    # to connect blocks for 20 s in __del__ trying to close itself.
    client = Client(address, asynchronous=True, timeout=timeout, set_as_default=False)
    try:
        await client
        return await client.run(_worker_report, on_error="return")
    finally:
        await client.close()


def ask_workers(address: str, timeout: float) -> tuple[str | None, list[WorkerInfo]]:
    """(error, workers) of the scheduler at ``address``; never raises."""

    def ask() -> dict[str, Any]:
        bound = timeout + 30  # connecting, then a trivial call on every worker
        return asyncio.run(asyncio.wait_for(_run_on_workers(address, timeout), bound))

    # In a thread of its own, so that this also works under a running event
    # loop (e.g. in Jupyter).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dask-shm-info") as pool:
        try:
            results = pool.submit(ask).result()
        except Exception as e:
            return f"{type(e).__name__}: {e}", []
    workers = []
    for worker, result in sorted(results.items()):
        if isinstance(result, BaseException):
            error = f"{type(result).__name__}: {result}"
            workers.append(WorkerInfo(worker, None, None, error))
        else:
            figures = result.get("metrics") or {}
            tiers = file_tiers(figures)
            numbered = {tier.number: tier for tier in tiers}
            tier2, tier3 = numbered.get(FIRST_FILE_TIER), numbered.get(FIRST_FILE_TIER + 1)
            memory = figures.get("memory_bytes")
            workers.append(
                WorkerInfo(
                    worker,
                    result["plugin_active"],
                    result["data_class"],
                    requested=result.get("requested"),
                    tier1_bytes=None if memory is None else int(memory),
                    file_tiers=tiers,
                    tier2_bytes=None if tier2 is None else tier2.bytes,
                    tier3_bytes=None if tier3 is None else tier3.bytes,
                    tier2_budget=None if tier2 is None else tier2.budget,
                    kept_mapping=result.get("kept_mapping"),
                    born_shared=result.get("born_shared"),
                    p2p_by_file=result.get("p2p_by_file"),
                )
            )
    return None, workers


def gather_facts(
    root: str | None = None,
    scheduler_address: str | None = None,
    *,
    timeout: float = 10.0,
) -> HostInfo:
    """The facts of this host (and, given ``scheduler_address``, of that
    scheduler's workers), with ``problems`` left empty. See
    :func:`dask_shm.info.collect_info` for the arguments. Never raises for
    what it finds."""
    is_linux = platform.system() == "Linux"
    if root is None:
        root = configured_root()
    exists = os.path.exists(root)
    is_dir = os.path.isdir(root)
    mount = filesystem_of(root) if exists else None
    total = free = None
    writable: bool | None = None
    writable_error: str | None = None
    writable_errno: int | None = None
    user_dir: str | None = None
    user_problem = ""
    if is_dir:
        try:
            st = os.statvfs(root)
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        except OSError:
            pass
        writable, writable_error, writable_errno = _probe_writable(root)
        if hasattr(os, "geteuid"):
            user_dir = user_dir_path(root)
            user_problem = user_dir_problem(user_dir)
    memory_total, memory_used = _memory()
    settings, born, config_errors = _config_errors()
    config = configured_namespace()
    info = HostInfo(
        platform=platform.system() or "unknown",
        is_linux=is_linux,
        root=root,
        root_realpath=os.path.realpath(root),
        root_exists=exists,
        root_is_dir=is_dir,
        mount_point=mount[0] if mount else None,
        fs_type=mount[1] if mount else None,
        on_tmpfs=is_dir and is_ram_backed(root),
        total_bytes=total,
        free_bytes=free,
        writable=writable,
        writable_error=writable_error,
        user_dir=user_dir,
        user_dir_problem=user_problem,
        memory_total=memory_total,
        memory_used=memory_used,
        open_files=_open_files_limit(),
        max_map_count=max_map_count() if is_linux else None,
        config=copy.deepcopy(dict(config)) if isinstance(config, Mapping) else {},
        settings=settings,
        config_errors=config_errors,
        scheduler_address=scheduler_address,
        writable_errno=writable_errno,
        versions=versions(),
        hooks=hook_status(),
    )
    if is_linux and is_dir:
        try:
            info.limits = summary(root, settings.max_bytes if settings else None)
        except OSError:
            info.limits = None
        if born is not None and info.on_tmpfs:
            on, why = born.decision(root)
            info.born_shared = f"{'on' if on else 'off'}: {why}"
    if hasattr(os, "geteuid"):
        # Without a valid config only the root given (or the default) is known.
        specs = tiers_of(settings, root) if settings is not None else None
        roots = [s.root for s in specs] if specs is not None else [root]
        info.dead_files = [
            dead_files(f"tier {number}", where)
            for number, where in enumerate(roots, FIRST_FILE_TIER)
        ]
    if scheduler_address is not None:
        info.scheduler_error, info.workers = ask_workers(scheduler_address, timeout)
    return info
