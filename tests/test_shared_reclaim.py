"""Dead processes' files and users' roots, on real processes, tmpfs and disk.

- a whole LocalCluster killed with SIGKILL: the next one on the same roots
  removes what it left on both tiers as it starts;
- a worker its nanny has to kill at close: the nanny removes what it left;
- ``dask shm clean`` and ``dask shm info`` on a dead and a live process;
- a second user of the host gets shared mode with default config, in
  directories of its own, and leaves the first user's alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import dask
import numpy as np
import psutil
import pytest
from clusters import NO_AMM, process_cluster, worker_addresses
from dask.utils import format_bytes
from tmpfs import small_tmpfs

from dask_shm.shared import shm_metrics

MB = 2**20
HERE = Path(__file__).parent
UID = os.geteuid()


def allocated(path: str | Path) -> int:
    """Bytes allocated to the files under ``path`` (each inode once)."""
    inodes = {}
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            inodes[st.st_ino] = st.st_blocks * 512
    return sum(inodes.values())


def shared_config(root: str, disk_root: str | None, max_bytes: str = "auto") -> dict:
    return {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.root": root,
        "shm.shared-memory.disk-root": disk_root,
        "shm.shared-memory.max-bytes": max_bytes,
    }


@pytest.fixture
def disk_root() -> Iterator[str]:
    """A fresh directory on disk for tier 3."""
    path = tempfile.mkdtemp(prefix="dask-shm-test-disk-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def dead(pid: int, timeout: float = 30) -> bool:
    """Whether ``pid`` exits (or is a zombie, whose files the kernel closed)
    within ``timeout`` seconds."""
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    return True


def start_killable_cluster(root: str, disk_root: str) -> tuple[subprocess.Popen, list[dict]]:
    """``killed_cluster.py`` in a process group of its own, once its data is in place."""
    options = {"root": root, "disk_root": disk_root, "max_bytes": "64 MiB", "arrays": 10}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "killed_cluster.py"), json.dumps(options)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=60)
        pytest.fail(f"the cluster to kill did not start (exit code {proc.returncode})")
    return proc, json.loads(line)


@pytest.mark.parametrize("preloads", [("worker", "nanny"), ("worker",)], ids="+".join)
def test_a_cluster_killed_with_sigkill_is_reclaimed_when_the_next_one_starts(disk_root, preloads):
    with small_tmpfs("256m") as root:
        proc, workers = start_killable_cluster(root, disk_root)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # the whole group is gone, workers included
        assert all(dead(w["pid"]) for w in workers)
        old = [w[tier] for w in workers for tier in ("tier2", "tier3")]
        assert all(os.path.isdir(d) for d in old)
        # 160 MiB of arrays: what the workers' 64 MiB budgets do not keep is on disk
        assert allocated(root) >= 64 * MB
        assert allocated(disk_root) >= 32 * MB

        config = shared_config(root, disk_root, max_bytes="220 MiB")
        if "nanny" not in preloads:  # the workers sweep on their own
            config["distributed.nanny.preload"] = []
        with process_cluster(2, "2 GiB", config=config) as client:
            assert set(
                client.run(lambda dask_worker: type(dask_worker.data).__name__).values()
            ) == {"SharedSpillBuffer"}
            # gone within one start, on both tiers, before any work
            assert [d for d in old if os.path.exists(d)] == []
            assert allocated(root) < MB
            assert allocated(disk_root) < MB
            # and swept before the tier-2 budget was sized from the free space
            # (64 MiB of dead files would have capped it at 0.9 x 192 MiB)
            budgets = {m["tier2_budget"] for m in client.run(shm_metrics).values()}
            assert budgets == {220 * MB}


def make_process_dir(root: str, disk_root: str, sizes: tuple[int, int]) -> subprocess.Popen:
    """A process that makes its directories on both roots, writes a file of
    ``sizes[i]`` bytes in each, prints their paths and waits."""
    code = textwrap.dedent(
        f"""
        import json, os, sys
        from dask_shm.shared import paths
        files = []
        for root, size in zip({[root, disk_root]!r}, {list(sizes)!r}):
            path = os.path.join(paths.subdir(root, "w-test"), "value")
            with open(path, "wb") as f:
                f.write(b"x" * size)
            files.append(path)
        print(json.dumps(files), flush=True)
        sys.stdin.read()
        """
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def dask_shm(*args: str, env: dict) -> subprocess.CompletedProcess:
    """``python -m dask_shm ARGS``, its output with runs of spaces made one
    (``info`` aligns its columns)."""
    result = subprocess.run(
        [sys.executable, "-m", "dask_shm", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    result.stdout = re.sub(" +", " ", result.stdout)
    return result


def test_clean_removes_a_dead_process_directory_and_leaves_a_live_one(shm_dir, disk_root):
    env = {**os.environ, "DASK_SHM__SHARED_MEMORY__DISK_ROOT": disk_root}
    dead = make_process_dir(shm_dir, disk_root, (3 * MB, 2 * MB))
    live = make_process_dir(shm_dir, disk_root, (MB, MB))
    try:
        dead_files = json.loads(dead.stdout.readline())
        live_files = json.loads(live.stdout.readline())
        # a file of the dead process that a live one has linked stays: not reclaimable
        shared = os.path.join(os.path.dirname(dead_files[0]), "linked")
        with open(shared, "wb") as f:
            f.write(b"y" * MB)
        os.link(shared, os.path.join(os.path.dirname(live_files[0]), "linked"))
        dead.kill()
        dead.wait(timeout=30)
        tier2, tier3 = (os.stat(f).st_blocks * 512 for f in dead_files)
        assert tier2 == 3 * MB

        before = dask_shm("info", "--root", shm_dir, env=env)
        assert before.returncode == 0, before.stderr
        assert f"tier 2 {shm_dir}: 3.00 MiB reclaimable in 1 directories" in before.stdout
        assert f"tier 3 {disk_root}: {format_bytes(tier3)} reclaimable in 1 directories" in (
            before.stdout
        )

        cleaned = dask_shm("clean", "--root", shm_dir, "--root", disk_root, env=env)
        assert cleaned.returncode == 0, cleaned.stderr
        for f in dead_files:
            assert f"removed {os.path.dirname(os.path.dirname(f))}" in cleaned.stdout
            assert not os.path.exists(f)
        assert f"{shm_dir}: 1 directories of dead processes removed, 3.00 MiB freed" in (
            cleaned.stdout
        )
        assert f"freed {format_bytes(tier2 + tier3)} in total" in cleaned.stdout
        for f in live_files:
            assert os.path.getsize(f) == MB
        linked = os.path.join(os.path.dirname(live_files[0]), "linked")
        assert os.path.getsize(linked) == MB and os.stat(linked).st_nlink == 1

        after = dask_shm("info", "--root", shm_dir, env=env)
        assert f"tier 2 {shm_dir}: 0 B reclaimable" in after.stdout
        assert f"tier 3 {disk_root}: 0 B reclaimable" in after.stdout
        again = dask_shm("clean", "--root", shm_dir, env=env)
        assert again.returncode == 0 and "freed 0 B in total" in again.stdout
    finally:
        for proc in (dead, live):
            proc.kill()
            proc.wait(timeout=30)


def test_clean_fails_on_a_root_it_cannot_clean(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = dask_shm("clean", "--root", str(not_a_dir), env=dict(os.environ))
    assert result.returncode == 1
    assert f"{not_a_dir}: cannot clean: not a directory" in result.stderr
    mine = tmp_path / "root"
    (mine / f"dask-shm-{UID}").mkdir(parents=True)
    os.chown(mine / f"dask-shm-{UID}", UID + 1, -1)  # another user's
    result = dask_shm("clean", "--root", str(mine), env=dict(os.environ))
    assert result.returncode == 1
    assert f"belongs to uid {UID + 1}" in result.stderr
    assert (mine / f"dask-shm-{UID}").is_dir()


NOBODY = 65534

SECOND_USER = """
import json, os, sys
import dask, numpy as np
from distributed import Client, LocalCluster
from dask_shm.shared import shm_metrics

