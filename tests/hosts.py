"""Two simulated hosts on one kernel: this network namespace (host A) and a
fresh one (host B, ``ip netns`` + a veth pair), each running real
``dask worker`` processes. Host B runs in its own mount namespace, where
directories can be bind-mounted over the paths host A uses: the same path,
different files, as on two machines (or containers) that share some
directories and not others. Root only."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pytest
from distributed import Client, LocalCluster


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def unavailable_reason() -> str | None:
    """Why two hosts cannot be simulated here, or None."""
    if os.geteuid() != 0:
        return "simulating two hosts needs root (ip netns, mount)"
    name = f"dshm-probe-{uuid.uuid4().hex[:6]}"
    proc = _run("ip", "netns", "add", name)
    if proc.returncode != 0:
        return f"ip netns is unavailable: {proc.stderr.strip() or proc.returncode}"
    _run("ip", "netns", "del", name)
    return None


@dataclass
class TwoHosts:
    """Host A's and host B's IP addresses and network namespace of host B."""

    netns: str
    ip_a: str
    ip_b: str
    #: ``(directory, path)``: mount ``directory`` over ``path`` on host B
    binds_b: list[tuple[str, str]] = field(default_factory=list)
    _workers: list[subprocess.Popen] = field(default_factory=list)

    def start_worker(self, host: str, scheduler: str, env: dict[str, str], name: str) -> None:
        """Start one ``dask worker`` (with its nanny and dask-shm's preloads)
        on ``host`` ("a" or "b")."""
        ip = self.ip_a if host == "a" else self.ip_b
        worker = [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            scheduler,
            "--host",
            ip,
            "--nthreads",
            "1",
            "--memory-limit",
            "1 GiB",
            "--name",
            name,
            "--preload",
            "dask_shm",
            "--preload-nanny",
            "dask_shm",
            "--no-dashboard",
        ]
        if host == "a":
            cmd = worker
        else:
            mounts = [f"mount --bind {shlex.quote(d)} {shlex.quote(p)}" for d, p in self.binds_b]
            script = " && ".join([*mounts, "exec " + shlex.join(worker)])
            # `ip netns exec` gives the command a mount namespace of its own
            # (slave of ours): its bind mounts are invisible on host A.
            cmd = ["ip", "netns", "exec", self.netns, "sh", "-c", script]
        self._workers.append(
            subprocess.Popen(
                cmd,
                env={**os.environ, **env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    def stop_workers(self, timeout: float = 60) -> None:
        """SIGTERM every worker (a clean close: nanny and worker tear down
        their plugins), then wait for them."""
        for p in self._workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self._workers:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._workers.clear()

    @contextlib.contextmanager
    def cluster(
        self, workers: Iterable[tuple[str, str]], env: dict[str, str]
    ) -> Iterator[tuple[Client, dict[str, str]]]:
        """A scheduler on host A's address (a LocalCluster without workers)
        and a client of it, with one ``dask worker`` per ``(host, name)`` in
        ``workers`` started under ``env``; yields the client and the workers'
        addresses by name once all have connected. The workers are stopped
        (cleanly, see :meth:`stop_workers`) before the scheduler closes."""
        workers = list(workers)
        with (
            LocalCluster(
                n_workers=0,
                host=self.ip_a,
                scheduler_port=0,
                dashboard_address=":0",
                processes=True,
            ) as cluster,
            Client(cluster) as client,
        ):
            for host, name in workers:
                self.start_worker(host, cluster.scheduler_address, env, name)
            client.wait_for_workers(len(workers), timeout=120)
            # the scheduler's identity, not client.scheduler_info(): see
            # clusters.worker_addresses
            info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
            yield client, {w["name"]: address for address, w in info.items()}
            self.stop_workers()


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Host B's namespace and a veth pair to it; removed afterwards (with any
    worker still running)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    netns, veth_a, veth_b = f"dshm-{tag}", f"dsa{tag}", f"dsb{tag}"
    net = f"10.{int(tag[:2], 16) % 200 + 20}.{int(tag[2:4], 16)}"
    hosts = TwoHosts(netns, f"{net}.1", f"{net}.2")
    steps = [
        ("ip", "netns", "add", netns),
        ("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
        ("ip", "link", "set", veth_b, "netns", netns),
        ("ip", "addr", "add", f"{hosts.ip_a}/24", "dev", veth_a),
        ("ip", "link", "set", veth_a, "up"),
        ("ip", "netns", "exec", netns, "ip", "addr", "add", f"{hosts.ip_b}/24", "dev", veth_b),
        ("ip", "netns", "exec", netns, "ip", "link", "set", veth_b, "up"),
        ("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            proc = _run(*step)
            if proc.returncode != 0:
                pytest.skip(f"cannot set up a second host ({' '.join(step)}): {proc.stderr}")
        yield hosts
    finally:
        hosts.stop_workers(timeout=10)
        _run("ip", "link", "del", veth_a)
        _run("ip", "netns", "del", netns)
