"""Judging the facts of :mod:`dask_shm.info.facts`: a list of :class:`Problem`
s, each with a fix. Problems are warnings: nothing here changes the system."""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Any, NamedTuple

from dask.utils import format_bytes

from dask_shm.info.facts import PLUGIN_NAME, HostInfo
from dask_shm.shared.limits import SMALL_ROOT_ADVICE, small_root_message
from dask_shm.shared.paths import NOT_TMPFS_ADVICE, NOT_WRITABLE_ADVICE, READ_ONLY_ADVICE
from dask_shm.shared.store import mapped_values_bound
from dask_shm.sysctl import DEFAULT_MAX_MAP_COUNT

#: Below this soft RLIMIT_NOFILE a warning is given.
MIN_OPEN_FILES = 4096
#: Size of a shared value assumed when estimating how many mappings a worker
#: needs: small for Dask chunks (``array.chunk-size`` is 128 MiB), so the
#: estimate errs on the side of warning.
TYPICAL_VALUE_BYTES = 2**20


class Problem(NamedTuple):
    """Something that keeps shared-memory mode from working (well), and how
    to fix it. ``kind`` is a stable identifier for programs and tests:
    ``root-missing``, ``root-not-directory``, ``root-not-tmpfs``,
    ``root-filesystem-unknown``, ``root-read-only``, ``root-not-writable``,
    ``root-low-space`` (as small as the worker warns about: tier 3 takes over),
    ``user-directory``, ``open-files``, ``max-map-count``, ``platform``,
    ``config``, ``scheduler``, ``no-workers``, ``plugin``, ``plugin-data-mapping``,
    ``worker-check``,
    ``distributed-hooks``."""

    message: str
    fix: str
    kind: str = ""


def _hook_problems(info: HostInfo) -> list[Problem]:
    version = info.versions.get("distributed", "unknown")
    return [
        Problem(
            f"distributed {version} lacks {hook.where}, which dask-shm hooks: "
            f"{hook.used_by} will not work",
            "install a distributed version within the range dask-shm declares "
            "(`pip install dask-shm` resolves one) or upgrade dask-shm",
            "distributed-hooks",
        )
        for hook in info.hooks
        if not hook.present
    ]


def _shareable_bytes(info: HostInfo) -> int | None:
    """What one worker could hold in shared memory at most: the root's
    filesystem size, bounded by RAM."""
    sizes = [v for v in (info.total_bytes if info.on_tmpfs else None, info.memory_total) if v]
    return min(sizes) if sizes else None


class MapBudget(NamedTuple):
    """The mappings a worker may hold, by kind; their sum stays well below
    ``vm.max_map_count`` (the rest is the interpreter's and libraries')."""

    #: values held in memory through a mapping of their file
    #: (:func:`~dask_shm.shared.store.mapped_values_bound`)
    values: int
    #: born-shared blocks (:func:`dask_shm.shared.born.default_max_blocks`)
    blocks: int

    @property
    def total(self) -> int:
        return self.values + self.blocks


