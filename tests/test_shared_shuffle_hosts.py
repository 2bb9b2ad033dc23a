"""P2P shuffles and rechunks in shared-memory mode on hosts as Dask really
runs there, with ``dask worker`` processes as users start them (config by
environment, dask-shm's preloads) and a scheduler in this process:

- workers inside a memory cgroup with a limit near the data: a container's
  (Kubernetes, Docker: a cgroup namespace whose ``/sys/fs/cgroup/memory`` is
  the container's cgroup, ``--memory-limit auto``) or a batch job's (SLURM:
  no cgroup namespace, the job's memory split among the workers by hand, or
  ``--memory-limit auto``, which does not see the job's cgroup: there stock
  workers run the same shuffle and rechunk in the same cgroup for reference);
- workers in PID namespaces of their own sharing one tmpfs root
  (containers sharing ``/dev/shm``), one killed with SIGKILL mid-shuffle,
  then whole containers killed.

Real processes, real tmpfs and cgroups; skipped with the reason where the
kernel feature is missing. The namespaces and the workers' command lines:
``namespaces.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from clusters import worker_addresses
from distributed import Client, LocalCluster, wait
from memory_cgroup import MemoryCgroup, memory_cgroup
from memory_cgroup import unavailable_reason as cgroup_unavailable
from namespaces import (
    dask_worker,
    host_pid,
    in_container,
    in_namespaces_of,
    in_own_pid_namespace,
    kill_container,
    stop,
)
from namespaces import unavailable_reason as unshare_unavailable
from p2p_workload import p2p_counters, rechunked_checksum, shard_files, shuffled_checksum
from test_shared_shuffle import HERE, leftovers

GiB = 2**30
MiB = 2**20


def stock_env(temporary_directory: str) -> dict[str, str]:
    """Stock ``dask worker``'s environment here (dask-shm only if preloaded)."""
    return {
        "DASK_TEMPORARY_DIRECTORY": temporary_directory,
        "DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False",
        # the workers unpickle this module's functions
        "PYTHONPATH": os.pathsep.join([HERE, *sys.path]),
    }


def shared_env(root: str, temporary_directory: str) -> dict[str, str]:
    """Shared-memory mode by environment, as a job script or pod spec sets it."""
    return {
        **stock_env(temporary_directory),
        "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
        "DASK_SHM__SHARED_MEMORY__ROOT": root,
    }


@contextmanager
def scheduler() -> Iterator[tuple[LocalCluster, Client]]:
    with (
        dask.config.set({"distributed.scheduler.active-memory-manager.start": False}),
        LocalCluster(
            n_workers=0, host="127.0.0.1", dashboard_address=":0", processes=True
        ) as cluster,
        Client(cluster) as client,
    ):
        yield cluster, client


def files_left(root: str, scratch: str) -> list[str]:
    """dask-shm's files and directories under the tmpfs ``root`` and the
    disk root (``<scratch>/dask-scratch-space``, where distributed's own
    worker directories are left to it) but what a clean close leaves: the
    identity tokens (``root-id``) and empty ``dask-shm-<uid>`` and ``peers``
    directories."""
    user = f"dask-shm-{os.geteuid()}"
    found = []
    for top in (os.path.join(root, user), os.path.join(scratch, "dask-scratch-space", user)):
        for d, dirs, files in os.walk(top):
            found += [os.path.join(d, f) for f in files if f != "root-id"]
            found += [os.path.join(d, sub) for sub in dirs if sub != "peers"]
    return sorted(found)


def counters(client: Client) -> dict[str, dict[str, float]]:
    """The workers' P2P counters."""
    return client.run(
        lambda dask_worker: {
            k: v for k, v in dask_worker.data.shm_counters.items() if k.startswith("p2p_")
        }
    )


# --- the workload: a shuffle and a rechunk whose results are known ----------------


def frame_part(i: int, rows: int) -> pd.DataFrame:
    """Input partition ``i`` (made on the worker, not sent in the graph)."""
    rng = np.random.default_rng(1000 + i)
    return pd.DataFrame(
        {"k": rng.integers(0, 1000, rows), "v": rng.random(rows), "w": rng.random(rows)}
    )


