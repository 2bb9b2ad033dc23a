"""``dask-shm info`` as text: :func:`format_info`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import yaml
from dask.utils import format_bytes

from dask_shm.info.checks import TYPICAL_VALUE_BYTES, expected_mappings, worker_map_budget
from dask_shm.info.facts import HostInfo, WorkerInfo
from dask_shm.shared.tiers import titles


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


def plain(value: Any) -> str:
    """A config value as it would be written in YAML (``true``, ``null``,
    ``5 s``, ``[a, b]``), not as a Python repr."""
    if isinstance(value, str):
        return value if value else "''"
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6)
    return text.removesuffix("\n...\n").strip()


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def _worker_state(w: WorkerInfo) -> str:
    if w.plugin_active:
        state = "shared-memory plugin active"
    elif w.kept_mapping is not None:
        state = f"shared-memory mode off: {w.kept_mapping}"
    elif w.requested:
        state = "shared-memory plugin NOT active though shm.shared-memory.enabled is true"
    else:
        state = "shared-memory plugin off (shm.shared-memory.enabled is false there)"
    if w.born_shared is not None:
        state += f"; {w.born_shared}"
    if w.p2p_by_file is not None:
        state += "; P2P batches to same-host peers " + ("as files" if w.p2p_by_file else "as bytes")
    if w.tier1_bytes is not None:
        tiers = [f"tier 1 (memory) {format_bytes(w.tier1_bytes)}"]
        for tier in w.file_tiers:
            budget = "" if tier.budget is None else f" of {format_bytes(tier.budget)} budget"
            word = titles(tier.name)[0]
            tiers.append(f"tier {tier.number} ({word}) {format_bytes(tier.bytes)}{budget}")
        state += "; " + ", ".join(tiers)
    return f"{state}; data {w.data_class}"


def as_json(info: HostInfo) -> dict[str, Any]:
    """The facts and problems of ``info`` as JSON-able data: every field of
    :class:`HostInfo` (``problems`` as ``{message, fix, kind}`` objects,
    ``settings`` as an object or null), plus ``ok`` (no problems)."""
    data = dataclasses.asdict(info)
    data["open_files"] = None if info.open_files is None else info.open_files._asdict()
    data["dead_files"] = [d._asdict() for d in info.dead_files]
    data["hooks"] = [h._asdict() for h in info.hooks]
    data["problems"] = [p._asdict() for p in info.problems]
    data["ok"] = not info.problems
    return data


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

    section("Versions", list(info.versions.items()))
    section(
        "Distributed internals dask-shm hooks",
        [
            ("present" if hook.present else "MISSING", f"{hook.where} ({hook.used_by})")
            for hook in info.hooks
        ],
    )

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
    if info.born_shared is not None:
        rows.append(("arrays born shared", info.born_shared))
    section("Shared-memory root", rows)

    if info.dead_files:
        rows = []
        for dead in info.dead_files:
            if dead.error is not None:
                state = f"cannot tell ({dead.error})"
            elif dead.directories:
                state = (
                    f"{format_bytes(dead.bytes)} reclaimable in {dead.directories} "
                    "directories (`dask shm clean` removes them)"
                )
            else:
                state = "0 B reclaimable"
            rows.append((f"{dead.tier} {dead.root}", state))
        section("Dead processes' files", rows)

    if info.open_files is None:
        nofile = "unknown"
    else:
        soft, hard = (("unlimited" if v is None else str(v)) for v in info.open_files)
        nofile = f"soft {soft}, hard {hard}"
    max_map = "unknown" if info.max_map_count is None else str(info.max_map_count)
    expected = expected_mappings(info)
    if info.max_map_count is not None:
        budget = worker_map_budget(info.max_map_count)
        max_map += (
            f" (a worker maps at most {budget.total:,}: {budget.values:,} held values, "
            f"the least recently used beyond that are mapped again on use, and "
            f"{budget.blocks:,} born-shared blocks"
        )
        if expected is not None:
            max_map += (
                f"; all of this host's shared memory in {format_bytes(TYPICAL_VALUE_BYTES)} "
                f"values is {expected:,}"
            )
        max_map += ")"
    limit_rows = [("open files (RLIMIT_NOFILE)", nofile), ("vm.max_map_count", max_map)]
    if info.limits is not None:
        cg = info.limits["cgroup"]
        if cg is None:
            limit_rows.append(("memory cgroup", "none (the host's memory applies)"))
        else:
            usage = "" if cg["usage"] is None else f", {_bytes(cg['usage'])} in use"
            limit_rows.append(
                ("memory cgroup", f"{cg['version']} {cg['path']}: {_bytes(cg['limit'])}{usage}")
            )
        limit_rows.append(("usable memory", _bytes(info.limits["memory_available"])))
        budget = info.limits["budget"]
        limit_rows.append(
            (
                "tier-2 budget",
                f"{_bytes(budget['limit'])} ({budget['reason']}) for a worker without a "
                "memory limit; beyond it files go to disk",
            )
        )
    section("Limits", limit_rows)

    rows = [(key, plain(value)) for key, value in _flatten(info.config)]
    if info.settings is not None:
        s = info.settings
        rows.append(
            (
                "validated shared-memory settings",
                f"enabled={plain(s.enabled)}, root={s.root}, "
                f"min-size={format_bytes(s.min_size)}, "
                f"min-shared-fraction={s.min_shared_fraction}, "
                f"transfer-min-size={format_bytes(s.transfer_min_size)}, "
                f"write-ahead={plain(s.write_ahead)}",
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
                    rows.append((w.address, _worker_state(w)))
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