def worker_map_budget(max_map_count: int) -> MapBudget:
    """What one worker process could map under ``max_map_count``."""
    return MapBudget(mapped_values_bound(max_map_count), max_map_count // 4)


def expected_mappings(info: HostInfo) -> int | None:
    """Mappings a worker would need to hold all the shared memory this host
    has in values of :data:`TYPICAL_VALUE_BYTES` mapped at once (None if
    unknown); beyond :func:`worker_map_budget`'s ``values`` the least recently
    used are mapped again when used."""
    shareable = _shareable_bytes(info)
    return None if shareable is None else -(-shareable // TYPICAL_VALUE_BYTES)


def _config_key(message: str) -> str | None:
    match = re.search(r"\bshm(?:\.[A-Za-z0-9_-]+)+", message)
    return match.group(0) if match else None


def _env_var(key: str) -> str:
    return "DASK_" + key.upper().replace(".", "__").replace("-", "_")


def find_problems(info: HostInfo) -> list[Problem]:
    """The problems in ``info``'s facts, each with a fix, in a stable order."""
    problems: list[Problem] = _hook_problems(info)
    add = problems.append
    set_root = "or " + NOT_TMPFS_ADVICE

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
            # Not "mount a tmpfs there": it may be /tmp, where tier 3 lives.
            add(
                Problem(
                    f"the shared-memory root {root} is on {info.fs_type} (mounted on "
                    f"{info.mount_point}), not a tmpfs: a worker refuses it and spills "
                    "privately (to disk)",
                    f"{NOT_TMPFS_ADVICE} (check it with `dask shm info --root /dev/shm`)",
                    "root-not-tmpfs",
                )
            )
        if info.writable is False:
            add(_unwritable(info))
        budget = info.limits["budget"] if info.limits is not None else None
        if info.writable and info.on_tmpfs and budget is not None and budget["small_root"]:
            # The worker's own warning and advice (shared/plugin.py).
            free = (info.limits or {}).get("tmpfs") or {}
            add(
                Problem(
                    small_root_message(root, free.get("free", info.free_bytes or 0))
                    + f"; a worker's tier-2 budget is {format_bytes(budget['limit'])}",
                    f"to share more in memory, {SMALL_ROOT_ADVICE}",
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

    if info.max_map_count is not None:
        budget = worker_map_budget(info.max_map_count)
        if budget.values < mapped_values_bound(DEFAULT_MAX_MAP_COUNT):
            add(
                Problem(
                    f"vm.max_map_count is {info.max_map_count}, below the kernel's default of "
                    f"{DEFAULT_MAX_MAP_COUNT}: a worker keeps at most {budget.values:,} shared "
                    f"values mapped (an eighth of it) and maps the others again each time they "
                    f"are used, and holds at most {budget.blocks:,} born-shared blocks",
                    f"`sysctl -w vm.max_map_count={DEFAULT_MAX_MAP_COUNT}` or more as root "
                    "(persist it in /etc/sysctl.d/); nothing breaks without it, reads only "
                    "get slower",
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
        # Off is a problem only where the worker's config asked for it
        # (shm.shared-memory.enabled: true): then the worker fell back.
        kept = [w for w in info.workers if w.kept_mapping is not None]
        if kept:
            add(
                Problem(
                    f"{len(kept)} of {len(info.workers)} worker(s) have "
                    "shm.shared-memory.enabled: true but share nothing: "
                    f"{_some(w.address for w in kept)}: {kept[0].kept_mapping}",
                    "start the workers with a memory limit (`dask worker --memory-limit`, "
                    "`LocalCluster(memory_limit=...)`) and distributed.worker.memory.target "
                    "or .spill on: distributed then gives them a spill buffer, which "
                    "shared-memory mode replaces; a data mapping of your own is kept unless "
                    "you register dask_shm.SharedMemoryPlugin()",
                    "plugin-data-mapping",
                )
            )
        without = [
            w
            for w in info.workers
            if w.plugin_active is False and w.requested and w.kept_mapping is None
        ]
        if without:
            add(
                Problem(
                    f"{len(without)} of {len(info.workers)} worker(s) have "
                    "shm.shared-memory.enabled: true but not the shared-memory plugin "
                    f"({PLUGIN_NAME}) active: {_some(w.address for w in without)}",
                    "start the workers with `--preload dask_shm` (or "
                    "distributed.worker.preload: [dask_shm]); if they have it, their log "
                    "says why they spill privately (a WARNING from dask_shm)",
                    "plugin",
                )
            )
    return problems


def _unwritable(info: HostInfo) -> Problem:
    """The problem of a root no file can be created in, told apart by cause."""
    root, why = info.root, info.writable_error
    if info.writable_errno == errno.EROFS:
        return Problem(
            f"the shared-memory root {root} is on a read-only file system (mounted on "
            f"{info.mount_point}; {why})",
            READ_ONLY_ADVICE.replace("<mount point>", info.mount_point or root),
            "root-read-only",
        )
    if info.writable_errno in (errno.EACCES, errno.EPERM):
        try:
            st = os.stat(root)
            owner = f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"
        except OSError:
            owner = "owner unknown"
        return Problem(
            f"this user (uid {os.geteuid()}) may not create files in the shared-memory root "
            f"{root} ({owner}; {why})",
            NOT_WRITABLE_ADVICE.replace("<root>", root),
            "root-not-writable",
        )
    return Problem(
        f"cannot create files in the shared-memory root {root} ({why})",
        f"fix the cause above or {NOT_TMPFS_ADVICE}",
        "root-not-writable",
    )


def _some(items: Any, limit: int = 5) -> str:
    items = list(items)
    text = ", ".join(items[:limit])
    if len(items) > limit:
        text += f" and {len(items) - limit} more"
    return text
