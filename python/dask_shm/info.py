"""What ``dask-shm info`` reports: is this host ready for shared-memory mode?

:func:`collect_info` gathers the facts as data (:class:`HostInfo`) and a list
of :class:`Problem` s, each with a fix; :func:`format_info` renders them as
text. Problems are warnings: nothing here changes the system, and the command
exits 0 whatever it finds.

Checked: the shared-memory root (``shm.shared-memory.root``, default
``/dev/shm``) exists, is on a tmpfs, is writable and has room; the per-user
directory under it (``dask-shm-<uid>``) is safe if it exists; the open-files
limit and ``vm.max_map_count`` (each shared value a worker holds costs a file
descriptor or a mapping); the platform (shared memory needs Linux); the
``shm`` config validates; and, given a scheduler address, which workers have
the shared-memory plugin installed.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import copy
import os
import platform
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import dask.config
from dask.utils import format_bytes

from dask_shm.config import DEFAULTS, SWITCHES, SharedMemorySettings, enabled
from dask_shm.shared.paths import TMPFS_TYPES, filesystem_of

__all__ = [
    "PLUGIN_NAME",
    "HostInfo",
    "OpenFilesLimit",
    "Problem",
    "WorkerInfo",
    "add_info_parser",
    "collect_info",
    "filesystem_of",
    "format_info",
]

#: Name under which the shared-memory worker plugin registers itself (kept
#: equal to dask_shm.shared.plugin.PLUGIN_NAME, without importing the plugin).
PLUGIN_NAME = "dask-shm-shared-memory"

#: Below this soft RLIMIT_NOFILE a warning is given.
MIN_OPEN_FILES = 4096
#: Below this vm.max_map_count a warning is given.
MIN_MAX_MAP_COUNT = 262144
#: Free space on the root below max(this, MIN_FREE_FRACTION of RAM) is a warning.
MIN_FREE_BYTES = 2**30
MIN_FREE_FRACTION = 0.1


class Problem(NamedTuple):
    """Something that keeps shared-memory mode from working (well), and how
    to fix it. ``kind`` is a stable identifier for programs and tests:
    ``root-missing``, ``root-not-directory``, ``root-not-tmpfs``,
    ``root-filesystem-unknown``, ``root-not-writable``, ``root-low-space``,
    ``user-directory``, ``open-files``, ``max-map-count``, ``platform``,
    ``config``, ``scheduler``, ``no-workers``, ``plugin``, ``worker-check``."""

    message: str
    fix: str
    kind: str = ""


class OpenFilesLimit(NamedTuple):
    """RLIMIT_NOFILE; None means unlimited."""

    soft: int | None
    hard: int | None


@dataclass
class WorkerInfo:
    """One worker as seen through the scheduler."""

    address: str
    #: Whether the plugin named :data:`PLUGIN_NAME` is installed; None when
    #: the worker could not be asked (see ``error``).
    plugin_active: bool | None
    #: Class of the worker's ``data`` mapping, e.g. ``dask_shm.spill.SpillBuffer``.
    data_class: str | None
    error: str | None = None


@dataclass
class HostInfo:
    """Everything ``dask-shm info`` found; ``problems`` is derived from the rest."""

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
    #: Whether ``fs_type`` is one shared-memory mode accepts (tmpfs; also
    #: ramfs and hugetlbfs, like :func:`dask_shm.shared.paths.check_root`).
    on_tmpfs: bool
    #: Size of and space available to this user on the root's filesystem.
    total_bytes: int | None
    free_bytes: int | None
    #: Whether a file could be created in the root (None: not tried).
    writable: bool | None
    writable_error: str | None
    #: ``<root>/dask-shm-<uid>`` and what keeps dask-shm from using it ("" if
    #: nothing, including when it does not exist yet): a symbolic link, not a
    #: directory, or owned by someone else.
    user_dir: str | None
    user_dir_problem: str
    #: RAM of the host and ``MemTotal - MemAvailable``.
    memory_total: int | None
    memory_used: int | None
    #: RLIMIT_NOFILE of this process (None: unknown on this platform).
    open_files: OpenFilesLimit | None
    #: /proc/sys/vm/max_map_count (None: unknown).
    max_map_count: int | None
    #: ``dask.config.get("shm")`` (a deep copy).
    config: dict[str, Any]
    #: The validated ``shm.shared-memory.*`` settings (None if invalid).
    settings: SharedMemorySettings | None
    #: ValueError messages of invalid ``shm.*`` config values.
    config_errors: list[str]
    scheduler_address: str | None = None
    scheduler_error: str | None = None
    workers: list[WorkerInfo] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


# --------------------------------------------------------------------- facts


def _configured_root() -> str:
    try:
        return SharedMemorySettings.from_config().root
    except ValueError:
        raw = dask.config.get("shm.shared-memory.root", default=None)
        if isinstance(raw, str) and raw:
            return raw
        return str(DEFAULTS["shm"]["shared-memory"]["root"])


def _probe_writable(directory: str) -> tuple[bool, str | None]:
    try:
        fd, path = tempfile.mkstemp(prefix=".dask-shm-info-", dir=directory)
    except OSError as e:
        return False, f"{type(e).__name__}: {e.strerror or e}"
    os.close(fd)
    os.unlink(path)
    return True, None


def _user_dir_problem(user_dir: str) -> str:
    try:
        st = os.lstat(user_dir)
    except FileNotFoundError:
        return ""  # created 0700 when first needed
    except OSError as e:
        return f"cannot be inspected ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    return ""  # a wrong mode is fixed (chmod 0700) when it is next used


def _open_files_limit() -> OpenFilesLimit | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def norm(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY else v

    return OpenFilesLimit(norm(soft), norm(hard))


def _max_map_count() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _memory() -> tuple[int | None, int | None]:
    try:
        import psutil

        from dask_shm.procmem import host_memory_used

        return int(psutil.virtual_memory().total), host_memory_used()
    except Exception:
        return None, None


def _config_errors() -> tuple[SharedMemorySettings | None, list[str]]:
    from dask_shm.local import config as local_config

    errors: list[str] = []
    settings: SharedMemorySettings | None = None
    try:
        settings = SharedMemorySettings.from_config()
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
    return settings, errors


def _worker_report(dask_worker: Any) -> dict[str, Any]:
    """Run on each worker by :func:`collect_info`."""
    data = dask_worker.data
    return {
        "plugin_active": PLUGIN_NAME in dask_worker.plugins,
        "data_class": f"{type(data).__module__}.{type(data).__qualname__}",
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


def _ask_workers(address: str, timeout: float) -> tuple[str | None, list[WorkerInfo]]:
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
            workers.append(WorkerInfo(worker, result["plugin_active"], result["data_class"]))
    return None, workers


def collect_info(
    root: str | None = None,
    scheduler_address: str | None = None,
    *,
    timeout: float = 10.0,
) -> HostInfo:
    """Inspect this host (and, given ``scheduler_address``, the workers of that
    scheduler) for shared-memory mode.

    ``root`` defaults to ``shm.shared-memory.root`` (``/dev/shm``); if the
    config is invalid, the raw configured root is still inspected. Connecting
    to the scheduler waits up to ``timeout`` seconds; failing to connect is
    reported in ``scheduler_error`` and as a problem. Never raises for what it
    finds; nothing on the system is changed (writability is probed by
    creating and removing an empty file in the root).
    """
    is_linux = platform.system() == "Linux"
    if root is None:
        root = _configured_root()
    realpath = os.path.realpath(root)
    exists = os.path.exists(root)
    is_dir = os.path.isdir(root)
    mount = filesystem_of(root) if exists else None
    total = free = None
    writable: bool | None = None
    writable_error: str | None = None
    user_dir: str | None = None
    user_dir_problem = ""
    if is_dir:
        try:
            st = os.statvfs(root)
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        except OSError:
            pass
        writable, writable_error = _probe_writable(root)
        if hasattr(os, "geteuid"):
            user_dir = os.path.join(root, f"dask-shm-{os.geteuid()}")
            user_dir_problem = _user_dir_problem(user_dir)
    memory_total, memory_used = _memory()
    settings, config_errors = _config_errors()
    # Shipped defaults under what is set: a config reset after import (test
    # harnesses do that) drops the registered defaults but not their effect.
    from dask_shm.config import DEFAULTS

    config = dask.config.merge(DEFAULTS["shm"], dask.config.get("shm", default={}))
    info = HostInfo(
        platform=platform.system() or "unknown",
        is_linux=is_linux,
        root=root,
        root_realpath=realpath,
        root_exists=exists,
        root_is_dir=is_dir,
        mount_point=mount[0] if mount else None,
        fs_type=mount[1] if mount else None,
        on_tmpfs=mount is not None and mount[1] in TMPFS_TYPES,
        total_bytes=total,
        free_bytes=free,
        writable=writable,
        writable_error=writable_error,
        user_dir=user_dir,
        user_dir_problem=user_dir_problem,
        memory_total=memory_total,
        memory_used=memory_used,
        open_files=_open_files_limit(),
        max_map_count=_max_map_count() if is_linux else None,
        config=copy.deepcopy(dict(config)) if isinstance(config, Mapping) else {},
        settings=settings,
        config_errors=config_errors,
        scheduler_address=scheduler_address,
    )
    if scheduler_address is not None:
        info.scheduler_error, info.workers = _ask_workers(scheduler_address, timeout)
    info.problems = _find_problems(info)
    return info


# ------------------------------------------------------------------ problems


def _config_key(message: str) -> str | None:
    match = re.search(r"\bshm(?:\.[A-Za-z0-9_-]+)+", message)
    return match.group(0) if match else None


def _env_var(key: str) -> str:
    return "DASK_" + key.upper().replace(".", "__").replace("-", "_")


def _find_problems(info: HostInfo) -> list[Problem]:
    problems: list[Problem] = []
    add = problems.append
    set_root = "or set shm.shared-memory.root to a directory on a tmpfs such as /dev/shm"

    if not info.is_linux:
        add(
            Problem(
                f"shared-memory mode needs Linux; on {info.platform} workers fall back to "
                "private (copying) spilling",
                "nothing to do for correctness; run the workers on Linux to share memory "
                "between them",
                "platform",
            )
        )

    root = info.root
    if not info.root_exists:
        add(
            Problem(
                f"the shared-memory root {root} does not exist",
                f"create it (on a tmpfs: `mkdir -p {root} && mount -t tmpfs -o size=50% "
                f"tmpfs {root}` as root) {set_root}",
                "root-missing",
            )
        )
    elif not info.root_is_dir:
        add(
            Problem(
                f"the shared-memory root {root} is not a directory",
                f"remove it and create a directory on a tmpfs there, {set_root}",
                "root-not-directory",
            )
        )
    else:
        if info.fs_type is None:
            if info.is_linux:
                add(
                    Problem(
                        f"could not tell which filesystem holds {root} (/proc/mounts unreadable)",
                        f"check with `df -T {root}` that it is a tmpfs",
                        "root-filesystem-unknown",
                    )
                )
        elif not info.on_tmpfs:
            add(
                Problem(
                    f"the shared-memory root {root} is on {info.fs_type} (mounted on "
                    f"{info.mount_point}), not on a tmpfs: spilled values would be written "
                    "to disk and mapping them shares nothing in RAM",
                    f"mount a tmpfs there (`mount -t tmpfs -o size=50% tmpfs {root}` as "
                    f"root) {set_root}",
                    "root-not-tmpfs",
                )
            )
        if info.writable is False:
            add(
                Problem(
                    f"cannot create files in the shared-memory root {root} ({info.writable_error})",
                    f"make it writable for this user (e.g. `chmod 1777 {root}` as root, like "
                    f"/dev/shm) {set_root}",
                    "root-not-writable",
                )
            )
        if info.free_bytes is not None and info.memory_total is not None:
            threshold = max(MIN_FREE_BYTES, int(MIN_FREE_FRACTION * info.memory_total))
            if info.free_bytes < threshold:
                add(
                    Problem(
                        f"only {format_bytes(info.free_bytes)} free on {root} (less than "
                        f"{format_bytes(threshold)}: {MIN_FREE_FRACTION:.0%} of RAM, at least "
                        f"{format_bytes(MIN_FREE_BYTES)}); spilling there will fail early",
                        f"remove stale files there, enlarge the tmpfs (`mount -o remount,"
                        f"size=50% {info.mount_point or root}` as root) {set_root}",
                        "root-low-space",
                    )
                )
        if info.user_dir_problem:
            add(
                Problem(
                    f"the per-user directory {info.user_dir} {info.user_dir_problem}; "
                    "dask-shm will not use it",
                    "remove it (or have its owner or an administrator remove it) so that "
                    f"dask-shm creates it again with mode 0700, {set_root}",
                    "user-directory",
                )
            )

    limit = info.open_files
    if limit is not None and limit.soft is not None and limit.soft < MIN_OPEN_FILES:
        hard = "unlimited" if limit.hard is None else str(limit.hard)
        fix = (
            "raise it in the shell or service that starts the workers: `ulimit -n 65536`"
            " (systemd: LimitNOFILE=65536)"
        )
        if limit.hard is not None and limit.hard < 65536:
            fix += (
                f"; the hard limit is {hard}, so raise that first (/etc/security/limits.conf"
                f" or LimitNOFILE=) or use `ulimit -n {limit.hard}`"
            )
        add(
            Problem(
                f"the soft limit on open files (RLIMIT_NOFILE) is {limit.soft} (hard: {hard}), "
                f"below {MIN_OPEN_FILES}: workers holding many shared values may run out of "
                "file descriptors",
                fix,
                "open-files",
            )
        )

    if info.max_map_count is not None and info.max_map_count < MIN_MAX_MAP_COUNT:
        add(
            Problem(
                f"vm.max_map_count is {info.max_map_count}, below {MIN_MAX_MAP_COUNT}: each "
                "mapped value takes at least one memory map; a worker holding very many "
                "falls back to copying once the limit is near",
                f"`sysctl -w vm.max_map_count={MIN_MAX_MAP_COUNT}` as root (persist it in "
                "/etc/sysctl.d/)",
                "max-map-count",
            )
        )

    for message in info.config_errors:
        key = _config_key(message)
        if key is None:
            fix = "correct the shm.* value in your dask config"
        else:
            env = _env_var(key)
            where = (
                f"the environment variable {env} is set to {os.environ[env]!r}: correct or unset it"
                if env in os.environ
                else f"set it in a dask config file (~/.config/dask/*.yaml), with "
                f"dask.config.set, or with the environment variable {env}"
            )
            fix = f"correct {key}; {where}"
        add(Problem(f"invalid config: {message}", fix, "config"))

    address = info.scheduler_address
    if address is not None:
        if info.scheduler_error is not None:
            add(
                Problem(
                    f"could not reach the scheduler at {address}: {info.scheduler_error}",
                    "check the address (e.g. tcp://host:8786), that the scheduler is running "
                    "and that this host can reach it (or pass a longer --timeout)",
                    "scheduler",
                )
            )
        elif not info.workers:
            add(
                Problem(
                    f"the scheduler at {address} has no workers",
                    f"start workers: `dask worker {address} --preload dask_shm`",
                    "no-workers",
                )
            )
        failed = [w for w in info.workers if w.error is not None]
        if failed:
            add(
                Problem(
                    f"could not ask {len(failed)} worker(s) about the plugin: "
                    f"{_some(w.address for w in failed)} ({failed[0].error})",
                    "install the same dask-shm version in the workers' environment",
                    "worker-check",
                )
            )
        without = [w for w in info.workers if w.plugin_active is False]
        if without:
            add(
                Problem(
                    f"{len(without)} of {len(info.workers)} worker(s) do not have the "
                    f"shared-memory plugin ({PLUGIN_NAME}) active: "
                    f"{_some(w.address for w in without)}",
                    "start the workers with `--preload dask_shm` and "
                    "shm.shared-memory.enabled: true (e.g. "
                    "DASK_SHM__SHARED_MEMORY__ENABLED=True)",
                    "plugin",
                )
            )
    return problems


def _some(items: Any, limit: int = 5) -> str:
    items = list(items)
    text = ", ".join(items[:limit])
    if len(items) > limit:
        text += f" and {len(items) - limit} more"
    return text


# ---------------------------------------------------------------- formatting


def _bytes(value: int | None) -> str:
    return "unknown" if value is None else format_bytes(value)


def _flatten(config: Mapping[str, Any], prefix: str = "shm") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in sorted(config.items(), key=lambda kv: str(kv[0])):
        # dask treats "_" and "-" in keys alike; environment variables give "_"
        name = f"{prefix}.{str(key).replace('_', '-')}"
        if isinstance(value, Mapping):
            items.extend(_flatten(value, name))
        else:
            items.append((name, value))
    return items


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def format_info(info: HostInfo) -> str:
    """``info`` as readable text: sections of facts, then ``Problems:`` with
    one ``- message`` / ``  fix: ...`` pair per problem, or ``No problems found.``"""
    lines: list[str] = []

    def section(title: str, rows: list[tuple[str, str]]) -> None:
        if lines:
            lines.append("")
        lines.append(title)
        width = max((len(k) for k, _ in rows), default=0)
        lines.extend(f"  {k + ':':<{width + 1}} {v}" for k, v in rows)

    platform_note = "shared memory supported" if info.is_linux else "no shared memory"
    memory = (
        f"{_bytes(info.memory_used)} used of {_bytes(info.memory_total)} "
        "(MemTotal - MemAvailable - per-CPU free lists; tmpfs data counts as used)"
    )
    section("Host", [("platform", f"{info.platform} ({platform_note})"), ("memory", memory)])

    rows = [("path", info.root)]
    if info.root_realpath != info.root:
        rows.append(("resolves to", info.root_realpath))
    rows.append(("exists", _yes(info.root_exists)))
    if info.root_exists:
        fs = (
            "unknown" if info.fs_type is None else f"{info.fs_type} (mounted on {info.mount_point})"
        )
        rows.append(("filesystem", fs + ("" if info.on_tmpfs else ", not a tmpfs")))
        rows.append(("size", f"{_bytes(info.total_bytes)}, {_bytes(info.free_bytes)} free"))
        writable = _yes(info.writable)
        if info.writable_error:
            writable += f" ({info.writable_error})"
        rows.append(("writable", writable))
    if info.user_dir is not None:
        state = info.user_dir_problem or (
            "ok" if os.path.lexists(info.user_dir) else "not created yet"
        )
        rows.append(("user directory", f"{info.user_dir}: {state}"))
    section("Shared-memory root", rows)

    if info.open_files is None:
        nofile = "unknown"
    else:
        soft, hard = (("unlimited" if v is None else str(v)) for v in info.open_files)
        nofile = f"soft {soft}, hard {hard}"
    max_map = "unknown" if info.max_map_count is None else str(info.max_map_count)
    section("Limits", [("open files (RLIMIT_NOFILE)", nofile), ("vm.max_map_count", max_map)])

    rows = [(key, repr(value)) for key, value in _flatten(info.config)]
    if info.settings is not None:
        s = info.settings
        rows.append(
            (
                "validated shared-memory settings",
                f"enabled={s.enabled}, root={s.root}, min-size={format_bytes(s.min_size)}, "
                f"min-shared-fraction={s.min_shared_fraction}",
            )
        )
    rows.extend(("invalid", message) for message in info.config_errors)
    section("Config", rows)

    if info.scheduler_address is not None:
        if info.scheduler_error is not None:
            rows = [("error", info.scheduler_error)]
        elif not info.workers:
            rows = [("workers", "none")]
        else:
            rows = []
            for w in info.workers:
                if w.error is not None:
                    rows.append((w.address, f"could not check: {w.error}"))
                else:
                    plugin = "active" if w.plugin_active else "not active"
                    rows.append((w.address, f"plugin {plugin}, data {w.data_class}"))
        section(f"Scheduler {info.scheduler_address}", rows)

    lines.append("")
    if info.problems:
        lines.append("Problems:")
        for problem in info.problems:
            lines.append(f"- {problem.message}")
            lines.append(f"  fix: {problem.fix}")
    else:
        lines.append("No problems found.")
    return "\n".join(lines)


# ----------------------------------------------------------------------- CLI


def add_info_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``info`` subcommand to ``subparsers`` (from
    ``ArgumentParser.add_subparsers``) and return its parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "info",
        help="check this host (and a cluster) for shared-memory mode",
        description="Report the shared-memory root, limits, config and (with --scheduler) "
        "the workers' shared-memory plugin, with a fix for each problem found. Problems "
        "are warnings: the exit code is 0.",
    )
    parser.add_argument(
        "--root",
        default=None,
        metavar="PATH",
        help="shared-memory root to check (default: config shm.shared-memory.root)",
    )
    parser.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="also ask this scheduler's workers whether the shared-memory plugin is active",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to try connecting to the scheduler (default 10)",
    )
    return parser
