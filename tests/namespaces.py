"""``dask worker`` processes started as containers and batch systems start
them on this host: in namespaces of their own (PID, cgroup, mount) made with
``unshare``. Their command lines, whether the kernel lets us make the
namespaces, finding their processes (``unshare --fork`` stands between us
and a namespace's PID 1, and pids differ inside), stopping them cleanly,
killing a whole container, and running a command in a container's
namespaces (``nsenter``). Linux; most of it needs root."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from memory_cgroup import MemoryCgroup


def unavailable_reason(*flags: str) -> str | None:
    """Why ``unshare *flags`` cannot run here (no command, or the kernel or
    our privileges refuse those namespaces), or None."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", *flags, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare {' '.join(flags)} failed: {probe.stderr.strip()}"
    return None


def dask_worker(address: str, *args: str, preload: bool = True) -> list[str]:
    """``dask worker`` (a nanny and its worker, one thread) on 127.0.0.1,
    with dask-shm's worker and nanny preloads unless ``preload`` is False
    (stock), then ``args``."""
    preloads = ["--preload", "dask_shm", "--preload-nanny", "dask_shm"] if preload else []
    return [
        sys.executable,
        "-m",
        "distributed.cli.dask_worker",
        address,
        "--host",
        "127.0.0.1",
        "--nthreads",
        "1",
        *preloads,
        "--no-dashboard",
        *args,
    ]


def in_own_pid_namespace(command: list[str]) -> list[str]:
    """``command`` as PID 1 of a new PID namespace with its own ``/proc``
    (a container sharing ``/dev/shm`` with the others)."""
    return ["unshare", "--pid", "--fork", "--mount-proc", *command]


def in_container(cg: MemoryCgroup, command: list[str]) -> list[str]:
    """``command`` as a container runtime starts it: in a cgroup namespace
    of its own whose memory hierarchy (``/sys/fs/cgroup/memory``, v2:
    ``/sys/fs/cgroup``) is the container's cgroup, where ``distributed``'s
    ``memory_limit="auto"`` reads the limit; the process itself must be put
    in ``cg`` (``preexec_fn=cg.add_self``)."""
    target = "/sys/fs/cgroup/memory" if cg.version == "v1" else "/sys/fs/cgroup"
    return [
        "unshare",
        "--cgroup",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount --bind "$1" "$2" && shift 2 && exec "$@"',
        "sh",
        cg.path,
        target,
        *command,
    ]


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children; none once it is gone."""
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def namespace_init(proc: subprocess.Popen) -> int:
    """The pid here of the PID 1 of the namespace that ``proc`` (started by
    :func:`in_own_pid_namespace`) made: ``unshare --fork``'s child."""
    return children(proc.pid)[0]


def host_pid(ancestor: int, pid_in_namespace: int) -> int:
    """The pid, in this namespace, of the descendant of ``ancestor`` whose
    pid in its own namespace is ``pid_in_namespace``."""
    for child in psutil.Process(ancestor).children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/status") as f:
                nspid = next(line for line in f if line.startswith("NSpid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if len(nspid) > 1 and int(nspid[-1]) == pid_in_namespace:
            return child.pid
    raise LookupError(f"no process {pid_in_namespace} below {ancestor}")


def in_namespaces_of(proc: subprocess.Popen, command: list[str]) -> list[str]:
    """``command`` run in the PID and mount namespaces of the container that
    ``proc`` (started by :func:`in_own_pid_namespace`) is, as ``docker
    exec`` runs it."""
    target = str(namespace_init(proc))
    return ["nsenter", "--target", target, "--pid", "--mount", *command]


def stop(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """SIGTERM to each ``dask worker`` (a clean close, as a container stop
    sends it to the container's PID 1), SIGKILL to its session after
    ``timeout`` seconds. ``unshare --fork`` does not pass signals on: its
    child gets them."""
    for p in procs:
        if p.poll() is None:
            fork = isinstance(p.args, list) and "--fork" in p.args
            for pid in children(p.pid) if fork else [p.pid]:
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def kill_container(proc: subprocess.Popen) -> None:
    """Kill the container that ``proc`` (started by
    :func:`in_own_pid_namespace`) is: SIGKILL to its PID 1, which kills all
    in its namespace. Then unlink the named semaphores its processes mapped
    (stock multiprocessing's ``/dev/shm/sem.mp-*``, not dask-shm's files),
    which their resource tracker, killed with them, cannot remove."""
    init = namespace_init(proc)
    semaphores = named_semaphores(init)
    assert semaphores, "no semaphores found: maps not readable?"
    os.kill(init, signal.SIGKILL)
    proc.wait(30)
    for path in semaphores:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def named_semaphores(pid: int) -> list[str]:
    """The multiprocessing semaphores (``/dev/shm/sem.mp-*``, stock's) that
    process ``pid`` and its descendants map under their names."""
    found = set()
    for p in [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]:
        try:
            with open(f"/proc/{p}/maps") as f:
                found |= {
                    line.split()[-1]
                    for line in f
                    if "/dev/shm/sem.mp-" in line and not line.rstrip().endswith("(deleted)")
                }
        except OSError:
            continue
    return sorted(found)
