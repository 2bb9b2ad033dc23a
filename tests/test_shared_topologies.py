"""Issue 24: shared-memory mode on every host topology. Two simulated hosts
(host B in its own network and mount namespace, see ``hosts.py``) with one
real ``dask worker`` each, in shared mode with a tier 2 small enough that
tier 3 is used:

- separate tmpfs (and disks): nothing is linked, everything goes as bytes;
- one tmpfs shared, separate tier-3 directories under the same path:
  tier-2 files are linked, tier-3 values go as bytes (this deadlocked);
- everything shared: both tiers are linked;
- as the previous but with host B's tier-3 directory carrying a copy of
  host A's identity token (a cloned image): the tier-3 handles host B
  receives cannot be resolved; they are missing on that peer, fetched again
  as bytes, and the result is still correct.

Each: correct results, and no files left once the workers closed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import pytest
from distributed import Client

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hosts import two_hosts  # noqa: E402

N = 16
ELEMENTS = 2**17  # 1 MiB arrays: above min-size, shared files


def _files_under(*directories: str) -> list[str]:
    """Regular files left under ``directories`` (the roots' identity tokens
    excepted: they stay for the root's life)."""
    left = []
    for d in directories:
        for base, _, names in os.walk(d):
            left += [os.path.join(base, n) for n in names if n != "root-id"]
    return left


def _counters(dask_worker) -> dict:
    data = dask_worker.data
    tiers = data.store.tiers
    return {
        **data.shm_counters,
        "tier3_files": tiers.overflow_writes + tiers.moves,
    }


def _total(counters: dict, name: str) -> int:
    return sum(c.get(name, 0) for c in counters.values())


def _compute(client: Client, a: str, b: str) -> list[float]:
    """Values made on both hosts, each task taking one from each host."""
    xs = [
        client.submit(np.full, ELEMENTS, float(i), workers=[a if i % 2 else b], key=f"x-{i}")
        for i in range(N)
    ]
    ys = [
        client.submit(
            lambda u, v: float(u.sum() + v.sum()),
            xs[i],
            xs[(i + 1) % N],
            workers=[b if i % 2 else a],
            key=f"y-{i}",
        )
        for i in range(N)
    ]
    return client.gather(ys)


def _expected() -> list[float]:
    return [float(ELEMENTS * (i + (i + 1) % N)) for i in range(N)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "topology", ["separate", "shared-tmpfs", "everything-shared", "cloned-token"]
)
def test_two_hosts(topology: str) -> None:
    tag = uuid.uuid4().hex[:8]
    shm = tempfile.mkdtemp(prefix=f"dask-shm-topo-{tag}-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix=f"dask-shm-topo-{tag}-disk-")
    b_shm = tempfile.mkdtemp(prefix=f"dask-shm-topo-{tag}-bshm-")
    b_disk = tempfile.mkdtemp(prefix=f"dask-shm-topo-{tag}-bdisk-")
    mounted = False
    try:
        with two_hosts() as hosts:
            if topology == "separate":
                proc = subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", "size=256m,mode=1777", "tmpfs", b_shm],
                    capture_output=True,
                    text=True,
                )
                if proc.returncode != 0:
                    pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
                mounted = True
                hosts.binds_b += [(b_shm, shm), (b_disk, disk)]
            elif topology in ("shared-tmpfs", "cloned-token"):
                hosts.binds_b.append((b_disk, disk))
            if topology == "cloned-token":
                from dask_shm.shared import paths, root_id

                token = root_id.root_token(disk)
                user_dir = os.path.join(b_disk, f"dask-shm-{os.geteuid()}")
                os.makedirs(user_dir, mode=0o700)
                with open(os.path.join(user_dir, root_id.TOKEN_FILE), "w") as f:
                    f.write(token)
                assert paths.user_dir_path(disk) != user_dir
            env = {
                "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
                "DASK_SHM__SHARED_MEMORY__ROOT": shm,
                "DASK_SHM__SHARED_MEMORY__DISK_ROOT": disk,
                "DASK_SHM__SHARED_MEMORY__MAX_BYTES": "3 MiB",
                "DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False",
                # the workers unpickle this module's functions
                "PYTHONPATH": os.pathsep.join(
                    [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
                ),
            }
            with hosts.cluster([("a", "host-a"), ("b", "host-b")], env) as (client, by_name):
                a, b = by_name["host-a"], by_name["host-b"]
                assert a.startswith(f"tcp://{hosts.ip_a}:")
                assert b.startswith(f"tcp://{hosts.ip_b}:")
                assert all(client.run(lambda dask_worker: dask_worker.data.shared).values())

                assert _compute(client, a, b) == _expected()

                counters = client.run(_counters)
                if topology != "separate":  # (there nothing is handed over or spilled)
                    assert _total(counters, "tier3_files") > 0, counters
                links = _total(counters, "link_transfers")
                as_bytes = _total(counters, "fallback_transfers")
                if topology == "separate":
                    # not peers at all: no link, and not counted as a fallback either
                    assert links == 0 and as_bytes == 0, counters
                elif topology == "shared-tmpfs":
                    assert links > 0 and as_bytes > 0, counters  # tier 2 linked, tier 3 not
                    assert _total(counters, "unresolved_handles") == 0, counters
                elif topology == "everything-shared":
                    assert links > 0 and as_bytes == 0, counters
                else:  # cloned-token: tier-3 handles cannot be resolved, then bytes
                    assert _total(counters, "unresolved_handles") > 0, counters
                    assert links > 0 and as_bytes > 0, counters  # tier 2 still linked
                client.cancel([f"y-{i}" for i in range(N)])
        # Host B's namespace is gone: its bind mounts with it.
        time.sleep(0.1)
        left = _files_under(shm, disk, b_shm, b_disk)
        assert left == [], f"files left behind: {left}"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", b_shm], check=False)
        for d in (shm, disk, b_shm, b_disk):
            shutil.rmtree(d, ignore_errors=True)