def expected_digest(partitions: int, rows: int) -> tuple[int, int, float]:
    """Rows, distinct keys and sum of v * k of the whole frame, one input
    partition at a time."""
    n, keys, s = 0, set(), 0.0
    for i in range(partitions):
        p = frame_part(i, rows)
        n += len(p)
        keys.update(np.unique(p["k"]).tolist())
        s += float((p["v"] * p["k"]).sum())
    return n, len(keys), s


def per_partition(shuffled: dd.DataFrame) -> dd.DataFrame:
    """Rows, distinct keys and sum of v * k of each output partition."""
    return shuffled.map_partitions(
        lambda p: pd.DataFrame(
            {"n": [len(p)], "keys": [p["k"].nunique()], "s": [float((p["v"] * p["k"]).sum())]}
        ),
        meta={"n": "i8", "keys": "i8", "s": "f8"},
    )


def summed(parts: pd.DataFrame) -> tuple[int, int, float]:
    """The frame's digest from :func:`per_partition`'s: the distinct keys add
    up to the frame's only if each key landed in one output partition (what
    a correct shuffle does)."""
    return int(parts["n"].sum()), int(parts["keys"].sum()), float(parts["s"].sum())


def digest(shuffled: dd.DataFrame) -> tuple[int, int, float]:
    return summed(per_partition(shuffled).compute())


def assert_digest(got: tuple[int, int, float], partitions: int, rows: int) -> None:
    n, keys, s = expected_digest(partitions, rows)
    assert got[:2] == (n, keys)
    assert got[2] == pytest.approx(s, rel=1e-12)


def rechunk_input(side: int) -> da.Array:
    return da.random.default_rng(7).random((side, side), chunks=(side, 256))


def rechunked_sum(x: da.Array) -> float:
    """A weighted sum of ``x`` rechunked P2P from columns to rows."""
    with dask.config.set({"array.rechunk.method": "p2p"}):
        y = x.rechunk((256, x.shape[1]))
    return float((y * np.arange(x.shape[1], dtype=float)).sum().compute())


# --- inside a memory cgroup: a container's or a batch job's ---------------------


def worker_limits(dask_worker) -> dict:  # type: ignore[no-untyped-def]
    """What the worker took its limits from: distributed's memory limit,
    dask-shm's reading of the cgroup and its tier-2 budget."""
    from dask_shm.shared import limits

    cg = limits.cgroup_memory()
    return {
        "memory_limit": dask_worker.memory_manager.memory_limit,
        "cgroup_limit": None if cg is None else cg.limit,
        "available": limits.memory_available_to_process(),
        "budget": dask_worker.data.store.tiers.tiers[0].budget.limit,
    }


def where_held(dask_worker) -> dict:  # type: ignore[no-untyped-def]
    from dask_shm.shared.metrics import shm_metrics

    return shm_metrics(dask_worker)


#: the cgroup's limit, and a frame about a third of it that the workers hold
#: after the shuffle: with the interpreters (about 0.5 GiB for the worker
#: processes and their nannies) the workers' memory targets cannot keep it
#: all in private memory
CGROUP_LIMIT = 3 * GiB // 2
#: in 32 partitions of 21 MiB: the shuffle's transient private memory (an
#: output partition being put together) stays well below what the memory
#: limit leaves beside a full tier 2
PARTITIONS, ROWS = 32, 700_000  # 32 x 700k rows x 24 bytes: 513 MiB (684 with the index)


def in_job(cg: MemoryCgroup, command: list[str]) -> list[str]:
    """``command`` as a batch system (SLURM) starts it: in the job's cgroup
    (``preexec_fn=cg.add_self``), no cgroup namespace: ``/proc/self/cgroup``
    names the job's cgroup in the host's hierarchy."""
    return command


