"""A real memory cgroup (v1 or v2) for tests and benches, and running the
out-of-core workload (``cgroup_workload.py``) inside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from dask_shm.shared.limits import cgroup_memory

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cgroup_workload.py")


def _own_cgroup_dir() -> tuple[str, str] | None:
    """(version, directory) under which this process may create a memory cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = os.path.join("/sys/fs/cgroup/memory", rel.lstrip("/"))
            if os.access(path, os.W_OK):
                return "v1", path
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                path = os.path.join(base, rel.lstrip("/"))
                if os.path.exists(os.path.join(path, "cgroup.subtree_control")) and os.access(
                    path, os.W_OK
                ):
                    with open(os.path.join(path, "cgroup.subtree_control")) as f:
                        if "memory" in f.read().split():
                            return "v2", path
    return None


def unavailable_reason() -> str | None:
    """Why a memory cgroup cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "memory cgroups need Linux"
    if os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    if _own_cgroup_dir() is None:
        return "no writable memory cgroup hierarchy (v1 memory controller or v2 with memory)"
    return None


@dataclass
class MemoryCgroup:
    version: str
    path: str
    limit: int
    samples: list[int] = field(default_factory=list)
    #: sampled anonymous + tmpfs bytes (what the kernel cannot reclaim without swap)
    unreclaimable: list[int] = field(default_factory=list)

    def _file(self, v1: str, v2: str) -> str:
        return os.path.join(self.path, v1 if self.version == "v1" else v2)

    def usage(self) -> int:
        with open(self._file("memory.usage_in_bytes", "memory.current")) as f:
            return int(f.read())

    def anon_and_shmem(self) -> int:
        """Anonymous plus tmpfs/shmem bytes charged to the cgroup."""
        stat: dict[str, int] = {}
        with open(self._file("memory.stat", "memory.stat")) as f:
            for line in f:
                k, v = line.split()
                stat[k] = int(v)
        if self.version == "v1":
            return stat.get("total_rss", 0) + stat.get("total_shmem", 0)
        return stat.get("anon", 0) + stat.get("shmem", 0)

    def peak(self) -> int:
        """Largest usage seen by the kernel (v1) or by sampling (v2)."""
        if self.version == "v1":
            with open(self._file("memory.max_usage_in_bytes", "")) as f:
                return int(f.read())
        return max(self.samples, default=self.usage())

    def oom_kills(self) -> int:
        name = self._file("memory.oom_control", "memory.events")
        with open(name) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def add_self(self) -> None:
        """Move the calling process into the cgroup (for a child's preexec_fn)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


@contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup of ``limit`` bytes (no swap) below this process's
    own, removed afterwards (its processes must have exited)."""
    where = _own_cgroup_dir()
    if where is None:
        raise RuntimeError(unavailable_reason())
    version, parent = where
    path = os.path.join(parent, f"dask-shm-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    cg = MemoryCgroup(version, path, limit)
    try:
        # The limit, and no swap (where the kernel lets us say so).
        limit_file, swap_file = (
            ("memory.limit_in_bytes", "memory.swappiness")
            if version == "v1"
            else ("memory.max", "memory.swap.max")
        )
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(limit))
        try:
            with open(os.path.join(path, swap_file), "w") as f:
                f.write("0")
        except OSError:
            pass
        yield cg
    finally:
        for _ in range(100):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)
    assert cgroup_memory  # the facts module reads what this creates


def run_workload(options: dict, cgroup: MemoryCgroup | None = None, timeout: float = 600) -> dict:
    """Run ``cgroup_workload.py`` with ``options`` (inside ``cgroup`` if
    given, the whole process tree) and return its JSON result, plus
    ``returncode`` and the cgroup's ``peak`` and ``oom_kills``.

    Raises RuntimeError (with the output's tail) if it printed no result.
    """
    stop = threading.Event()

    def sample() -> None:
        while cgroup is not None and not stop.wait(0.05):
            try:
                cgroup.samples.append(cgroup.usage())
                cgroup.unreclaimable.append(cgroup.anon_and_shmem())
            except OSError:
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc = subprocess.run(
            [sys.executable, WORKLOAD, json.dumps(options)],
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=cgroup.add_self if cgroup is not None else None,
        )
    finally:
        stop.set()
        sampler.join()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(
            f"workload printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    out = json.loads(lines[-1][len("RESULT ") :])
    out["returncode"] = proc.returncode
    out["stderr"] = proc.stderr
    if cgroup is not None:
        out["peak"] = cgroup.peak()
        out["peak_unreclaimable"] = max(cgroup.unreclaimable, default=0)
        out["oom_kills"] = cgroup.oom_kills()
    return out