if __name__ == "__main__":
    config = {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
    }
    with dask.config.set(config), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        x = client.submit(np.full, 2**20, 2.0, workers=[a])
        total = client.submit(np.sum, x, workers=[b]).result()

        def where(dask_worker):
            store = dask_worker.data.store
            kind = type(dask_worker.data).__name__
            return [kind, str(store.directory), str(store.tiers.tier("disk").store.directory)]

        print(json.dumps({
            "uid": os.geteuid(),
            "total": float(total),
            "workers": list(client.run(where).values()),
            "links": sum(m["link_transfers"] for m in client.run(shm_metrics).values()),
        }), flush=True)
"""


def as_nobody(code: str, temporary_directory: str) -> subprocess.CompletedProcess:
    """Run ``code`` as uid/gid 65534 (nobody). It keeps CAP_DAC_READ_SEARCH,
    only so that it can read this interpreter under /root; writing still
    needs permission."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run a process as another user")
    env = {
        **os.environ,
        "HOME": temporary_directory,
        "DASK_TEMPORARY_DIRECTORY": temporary_directory,
    }
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=temporary_directory,
        timeout=300,
    )


def mode_and_owner(path: str) -> tuple[int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid


def test_a_second_user_gets_shared_mode_with_default_config_in_directories_of_its_own():
    if UID != 0:
        pytest.skip("needs root to run a process as another user")
    # A temporary directory like /tmp (sticky, everyone's), so that the
    # default tier-3 root of both users is decided in it as in /tmp.
    tmp = tempfile.mkdtemp(prefix="dask-shm-test-tmp-")
    os.chmod(tmp, 0o1777)
    shm_before = os.path.lexists(f"/dev/shm/dask-shm-{NOBODY}")
    try:
        config = {
            "temporary-directory": tmp,
            **shared_config("/dev/shm", None),
        }
        with process_cluster(2, "2 GiB", config=config) as client:
            a, b = worker_addresses(client)
            x = client.submit(np.full, 2**20, 1.0, workers=[a], key="first-user")
            assert client.submit(np.sum, x, workers=[b]).result() == 2**20

            def files(dask_worker):
                store = dask_worker.data.store
                name = store.file_of("first-user")
                path = None if name is None else store.files.path(name)
                return path, (None if path is None else os.stat(path).st_ino)

            mine = {w: f for w, f in client.run(files).items() if f[0] is not None}
            assert mine, "the first user's value is in no shared file"
            first_disk = client.run(
                lambda dask_worker: str(dask_worker.data.store.tiers.tier("disk").store.directory)
            )
            assert all(d.startswith(f"{tmp}/dask-scratch-space/") for d in first_disk.values())

            result = as_nobody(SECOND_USER, tmp)
            assert result.returncode == 0, result.stderr[-3000:]
            report = json.loads(result.stdout.strip().splitlines()[-1])
            assert report["uid"] == NOBODY and report["total"] == 2.0 * 2**20
            assert report["links"] >= 1  # shared mode: the array went by hard link
            for kind, tier2, tier3 in report["workers"]:
                assert kind == "SharedSpillBuffer"
                assert tier2.startswith(f"/dev/shm/dask-shm-{NOBODY}/")
                # /tmp-like dask-scratch-space is the first user's: its own, as stock does
                assert tier3.startswith(f"{tmp}/dask-scratch-space-{NOBODY}/dask-shm-{NOBODY}/")
            for user_dir in (
                f"/dev/shm/dask-shm-{NOBODY}",
                f"{tmp}/dask-scratch-space-{NOBODY}/dask-shm-{NOBODY}",
            ):
                assert mode_and_owner(user_dir) == (0o700, NOBODY)
            assert mode_and_owner(f"{tmp}/dask-scratch-space/dask-shm-{UID}") == (0o700, UID)

            # the first user's files and cluster are as they were
            assert {w: f for w, f in client.run(files).items() if w in mine} == mine
            for path, inode in mine.values():
                assert os.stat(path).st_ino == inode
            assert client.submit(np.sum, x, workers=[a]).result() == 2**20
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not shm_before:
            shutil.rmtree(f"/dev/shm/dask-shm-{NOBODY}", ignore_errors=True)


def test_a_nanny_reclaims_off_its_event_loop(shm_dir, disk_root, monkeypatch):
    """The start-up and close sweeps walk dead processes' files: O(files), so
    they run in a thread, never on the nanny's event loop (in a LocalCluster
    that loop is also the scheduler's and the client's)."""
    from distributed import Nanny, Scheduler

    from dask_shm.shared import paths

    proc = make_process_dir(shm_dir, disk_root, (MB, MB))
    files = json.loads(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=30)
    on_loop_thread: list[bool] = []
    reclaim = paths.reclaim

    def recording_reclaim(*args, **kwargs):
        on_loop_thread.append(threading.current_thread() is threading.main_thread())
        return reclaim(*args, **kwargs)

    monkeypatch.setattr(paths, "reclaim", recording_reclaim)

    async def start_and_close() -> None:
        async with Scheduler(dashboard_address=":0") as s:
            async with Nanny(s.address, nthreads=1, memory_limit="512MiB"):
                pass

    with dask.config.set(shared_config(shm_dir, disk_root)):
        asyncio.run(start_and_close())
    # both roots at the nanny's start, which found the dead directory, and
    # any later sweep that found something: all in threads
    assert len(on_loop_thread) >= 2 and not any(on_loop_thread)
    assert not any(os.path.exists(f) for f in files)


def test_nothing_to_reclaim_tells_without_waiting_or_changing_anything(shm_dir, disk_root):
    """The probe a starting server makes on its event loop before it sweeps
    (in a thread) only where a sweep would do something."""
    import fcntl

    from dask_shm.shared import paths

    assert paths.nothing_to_reclaim(shm_dir) and paths.nothing_to_reclaim(disk_root, peers=False)
    proc = make_process_dir(shm_dir, disk_root, (MB, MB))
    files = json.loads(proc.stdout.readline())
    try:
        # a live process's directories: nothing to do
        assert paths.nothing_to_reclaim(shm_dir)
        assert paths.nothing_to_reclaim(disk_root, peers=False)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not paths.nothing_to_reclaim(shm_dir)
    assert not paths.nothing_to_reclaim(disk_root, peers=False)
    assert all(os.path.exists(f) for f in files)  # probing removed nothing
    for root, peers in ((shm_dir, True), (disk_root, False)):
        paths.reclaim(root, peers=peers)
        assert paths.nothing_to_reclaim(root, peers=peers)

    # another sweep under way (it holds the user directory's lock): not
    # skipped, so that the budget after it sees what that sweep freed
    base = os.path.join(shm_dir, f"dask-shm-{UID}")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert not paths.nothing_to_reclaim(shm_dir)
    finally:
        os.close(fd)
    assert paths.nothing_to_reclaim(shm_dir)

    # a sweep of another root under way in another thread of this process
    held, release = threading.Event(), threading.Event()

    def sweeping_elsewhere() -> None:
        with paths._held_lock:
            held.set()
            release.wait(30)

    sweeper = threading.Thread(target=sweeping_elsewhere)
    sweeper.start()
    try:
        held.wait(30)
        assert not paths.nothing_to_reclaim(shm_dir)
    finally:
        release.set()
        sweeper.join()
    assert paths.nothing_to_reclaim(shm_dir)

    # a half-written registry entry: fresh, left; stale, to be swept
    stale = os.path.join(paths.peers_directory(shm_dir), "w-gone.tmp")
    Path(stale).touch()
    assert paths.nothing_to_reclaim(shm_dir)
    old = os.stat(stale).st_mtime - paths.TMP_GRACE_SECONDS - 1
    os.utime(stale, (old, old))
    assert not paths.nothing_to_reclaim(shm_dir)
    assert paths.nothing_to_reclaim(shm_dir, peers=False)
    paths.reclaim(shm_dir)
    assert not os.path.exists(stale) and paths.nothing_to_reclaim(shm_dir)

    # a root with no user directory yet: a sweep would do nothing either
    assert paths.nothing_to_reclaim(os.path.join(shm_dir, "missing"))
    # a user directory that is a file: cannot tell, so the caller sweeps (and says why)
    unusable = os.path.join(shm_dir, "unusable")
    os.mkdir(unusable)
    Path(unusable, f"dask-shm-{UID}").touch()
    assert not paths.nothing_to_reclaim(unusable)


def test_an_in_process_cluster_knows_its_workers_when_it_has_started(shm_dir, disk_root):
    """As with stock: once ``async with SpecCluster(...)`` has begun, the
    cluster's own list of workers holds all of them (adaptive scaling reads
    it). The start-up sweep went through a thread even with nothing to
    sweep, and each worker then registered in a loop turn of its own: the
    list lagged in most starts, and distributed's ``test_worker_keys``
    retired one worker of a pair."""
    from distributed import Scheduler, SpecCluster, Worker

    names = ["a-1", "a-2", "b-1", "b-2"]

    async def observed_at_start() -> set[str]:
        async with SpecCluster(
            scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
            workers={name: {"cls": Worker} for name in names},
            asynchronous=True,
        ) as cluster:
            return set(cluster.observed)

    with dask.config.set(shared_config(shm_dir, disk_root)):
        for _ in range(5):
            assert asyncio.run(observed_at_start()) == set(names)


def process_dirs(root: str) -> list[str]:
    """The process directories under ``root``'s user directory."""
    base = os.path.join(root, f"dask-shm-{UID}")
    return sorted(n for n in os.listdir(base) if n.startswith("p-")) if os.path.isdir(base) else []


def test_a_worker_its_nanny_kills_at_close_leaves_nothing_on_either_root(shm_dir, disk_root):
    """A worker that does not end within its nanny's close timeout is killed
    (SIGKILL), so its own teardown never removes its files. Stock's nanny then
    removes the worker's local directory; ours must remove what the worker left
    on the tmpfs (RAM) and the disk tier, or it stays until some later process
    starts on that root (found by a soak that killed workers during P2P
    shuffles: a sender stuck on a send to the dead peer was killed at close)."""
    from distributed import Client, LocalCluster, WorkerPlugin

    class StuckClose(WorkerPlugin):
        name = "stuck-close"

        def teardown(self, worker):
            import time

            time.sleep(60)  # the event loop blocked: the nanny has to kill the process

    with dask.config.set({**NO_AMM, **shared_config(shm_dir, disk_root)}):
        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, memory_limit="1 GiB", dashboard_address=":0"
        )
        client = Client(cluster)
        try:
            a, b = worker_addresses(client)
            x = client.submit(np.ones, 2 * MB, workers=[a], pure=False)  # 16 MiB
            y = client.submit(lambda v: v * 2, x, workers=[b], pure=False)
            y.result()
            # handed over by link: the value's file is in both workers' directories
            assert client.run(shm_metrics)[a]["link_bytes"] >= 16 * MB
            assert len(process_dirs(shm_dir)) == 2
            assert len(process_dirs(disk_root)) == 2
            pids = list(client.run(os.getpid).values())
            client.register_plugin(StuckClose())
            # the cluster closes with x and y still held: nothing released them
            cluster.close()
        finally:
            client.close()
            cluster.close()
    assert all(dead(pid) for pid in pids)
    assert process_dirs(shm_dir) == []
    assert allocated(shm_dir) < MB
    assert process_dirs(disk_root) == []
    peers = os.path.join(shm_dir, f"dask-shm-{UID}", "peers")
    assert not os.path.isdir(peers) or os.listdir(peers) == []


def test_a_nanny_plugin_removed_from_a_running_nanny_gives_its_hooks_back(shm_dir, disk_root):
    from distributed import Nanny

    from dask_shm.shared import SharedMemoryNannyPlugin

    config = {
        "shm.shared-memory.root": shm_dir,
        "shm.shared-memory.disk-root": disk_root,
    }
    with dask.config.set(config), process_cluster(1, "512 MiB") as client:
        [nanny] = client.cluster.workers.values()
        assert nanny.kill.__func__ is Nanny.kill
        stock_check = nanny.periodic_callbacks["memory_monitor"]
        client.register_plugin(SharedMemoryNannyPlugin(), name="shm-nanny")
        assert getattr(nanny.kill, "__func__", None) is not Nanny.kill
        assert nanny.periodic_callbacks["memory_monitor"] is not stock_check
        client.unregister_worker_plugin("shm-nanny", nanny=True)
        assert nanny.kill.__func__ is Nanny.kill
        # and its terminate check (ours counts the worker's tmpfs share)
        assert nanny.periodic_callbacks["memory_monitor"] is stock_check
        assert stock_check.is_running()
