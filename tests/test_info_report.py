"""``dask shm info`` says what the worker does and says: fixes by cause on real
roots (a 64 MiB tmpfs, a read-only tmpfs, /tmp), exit status, ``--json``,
versions and hooks, plain config values, and bytes per tier of a real
cluster's workers. Every root is a mount of its own, never the host's
/dev/shm (whose state belongs to others)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import dask
import dask.config
import distributed
import numpy as np
import pytest
from dask.utils import format_bytes
from distributed import Client, LocalCluster
from tmpfs import shmem_forced_huge, small_tmpfs

from dask_shm import SharedMemoryPlugin
from dask_shm._core import is_ram_backed
from dask_shm.compat import HOOKS
from dask_shm.info import collect_info, format_info
from dask_shm.info.render import as_json
from dask_shm.shared import SharedSpillBuffer, limits, paths, plugin

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux (tmpfs)")

ROOT_KINDS = {
    "root-missing",
    "root-not-directory",
    "root-not-tmpfs",
    "root-read-only",
    "root-not-writable",
    "root-low-space",
}


def run_info(*args: str) -> subprocess.CompletedProcess[str]:
    """``dask shm info`` in a fresh process, with no ``shm.*`` environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_SHM__")}
    return subprocess.run(
        [sys.executable, "-m", "dask_shm", "info", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def problems_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("- ")]


@pytest.fixture
def roomy_tmpfs() -> Iterator[str]:
    """A tmpfs large enough that nothing about it is a problem."""
    with small_tmpfs("1g") as path:
        yield path


def test_small_root_says_tier_3_takes_over_as_the_worker_does(caplog, monkeypatch):
    with small_tmpfs("64m") as root:
        proc = run_info("--root", root)
        assert proc.returncode == 1, proc.stderr
        [line] = [p for p in problems_in(proc.stdout) if root in p]
        assert "goes to disk (tier 3)" in line
        assert "fail" not in proc.stdout and "remount" not in proc.stdout
        assert f"fix: to share more in memory, {limits.SMALL_ROOT_ADVICE}" in proc.stdout
        assert "--shm-size" in proc.stdout

        # The worker on the same root: the same facts and the same advice.
        monkeypatch.setattr(plugin, "_warned_small_root", False)
        caplog.set_level(logging.WARNING, logger="dask_shm")
        with (
            dask.config.set({"shm.shared-memory.enabled": True}),
            LocalCluster(
                n_workers=1, processes=False, dashboard_address=":0", silence_logs=False
            ) as cluster,
            Client(cluster) as client,
        ):
            client.register_plugin(SharedMemoryPlugin(root))
        [warning] = [r.getMessage() for r in caplog.records if "tier 3" in r.getMessage()]
        said = line.removeprefix("- ").split("; a worker's")[0]
        assert "goes to disk (tier 3)" in said
        assert said in warning
        assert limits.SMALL_ROOT_ADVICE in warning


def test_read_only_root_is_told_apart_from_permissions_once():
    with small_tmpfs("64m", read_only=True) as root:
        proc = run_info("--root", root)
        assert proc.returncode == 1, proc.stderr
        out = proc.stdout
        [line] = problems_in(out)  # one cause, said once
        assert "read-only file system" in line and "EROFS" in line
        assert "chmod" not in out
        assert f"mount -o remount,rw {root}" in out
        info = collect_info(root)
        assert [p.kind for p in info.problems if p.kind in ROOT_KINDS] == ["root-read-only"]
        # The worker's refusal names the same cause.
        with pytest.raises(paths.UnusableRoot, match="read-only file system"):
            paths.check_root(root)


_INFO_AS = """
import json, os, sys
from dask_shm.info import collect_info
from dask_shm.info.render import as_json
uid, root = int(sys.argv[1]), sys.argv[2]
collect_info(root)  # import everything it needs while still root
os.setegid(uid)
os.seteuid(uid)
json.dump(as_json(collect_info(root)), sys.stdout, default=str)
"""


def _info_as(uid: int, root: str) -> dict:
    """``collect_info(root)`` judged as ``uid``: a fresh interpreter that
    imports as root, then drops its effective ids (Python itself lives where
    that uid cannot read)."""
    proc = subprocess.run(
        [sys.executable, "-c", _INFO_AS, str(uid), root],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_root_without_write_permission_suggests_chmod(roomy_tmpfs):
    locked = os.path.join(roomy_tmpfs, "locked")
    os.mkdir(locked, 0o755)
    nobody = 65534
    data = _info_as(nobody, locked)
    found = {p["kind"]: p for p in data["problems"]}
    assert "root-read-only" not in found
    problem = found["root-not-writable"]
    assert "EACCES" in problem["message"] and f"uid {nobody}" in problem["message"]
    assert f"chmod 1777 {locked}" in problem["fix"]


def test_tmp_root_is_not_told_to_get_a_tmpfs_mounted_over_it():
    if is_ram_backed("/tmp"):
        pytest.skip("/tmp is a tmpfs here")
    proc = run_info("--root", "/tmp")  # where tier 3 lives by default
    assert proc.returncode == 1, proc.stderr
    [line] = problems_in(proc.stdout)
    assert "/tmp" in line and "not a tmpfs" in line
    fix = proc.stdout.split("Problems:")[1].split("fix: ")[1]
    assert "mount" not in fix
    assert fix.startswith("set shm.shared-memory.root to a tmpfs such as /dev/shm")
    with pytest.raises(paths.UnusableRoot) as refused:
        paths.check_root("/tmp")
    assert "mount" not in str(refused.value).split("not tmpfs")[1]
    assert paths.NOT_TMPFS_ADVICE in str(refused.value)


def test_healthy_root_exits_0_with_versions_hooks_and_plain_config(roomy_tmpfs):
    proc = run_info("--root", roomy_tmpfs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.rstrip().endswith("No problems found.")
    assert f"dask:        {dask.__version__}" in out
    assert f"distributed: {distributed.__version__}" in out
    assert "dask-shm:    " in out
    for hook in HOOKS:
        assert f"present: {hook.where}" in out
    config = out.split("\nConfig\n")[1].split("\n\n")[0]
    assert "  shm.amm:" in config and config.split("  shm.amm:")[1].split("\n")[0].strip() == "true"
    assert "shm.shared-memory.disk-root:" in config
    assert config.split("shm.shared-memory.disk-root:")[1].split("\n")[0].strip() == "null"
    assert "'" not in config and "True" not in config and "None" not in config


def test_json_has_the_same_facts_and_the_same_exit_status(roomy_tmpfs):
    healthy = run_info("--root", roomy_tmpfs, "--json")
    assert healthy.returncode == 0, healthy.stderr
    data = json.loads(healthy.stdout)
    assert data["ok"] is True and data["problems"] == []
    assert data["root"] == roomy_tmpfs and data["fs_type"] == "tmpfs"
    assert data["versions"]["distributed"] == distributed.__version__
    assert [h["where"] for h in data["hooks"]] == [h.where for h in HOOKS]
    assert all(h["present"] for h in data["hooks"])
    assert data["config"]["shared-memory"]["enabled"] is False

    with small_tmpfs("64m", read_only=True) as root:
        broken = run_info("--root", root, "--json")
        text = run_info("--root", root)
    assert broken.returncode == text.returncode == 1
    data = json.loads(broken.stdout)
    assert data["ok"] is False
    assert [p["kind"] for p in data["problems"]] == ["root-read-only"]
    [problem] = data["problems"]
    assert f"- {problem['message']}\n  fix: {problem['fix']}" in text.stdout


def test_says_whether_arrays_are_born_shared_on_the_root_and_why():
    forced = shmem_forced_huge()
    with small_tmpfs("1g", huge="within_size") as huge, small_tmpfs("1g") as plain:
        on = run_info("--root", huge)
        off = run_info("--root", plain, "--json")
        with dask.config.set({"shm.shared-memory.born-shared": False}):
            switched_off = collect_info(root=huge)
    assert on.returncode == 0, on.stdout + on.stderr
    assert f"  arrays born shared: on: {huge} serves huge pages (born-shared: auto)\n" in on.stdout
    born = json.loads(off.stdout)["born_shared"]
    if forced:  # the kernel gives every tmpfs huge pages
        assert born.startswith("on: ")
    else:
        assert born.startswith(f"off: {plain} serves no huge pages")
        assert "huge=within_size" in born and "born-shared: true" in born
    assert switched_off.born_shared == "off: shm.shared-memory.born-shared is false"
    assert "arrays born shared: off: shm.shared-memory.born-shared is false" in format_info(
        switched_off
    )


def one_worker_cluster() -> LocalCluster:
    """One in-process worker, reachable from another process over TCP."""
    return LocalCluster(
        n_workers=1,
        processes=False,
        protocol="tcp",
        dashboard_address=":0",
        silence_logs=logging.ERROR,
    )


def _fill_and_evict(dask_worker) -> int:
    """Move everything the worker holds to its spill tiers."""
    moved = 0
    while dask_worker.data.fast:
        dask_worker.data.evict()
        moved += 1
    return moved


def test_scheduler_gives_bytes_per_tier_and_off_is_no_problem_unless_asked(roomy_tmpfs):
    with one_worker_cluster() as cluster:
        # Nothing asked for shared memory: the plugin being off is no problem.
        proc = run_info("--root", roomy_tmpfs, "--scheduler", cluster.scheduler_address)
        assert proc.returncode == 0, proc.stdout
        [worker] = cluster.workers.values()
        assert f"{worker.address}: shared-memory plugin off (shm.shared-memory.enabled" in (
            proc.stdout
        )

        # Asked for but not active (the worker fell back): a problem.
        with dask.config.set({"shm.shared-memory.enabled": True}):
            info = collect_info(roomy_tmpfs, cluster.scheduler_address)
        [problem] = [p for p in info.problems if p.kind == "plugin"]
        assert worker.address in problem.message
        assert "shm.shared-memory.enabled: true" in problem.message

    budget = 3 * 2**20
    with (
        dask.config.set({"shm.shared-memory.enabled": True, "shm.shared-memory.max-bytes": budget}),
        one_worker_cluster() as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(SharedMemoryPlugin(roomy_tmpfs))
        futures = [client.submit(np.full, 2**18, i, key=f"info-x{i}") for i in range(4)]
        client.gather(futures)
        client.run(_fill_and_evict)
        kept = client.submit(np.full, 2**17, 1.0, key="info-kept")  # 1 MiB in memory
        kept.result()
        info = collect_info(roomy_tmpfs, cluster.scheduler_address)
        [w] = info.workers
        assert 2**20 <= w.tier1_bytes < 2 * 2**20
        assert w.plugin_active and w.requested
        assert w.tier2_budget == budget
        # 4 x 2 MiB spilled, a 3 MiB budget: one file in tier 2, the rest on disk.
        assert 2 * 2**20 <= w.tier2_bytes <= budget
        assert w.tier3_bytes >= 6 * 2**20
        assert w.tier2_bytes + w.tier3_bytes >= 8 * 2**20
        shared, disk = w.file_tiers
        assert (shared.name, shared.number, shared.bytes, shared.budget) == (
            "shared",
            2,
            w.tier2_bytes,
            budget,
        )
        assert (disk.name, disk.number, disk.bytes, disk.budget) == ("disk", 3, w.tier3_bytes, None)
        assert disk.moves is not None and shared.moves is None
        text = format_info(info)
        assert (
            f"tier 1 (memory) {format_bytes(w.tier1_bytes)}, "
            f"tier 2 (tmpfs) {format_bytes(w.tier2_bytes)} of {format_bytes(budget)} budget, "
            f"tier 3 (disk) {format_bytes(w.tier3_bytes)}; data "
        ) in text
        assert "plugin" not in {p.kind for p in info.problems}
        # What the worker itself decided about born arrays and P2P batches.
        assert w.p2p_by_file is True
        assert "; P2P batches to same-host peers as files; tier 1 (memory)" in text
        if not shmem_forced_huge():
            assert w.born_shared == (
                f"arrays born shared off: {roomy_tmpfs} serves no huge pages, and "
                "arrays made for peers or spilled would fault fresh 4 KiB tmpfs pages in, "
                "slower than ordinary memory (mount the root with huge=within_size, or set "
                "shm.shared-memory.born-shared: true)"
            )
        assert f"shared-memory plugin active; {w.born_shared}; P2P batches" in text
        client.cancel([*futures, kept])


def test_scheduler_says_which_workers_have_arrays_born_shared():
    # A huge-page root turns born arrays on (born-shared: auto); config
    # switches them off. Each worker's own decision is what info reports.
    with small_tmpfs("1g", huge="within_size") as huge:
        for setting, expected in [
            ("auto", f"arrays of {2**20} bytes or more born shared ("),
            (False, "arrays born shared off: shm.shared-memory.born-shared is false"),
        ]:
            with (
                dask.config.set(
                    {"shm.shared-memory.enabled": True, "shm.shared-memory.born-shared": setting}
                ),
                one_worker_cluster() as cluster,
                Client(cluster) as client,
            ):
                client.register_plugin(SharedMemoryPlugin(huge))
                info = collect_info(huge, cluster.scheduler_address)
                [w] = info.workers
                assert w.plugin_active and w.born_shared is not None
                assert w.born_shared.startswith(expected), w.born_shared
                assert w.born_shared in format_info(info)

        # Set up by the preload, then registered too (whose setup finds the
        # mode on and does nothing): the preload's decision is reported.
        with (
            dask.config.set(
                {
                    "shm.shared-memory.enabled": True,
                    "shm.shared-memory.root": huge,
                    "distributed.worker.preload": ["dask_shm"],
                }
            ),
            one_worker_cluster() as cluster,
            Client(cluster) as client,
        ):
            client.register_plugin(SharedMemoryPlugin(huge))
            [w] = collect_info(huge, cluster.scheduler_address).workers
            assert w.born_shared is not None and " born shared (" in w.born_shared


def test_workers_asked_for_shared_memory_without_a_spill_buffer_are_told_why(roomy_tmpfs):
    """A worker with no memory limit keeps stock's plain dict, so shared
    memory is off there although the preload ran: info says that, and how to
    turn it on, not that the preload is missing."""
    config = {
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.root": roomy_tmpfs,
        "distributed.worker.preload": ["dask_shm"],
    }
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=1,
            processes=False,
            protocol="tcp",
            memory_limit=0,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as cluster,
    ):
        info = collect_info(roomy_tmpfs, cluster.scheduler_address)
    [worker] = info.workers
    assert worker.data_class == "builtins.dict" and worker.requested
    assert worker.kept_mapping is not None
    assert worker.kept_mapping.startswith("the worker has no memory limit")
    kinds = {p.kind for p in info.problems}
    assert "plugin" not in kinds
    [problem] = [p for p in info.problems if p.kind == "plugin-data-mapping"]
    assert worker.address in problem.message
    assert worker.kept_mapping in problem.message
    assert "--memory-limit" in problem.fix and "SharedMemoryPlugin" in problem.fix
    assert f"{worker.address}: shared-memory mode off: the worker has no memory limit" in (
        format_info(info)
    )


def _on_three_tiers(root: str, middle: str, disk: str, dask_worker) -> None:
    """Give the worker a buffer with a budgeted middle tier between the
    tmpfs and the disk, publishing its figures as the plugin does."""
    from dask_shm.shared import metrics
    from dask_shm.shared.tiers import TierSpec
    from dask_shm.worker import install_spill_buffer

    specs = [
        TierSpec("shared", root, ram=True, registry=True),
        TierSpec("middle", middle, ram=False),
        TierSpec("disk", disk, ram=False),
    ]
    budgets = {"shared": 3 * 2**20, "middle": 3 * 2**20}
    buffer = SharedSpillBuffer.on_tiers(
        0, specs, budgets, min_size=2**16, min_shared_fraction=0.5, name="three"
    )
    install_spill_buffer(dask_worker, buffer)
    metrics.install(dask_worker)


def test_a_new_tiers_bytes_are_in_the_workers_line(roomy_tmpfs, tmp_path):
    """A file tier info was never told of shows, named and numbered, in the
    per-worker line and in the JSON; the disk behind it is tier 4 now."""
    middle, disk = tmp_path / "middle", tmp_path / "disk"
    middle.mkdir()
    with (
        one_worker_cluster() as cluster,
        Client(cluster) as client,
    ):
        client.run(_on_three_tiers, roomy_tmpfs, str(middle), str(disk))
        # 2 MiB each, none kept in memory: tmpfs, middle, then disk twice
        futures = [client.submit(np.full, 2**18, i, key=f"three-x{i}") for i in range(4)]
        client.gather(futures)
        info = collect_info(roomy_tmpfs, cluster.scheduler_address)
        [w] = info.workers
        assert [(t.name, t.number, t.budget) for t in w.file_tiers] == [
            ("shared", 2, 3 * 2**20),
            ("middle", 3, 3 * 2**20),
            ("disk", 4, None),
        ]
        shared, middle_tier, disk_tier = w.file_tiers
        assert 2 * 2**20 <= middle_tier.bytes <= 3 * 2**20 and disk_tier.bytes >= 4 * 2**20
        assert w.tier3_bytes == middle_tier.bytes  # the keys of old are by number
        assert (
            f"tier 2 (tmpfs) {format_bytes(shared.bytes)} of 3.00 MiB budget, "
            f"tier 3 (middle) {format_bytes(middle_tier.bytes)} of 3.00 MiB budget, "
            f"tier 4 (disk) {format_bytes(disk_tier.bytes)}; data "
        ) in format_info(info)
        [worker] = as_json(info)["workers"]
        assert [t["name"] for t in worker["file_tiers"]] == ["shared", "middle", "disk"]
        assert worker["file_tiers"][2]["moves"] == 0
        client.cancel(futures)
        client.run(lambda dask_worker: dask_worker.data.close())
