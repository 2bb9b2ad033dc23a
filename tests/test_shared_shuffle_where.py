"""P2P shuffles in shared-memory mode with workers in separate PID
namespaces sharing one tmpfs (containers sharing /dev/shm). Real processes,
real tmpfs; skipped with the reason where the kernel feature is missing.
(Inside a memory cgroup: test_shared_shuffle_hosts.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from distributed import Client, LocalCluster
from p2p_workload import shuffled_checksum
from test_shared_shuffle import HERE, expected_checksum, leftovers


def _pidns_unavailable() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"unshare --pid failed: {probe.stderr.strip()}"


# --- workers in PID namespaces of their own, one tmpfs ----------------------------


@contextmanager
def workers_in_own_pid_namespaces(
    n: int, env: dict[str, str]
) -> Iterator[tuple[Client, list[subprocess.Popen]]]:
    """A scheduler here and ``n`` ``dask worker`` processes (nanny + worker,
    dask-shm's preloads), each started by ``unshare --pid --fork
    --mount-proc``: a PID namespace (and /proc) of its own, the same /dev/shm,
    as containers sharing /dev/shm are. Workers are stopped with SIGTERM (a
    clean close) before the scheduler closes."""
    procs: list[subprocess.Popen] = []
    with (
        LocalCluster(
            n_workers=0, host="127.0.0.1", dashboard_address=":0", processes=True
        ) as cluster,
        Client(cluster) as client,
    ):
        try:
            for i in range(n):
                cmd = [
                    "unshare",
                    "--pid",
                    "--fork",
                    "--mount-proc",
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    cluster.scheduler_address,
                    "--host",
                    "127.0.0.1",
                    "--nthreads",
                    "1",
                    "--memory-limit",
                    "2 GiB",
                    "--name",
                    f"ns{i}",
                    "--preload",
                    "dask_shm",
                    "--preload-nanny",
                    "dask_shm",
                    "--no-dashboard",
                ]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env={**os.environ, **env},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            client.wait_for_workers(n, timeout=120)
            yield client, procs
        finally:
            for p in procs:
                if p.poll() is None:
                    # to the namespace's first process (the nanny's CLI), not to
                    # unshare, which would exit and leave it running
                    os.kill(_forked_child(p.pid) or p.pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            for p in procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def _forked_child(pid: int) -> int | None:
    """The process ``unshare --fork`` (``pid``) started, if it still runs."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _pid_namespace() -> str:
    return os.readlink("/proc/self/ns/pid")


def test_p2p_between_pid_namespaces_sharing_a_tmpfs_goes_by_file():
    """Two workers, each in its own PID namespace (they may even have the same
    process id), on one tmpfs: they share its root (identity token, not
    process ids), so shard batches go by file with stock's result; a clean
    close leaves no file, and a worker killed with SIGKILL has its files
    swept by the next worker that starts on the root."""
    why = _pidns_unavailable()
    if why:
        pytest.skip(why)
    root = tempfile.mkdtemp(prefix="dask-shm-p2p-pidns-", dir="/dev/shm")
    env = {
        "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
        "DASK_SHM__SHARED_MEMORY__ROOT": root,
        "DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False",
        # the workers unpickle p2p_workload's functions
        "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
    }
    user = os.path.join(root, f"dask-shm-{os.geteuid()}")
    try:
        with workers_in_own_pid_namespaces(2, env) as (client, procs):
            namespaces = client.run(_pid_namespace)
            assert len(set(namespaces.values())) == 2
            assert _pid_namespace() not in namespaces.values()
            assert shuffled_checksum(client) == pytest.approx(expected_checksum(), rel=1e-12)
            counters = client.run(lambda dask_worker: dict(dask_worker.data.shm_counters))
            for figures in counters.values():
                assert figures["p2p_file_batches"] > 0, counters
                assert figures["p2p_file_fallbacks"] == 0, counters
        assert leftovers(root) == []
        assert _process_dirs(user) == []

        # A SIGKILLed container leaves its process directories; the next
        # worker on the root (another PID namespace) removes them as it starts.
        with workers_in_own_pid_namespaces(1, env) as (client, procs):
            keep = client.submit(_shared_value, pure=False)
            assert client.submit(_total, keep).result() == _shared_value().sum()
            client.run(_export_held_values)
            dead = _process_dirs(user)
            assert dead, "the worker's files are on the root"
            os.killpg(procs[0].pid, signal.SIGKILL)
            procs[0].wait()
        with workers_in_own_pid_namespaces(1, env) as (client, procs):
            alive = [d for d in _process_dirs(user) if d not in dead]
            assert alive, "the new worker's own directories"
            deadline = time.monotonic() + 30
            while left := [d for d in dead if os.path.exists(d)]:
                assert time.monotonic() < deadline, left
                time.sleep(0.2)
        assert _process_dirs(user) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _process_dirs(user: str) -> list[str]:
    """Process directories (``p-*``) under the user directory of the root."""
    if not os.path.isdir(user):
        return []
    return sorted(os.path.join(user, d) for d in os.listdir(user) if d.startswith("p-"))


def _shared_value():  # type: ignore[no-untyped-def]
    import numpy as np

    return np.arange(2**20, dtype="f8")  # 8 MiB: above min-size, a shared file once exported


def _total(x) -> float:  # type: ignore[no-untyped-def]
    return float(x.sum())


def _export_held_values(dask_worker) -> int:  # type: ignore[no-untyped-def]
    """Write every value the worker holds out to its shared file (as a
    transfer to a same-host peer would)."""
    return sum(dask_worker.data.export(k) is not None for k in list(dask_worker.data.fast))