#: how workers get into the cgroup, and the memory limit they are given
CGROUP_STYLES = {
    # Kubernetes, Docker: --memory-limit auto is distributed's share of the
    # cgroup it sees at /sys/fs/cgroup
    "container": (in_container, "auto"),
    # SLURM with dask-jobqueue: the job's memory split among the processes
    # by hand (distributed's "auto" does not see a job's cgroup)
    "job": (in_job, str(CGROUP_LIMIT // 2)),
}


@contextmanager
def workers_in_cgroup(
    cg: MemoryCgroup,
    start: Callable[[MemoryCgroup, list[str]], list[str]],
    env: dict[str, str],
    memory_limit: str,
    log: Path,
    preload: bool = True,
) -> Iterator[Client]:
    """A scheduler here and ``dask worker --nworkers 2 --memory-limit
    memory_limit`` (with dask-shm's preloads unless ``preload`` is False)
    in ``cg``, started as ``start`` (:func:`in_container`, :func:`in_job`)
    says, under ``env`` added to ours, its output in ``log``; yields a client
    once both workers are there. The workers are stopped (cleanly) before
    the scheduler closes."""
    with scheduler() as (cluster, client), open(log, "w") as out:
        command = dask_worker(
            cluster.scheduler_address,
            "--nworkers",
            "2",
            "--memory-limit",
            memory_limit,
            preload=preload,
        )
        proc = subprocess.Popen(
            start(cg, command),
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=cg.add_self,
        )
        try:
            client.wait_for_workers(2, timeout=120)
            yield client
        finally:
            stop([proc])


def events(log: Path) -> str:
    """What the workers said in ``log`` of warnings, errors, restarts and
    memory limits exceeded."""
    return "\n".join(
        line
        for line in log.read_text().splitlines()
        if "WARNING" in line or "ERROR" in line or "Restarting" in line or "exceeded" in line
    )


@pytest.mark.parametrize("style", CGROUP_STYLES)
def test_p2p_inside_a_memory_cgroup(tmp_path, style):
    """Two workers (``dask worker --nworkers 2``) in a 1.5 GiB memory cgroup
    of a container or a batch job, with the memory limit users give them
    there: dask-shm reads the cgroup's limit, the tier-2 budgets are a part
    of the workers' limits, a shuffle held at about a third of the cgroup
    and a rechunk give the known results by file with the cgroup's limit in
    force (no OOM kill, no worker restarted, data beyond the budgets on
    disk), and a clean stop leaves no file on either tier."""
    start, memory_limit = CGROUP_STYLES[style]
    why = cgroup_unavailable() or (
        unshare_unavailable("--cgroup", "--mount") if style == "container" else None
    )
    if why:
        pytest.skip(why)
    root = tempfile.mkdtemp(prefix=f"dask-shm-p2p-{style}-", dir="/dev/shm")
    scratch = str(tmp_path / "scratch")
    os.mkdir(scratch)
    log = tmp_path / "workers.log"
    # 32 MiB: a rechunk of 128 MiB right after the shuffle took stock
    # workers to 709-749 MiB of their 768 MiB here (the nanny restarts at
    # 95%), so at that size the test would have asserted more than stock does
    side = 2048
    x = rechunk_input(side)
    try:
        with memory_cgroup(CGROUP_LIMIT) as cg:
            with workers_in_cgroup(
                cg, start, shared_env(root, scratch), memory_limit, log
            ) as client:
                pids = client.run(os.getpid)
                limits = client.run(worker_limits)
                out = client.persist(
                    dd.from_map(frame_part, range(PARTITIONS), rows=ROWS).shuffle(
                        "k", shuffle_method="p2p"
                    )
                )
                wait(out)
                held = client.run(where_held)
                got = digest(out)
                del out
                after_shuffle = counters(client)
                rechunked = rechunked_sum(x)
                after_rechunk = counters(client)
                restarted = client.run(os.getpid) != pids
            oom_kills = cg.oom_kills()
    finally:
        left = files_left(root, scratch)
        shutil.rmtree(root, ignore_errors=True)
    assert oom_kills == 0, events(log)
    assert not restarted, events(log)
    for figures in limits.values():
        # dask-shm reads the cgroup (and in a container, so does distributed)
        assert figures["cgroup_limit"] == CGROUP_LIMIT, limits
        assert figures["available"] == CGROUP_LIMIT, limits
        assert figures["memory_limit"] == CGROUP_LIMIT // 2, limits
        # the tier-2 budget (tmpfs, charged to the cgroup) is a part of that
        assert 0 < figures["budget"] <= 0.3 * figures["memory_limit"], limits
    # the known results
    assert_digest(got, PARTITIONS, ROWS)
    assert rechunked == pytest.approx(
        float((x * np.arange(side, dtype=float)).sum().compute(scheduler="sync")), rel=1e-9
    )
    # the limits mattered: the workers spilled the shuffled frame, to tmpfs
    # files only within their budgets (tmpfs pages are charged to the cgroup),
    # the rest to disk. Above the spill threshold tier 2 gives way to disk as
    # stock's spilling gives memory way (shared/relief.py): in this cgroup a
    # worker's memory is often above it when it spills (on a loaded host,
    # both workers' were at every spill), so tier 2 may hold nothing by now
    for address, figures in held.items():
        assert figures["shared_bytes"] <= limits[address]["budget"], held
    assert sum(h["disk_bytes"] for h in held.values()) > 0, held
    # by file: the shuffle both ways (each worker made input partitions), the
    # rechunk from wherever its input chunks were
    for figures in after_shuffle.values():
        assert figures["p2p_file_batches"] > 0, after_shuffle
        assert figures["p2p_received_file_batches"] > 0, after_shuffle
    for name in ("p2p_file_batches", "p2p_received_file_batches"):
        assert sum(after_rechunk[a][name] - after_shuffle[a][name] for a in after_rechunk) > 0, (
            after_shuffle,
            after_rechunk,
        )
    for figures in after_rechunk.values():
        assert figures["p2p_file_fallbacks"] == figures["p2p_tcp_batches"] == 0, after_rechunk
    assert left == [], left


def p2p_workloads(client: Client, root: str) -> dict[str, dict]:
    """p2p_workload's shuffle and rechunk (48 MiB, 128 MiB) on ``client``'s
    workers, stock or shared: by workload, its checksum, the P2P counters it
    moved (summed over the workers) and the batch files under ``root`` right
    after it."""
    results = {}
    for name, workload in (("shuffle", shuffled_checksum), ("rechunk", rechunked_checksum)):
        before = client.run(p2p_counters)
        checksum = workload(client)
        after = client.run(p2p_counters)
        moved: dict[str, float] = {}
        for address, figures in after.items():
            for k, v in figures.items():
                moved[k] = moved.get(k, 0) + v - before.get(address, {}).get(k, 0)
        results[name] = {"checksum": checksum, "counters": moved, "files_left": shard_files(root)}
    return results


@pytest.mark.timeout(900)
def test_p2p_inside_a_job_cgroup_with_memory_limit_auto(tmp_path):
    """``dask worker --nworkers 2 --memory-limit auto`` in a batch job's
    1.5 GiB cgroup (``srun dask worker ...``), stock, then in shared-memory
    mode in a cgroup of the same limit. distributed's "auto" gives each
    worker half the host's memory here (it reads the cgroup hierarchy's
    root); dask-shm reads the cgroup's limit and budgets tier 2 within it,
    so that the tmpfs files the workers may keep (charged to the cgroup, not
    reclaimable without swap) fit in it. A P2P shuffle and rechunk give
    stock's results by file, with no fallback, no OOM kill either way and
    no batch file left; a clean stop leaves no file."""
    why = cgroup_unavailable()
    if why:
        pytest.skip(why)
    root = tempfile.mkdtemp(prefix="dask-shm-p2p-job-auto-", dir="/dev/shm")
    scratch = str(tmp_path / "scratch")
    os.mkdir(scratch)
    stock_log, our_log = tmp_path / "stock.log", tmp_path / "shared.log"
    try:
        with memory_cgroup(CGROUP_LIMIT) as cg:
            with workers_in_cgroup(
                cg, in_job, stock_env(scratch), "auto", stock_log, preload=False
            ) as client:
                stock = p2p_workloads(client, root)
            stock_kills = cg.oom_kills()
        with memory_cgroup(CGROUP_LIMIT) as cg:
            with workers_in_cgroup(
                cg, in_job, shared_env(root, scratch), "auto", our_log
            ) as client:
                ours = p2p_workloads(client, root)
                limits = client.run(worker_limits)
            our_kills = cg.oom_kills()
    finally:
        left = files_left(root, scratch)
        shutil.rmtree(root, ignore_errors=True)
    assert stock_kills == 0, events(stock_log)
    assert our_kills == 0, events(our_log)
    for name in ("shuffle", "rechunk"):
        assert ours[name]["checksum"] == pytest.approx(stock[name]["checksum"], rel=1e-12)
        assert ours[name]["counters"]["p2p_file_batches"] > 0, ours[name]
        assert ours[name]["counters"].get("p2p_file_fallbacks", 0) == 0, ours[name]
        assert ours[name]["files_left"] == []
    for figures in limits.values():
        # dask-shm reads the job's cgroup, which distributed's "auto" does
        # not see (no cgroup namespace) ...
        assert figures["cgroup_limit"] == figures["available"] == CGROUP_LIMIT, limits
        # ... and budgets tier 2 within it: its tmpfs pages are charged there
        assert 0 < figures["budget"] <= 0.3 * CGROUP_LIMIT, limits
        assert figures["budget"] < figures["memory_limit"], limits
    assert sum(f["budget"] for f in limits.values()) <= CGROUP_LIMIT, limits
    assert left == [], left


# --- workers in PID namespaces of their own, one tmpfs -------------------------


def facts(dask_worker) -> dict:  # type: ignore[no-untyped-def]
    """Where the worker runs and what of the shared root it uses."""
    from dask_shm.shared import p2p

    tiers = dask_worker.data.store.tiers.tiers
    return {
        "name": dask_worker.name,
        "pid": os.getpid(),
        "pid_namespace": os.readlink("/proc/self/ns/pid"),
        # this process's directories on the tmpfs root and the disk root
        "process_dir": os.path.dirname(tiers[0].directory),
        "disk_process_dir": os.path.dirname(tiers[-1].directory),
        "token": p2p._workers[dask_worker.address].token,
    }


def shared_value():  # type: ignore[no-untyped-def]
    return np.arange(2**20, dtype="f8")  # 8 MiB: shared once exported


def exported(dask_worker, key) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """Write ``key``'s value out to its tmpfs file and link it for a peer
    (as a transfer to a same-host peer does); the file's and the link's
    paths."""
    handle = dask_worker.data.export(key)
    return dask_worker.data.store.path(key), handle.path


def held_in_file(dask_worker, key) -> str:  # type: ignore[no-untyped-def]
    """:func:`exported`, the link then taken by the peer: the file's path."""
    path, link = exported(dask_worker, key)
    os.unlink(link)
    return path


def slow_part(i: int, rows: int) -> pd.DataFrame:
    time.sleep(0.2)
    return frame_part(i, rows)


def by_name(client: Client) -> dict[str, dict]:
    return {f["name"]: {**f, "address": a} for a, f in client.run(facts).items()}


def test_p2p_between_pid_namespaces_sharing_a_tmpfs(tmp_path):
    """Workers ns0, ns1 and ns2 (nanny + worker each) in PID namespaces of
    their own on one tmpfs root: they see the same root token. ns2's whole
    container is killed holding a value in a tmpfs file and a link of it for
    a peer: its directories stay. ns0 and ns1 shuffle by file both ways with
    the known result. ns0's worker is killed with SIGKILL mid-shuffle: its
    nanny starts a new one, whose sweep removes the dead worker's directory
    and the dead container's (ns2's, another PID namespace) but not ns1's
    live one (nor ns1's value in a tmpfs file), and the shuffle gives the
    known result. ``dask shm clean`` run in ns1's namespace then removes
    nothing of ns0's new worker, whose pid means nothing there. The two
    shuffle by file again. Then ns0's whole container is killed, and ``dask
    shm clean`` in ns1's namespace removes its directories and nothing of
    ns1's. Stopping ns1 leaves no file."""
    why = unshare_unavailable("--pid", "--fork", "--mount-proc")
    if why:
        pytest.skip(why)
    if shutil.which("nsenter") is None:
        pytest.skip("no nsenter command")
    root = tempfile.mkdtemp(prefix="dask-shm-p2p-pidns-", dir="/dev/shm")
    scratch = str(tmp_path / "scratch")
    os.mkdir(scratch)
    env = {**os.environ, **shared_env(root, scratch)}
    user = os.path.join(root, f"dask-shm-{os.geteuid()}")
    rows = 60_000  # 32 x 60k rows x 32 bytes: 59 MiB
    names = ("ns0", "ns1", "ns2")
    procs: list[subprocess.Popen] = []
    try:
        with scheduler() as (cluster, client):
            try:
                for name in names:
                    command = dask_worker(
                        cluster.scheduler_address, "--memory-limit", "2 GiB", "--name", name
                    )
                    procs.append(
                        subprocess.Popen(
                            in_own_pid_namespace(command),
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                    )
                client.wait_for_workers(len(names), timeout=120)
                first = by_name(client)
                ns0, ns1, ns2 = (first[name] for name in names)
                # three PID namespaces (not ours), one root
                spaces = {w["pid_namespace"] for w in first.values()}
                assert len(spaces) == 3 and os.readlink("/proc/self/ns/pid") not in spaces
                with open(os.path.join(user, "root-id")) as f:
                    assert ns0["token"] == ns1["token"] == ns2["token"] == f.read().strip()
                assert len({w["process_dir"] for w in first.values()}) == 3

                # ns2's container dies (SIGKILL to its PID 1) holding a value
                # in a tmpfs file, linked for a peer that has not taken it:
                # its directories stay until a process starting on the root
                # sweeps them
                lost = client.submit(shared_value, workers=[ns2["address"]], pure=False)
                assert client.submit(_total, lost, workers=[ns2["address"]]).result() == (
                    float(shared_value().sum())
                )
                exports = client.run(exported, workers=[ns2["address"]], key=lost.key)
                lost_files = list(exports[ns2["address"]])
                kill_container(procs[2])
                del lost
                wait_for_worker_count(client, 2)
                for path in [ns2["process_dir"], ns2["disk_process_dir"], *lost_files]:
                    assert os.path.exists(path), path

                # a shuffle by file, both ways
                assert_digest(digest(shuffled(rows)), PARTITIONS, rows)
                after = counters(client)
                for figures in after.values():
                    assert figures["p2p_file_batches"] > 0, after
                    assert figures["p2p_received_file_batches"] > 0, after
                    assert figures["p2p_file_fallbacks"] == figures["p2p_tcp_batches"] == 0, after
                wait_for_no_batch_files(root)

                # ns1 holds a value in a tmpfs file
                keep = client.submit(shared_value, workers=[ns1["address"]], pure=False)
                wait(keep)
                kept = client.run(held_in_file, workers=[ns1["address"]], key=keep.key)
                kept_file = kept[ns1["address"]]
                kept_inode = os.stat(kept_file).st_ino
                ns1_inode = os.stat(ns1["process_dir"]).st_ino

                # SIGKILL ns0's worker mid-shuffle
                sent = after[ns0["address"]]["p2p_file_batches"]
                result = client.compute(per_partition(shuffled(rows, slow_part)))
                deadline = time.monotonic() + 60
                while counters(client)[ns0["address"]]["p2p_file_batches"] == sent:
                    assert time.monotonic() < deadline, "no batch went by file"
                    time.sleep(0.05)
                os.kill(host_pid(procs[0].pid, ns0["pid"]), signal.SIGKILL)
                assert_digest(summed(result.result(timeout=120)), PARTITIONS, rows)
                del result
                client.wait_for_workers(2, timeout=60)
                second = by_name(client)
                new0 = second["ns0"]
                assert new0["pid_namespace"] == ns0["pid_namespace"]
                assert new0["process_dir"] != ns0["process_dir"]
                # the new worker's sweep took the dead one's directories, and
                # the dead container's (another PID namespace) ...
                wait_for_gone(ns0["process_dir"])
                wait_for_gone(ns0["disk_process_dir"])
                wait_for_gone(ns2["process_dir"])
                wait_for_gone(ns2["disk_process_dir"])
                assert not any(os.path.exists(path) for path in lost_files), lost_files
                # ... and left ns1's: the same directory, its file, its value
                assert os.stat(ns1["process_dir"]).st_ino == ns1_inode
                assert os.stat(kept_file).st_ino == kept_inode
                assert client.submit(_total, keep, workers=[ns1["address"]]).result() == (
                    float(shared_value().sum())
                )

                # `dask shm clean` in ns1's namespace, where ns0's pids mean
                # nothing: ns0's new worker is alive, its files stay
                assert clean_in_namespace_of(procs[1], root, scratch, env) == []
                assert os.path.isdir(new0["process_dir"])
                assert os.path.isdir(new0["disk_process_dir"])
                assert os.stat(kept_file).st_ino == kept_inode

                # the new worker and ns1 still shuffle by file, none by TCP
                # (counted for this shuffle: a batch ns1 had in flight to the
                # killed worker went the stock way, its registry entry having
                # died with it, and counts as TCP)
                before = counters(client)
                assert_digest(digest(shuffled(rows)), PARTITIONS, rows)
                after = counters(client)
                for address, figures in after.items():
                    was = before[address]
                    assert figures["p2p_file_batches"] > was["p2p_file_batches"]
                    for name in ("p2p_file_fallbacks", "p2p_tcp_batches"):
                        assert figures[name] == was[name], (name, before, after)
                wait_for_no_batch_files(root)

                # ns0's container dies (SIGKILL to its PID 1 kills all in it):
                # `dask shm clean` in ns1's namespace removes its directories
                # on both roots and nothing of ns1's
                kill_container(procs[0])
                removed = clean_in_namespace_of(procs[1], root, scratch, env)
                assert removed == sorted([new0["process_dir"], new0["disk_process_dir"]])
                assert not os.path.exists(new0["process_dir"])
                assert os.stat(ns1["process_dir"]).st_ino == ns1_inode
                assert os.stat(kept_file).st_ino == kept_inode
                assert client.submit(_total, keep, workers=[ns1["address"]]).result() == (
                    float(shared_value().sum())
                )
                del keep
            finally:
                stop(procs)
        assert files_left(root, scratch) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def shuffled(rows: int, make=frame_part) -> dd.DataFrame:  # type: ignore[no-untyped-def]
    return dd.from_map(make, range(PARTITIONS), rows=rows).shuffle("k", shuffle_method="p2p")


def clean_in_namespace_of(
    proc: subprocess.Popen, root: str, scratch: str, env: dict[str, str]
) -> list[str]:
    """``dask shm clean`` on the tmpfs root and the disk root, run in the PID
    and mount namespaces of ``proc``'s ``unshare --fork`` child (as in that
    container); the directories it says it removed."""
    disk_root = os.path.join(scratch, "dask-scratch-space")
    done = subprocess.run(
        in_namespaces_of(
            proc, [sys.executable, "-m", "dask_shm", "clean", "--root", root, "--root", disk_root]
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return sorted(
        line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("removed ")
    )


def _total(x) -> float:  # type: ignore[no-untyped-def]
    return float(x.sum())


def wait_for_worker_count(client: Client, n: int, timeout: float = 60) -> None:
    """Until the scheduler has exactly ``n`` workers (a dead one removed)."""
    deadline = time.monotonic() + timeout
    while len(workers := worker_addresses(client)) != n:
        assert time.monotonic() < deadline, workers
        time.sleep(0.1)


def wait_for_gone(path: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} is still there"
        time.sleep(0.1)


def wait_for_no_batch_files(root: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while left := leftovers(root):
        assert time.monotonic() < deadline, left
        time.sleep(0.1)
