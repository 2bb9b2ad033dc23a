"""A P2P dataframe shuffle and a P2P array rechunk on a real LocalCluster,
stock or in shared-memory mode (config alone), with what crossed loopback.

Run as a script (``python p2p_workload.py MODE ROOT``, MODE ``stock`` or
``shared``) it prints one JSON line per workload: the loopback bytes
(``/proc/net/dev``, ``lo``, received) during the compute, a checksum of the
result, the workers' P2P counters, the ``*.p2p`` files left under ROOT and
the keys of the P2P fine performance metrics so far.
The tests run it in a network namespace of its own (``unshare --net``), so
that other processes' loopback traffic is not counted.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from clusters import process_cluster
from distributed import Client

ROWS = 2_000_000
ARRAY_SIDE = 4096


def shared_config(root: str) -> dict:
    return {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.root": root,
    }


def loopback_bytes() -> int:
    """Bytes received on ``lo`` in this network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    raise RuntimeError("no lo in /proc/net/dev")


def shard_files(root: str) -> list[str]:
    return [
        os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".p2p")
    ]


PARTITIONS = 16


def part(i: int) -> pd.DataFrame:
    """Input partition ``i``, made on the worker (not sent in the graph)."""
    rng = np.random.default_rng(i)
    n = ROWS // PARTITIONS
    return pd.DataFrame({"k": rng.integers(0, 1000, n), "v": rng.random(n), "w": rng.random(n)})


def frame() -> pd.DataFrame:
    return pd.concat([part(i) for i in range(PARTITIONS)], ignore_index=True)


def shuffled_checksum(client: Client) -> float:
    """Each output partition's rows all share their keys' partition: summed
    per partition with the key, a digest any correct shuffle reproduces."""
    df = dd.from_map(part, range(PARTITIONS))
    out = df.shuffle("k", shuffle_method="p2p")
    parts = out.map_partitions(
        lambda p: pd.DataFrame(
            {"n": [len(p)], "keys": [p["k"].nunique()], "s": [float((p["v"] * p["k"]).sum())]}
        ),
        meta={"n": "i8", "keys": "i8", "s": "f8"},
    ).compute()
    total = frame()
    assert int(parts["n"].sum()) == len(total)
    assert int(parts["keys"].sum()) == total["k"].nunique()  # no key split across partitions
    return round(float(parts["s"].sum()), 3)


def rechunked_checksum(client: Client) -> float:
    x = da.random.default_rng(0).random((ARRAY_SIDE, ARRAY_SIDE), chunks=(ARRAY_SIDE, 256))
    with dask.config.set({"array.rechunk.method": "p2p"}):
        y = x.rechunk((256, ARRAY_SIDE))
    weights = np.arange(ARRAY_SIDE, dtype=float)
    return round(float((y * weights).sum().compute()), 3)


def p2p_counters(dask_worker) -> dict:
    counters = getattr(dask_worker.data, "shm_counters", {})
    return {k: v for k, v in counters.items() if k.startswith("p2p_")}


def _summed(per_worker: dict) -> dict:
    total: dict[str, float] = {}
    for figures in per_worker.values():
        for k, v in figures.items():
            total[k] = total.get(k, 0) + v
    return total


@contextmanager
def cluster(mode: str, root: str) -> Iterator[Client]:
    """Two workers of ``$P2P_MEMORY_LIMIT`` each (default 2 GiB; ``auto``:
    distributed's share of the machine, or of the memory cgroup we run in)."""
    config = shared_config(root) if mode == "shared" else {}
    memory_limit = os.environ.get("P2P_MEMORY_LIMIT", "2GiB")
    with process_cluster(2, memory_limit, config, host="127.0.0.1") as client:
        yield client


def limits(dask_worker) -> dict:
    """The worker's memory limit and, in shared mode, its tier-2 budget."""
    store = getattr(dask_worker.data, "store", None)
    budget = store.tiers.tiers[0].budget.limit if store is not None else None
    return {"memory_limit": dask_worker.memory_manager.memory_limit, "tier2_budget": budget}


async def _heartbeat(dask_worker) -> None:
    await dask_worker.heartbeat()


def p2p_metric_keys(client: Client) -> list[list[str]]:
    """The keys of the scheduler's fine performance metrics of P2P (those
    starting with "p2p"), once every worker has reported its own."""
    client.run(_heartbeat)
    keys = client.run_on_scheduler(
        lambda dask_scheduler: [list(k) for k in dask_scheduler.cumulative_worker_metrics]
    )
    return sorted(k for k in keys if k[0] == "p2p")


def main(mode: str, root: str) -> None:
    with cluster(mode, root) as client:
        for name, workload in (("shuffle", shuffled_checksum), ("rechunk", rechunked_checksum)):
            start = _summed(client.run(p2p_counters))
            before = loopback_bytes()
            checksum = workload(client)
            lo = loopback_bytes() - before
            end = _summed(client.run(p2p_counters))
            counters = {k: v - start.get(k, 0) for k, v in end.items()}
            print(
                json.dumps(
                    {
                        "workload": name,
                        "mode": mode,
                        "loopback": lo,
                        "checksum": checksum,
                        "counters": counters,
                        "files_left": shard_files(root),
                        "limits": list(client.run(limits).values()),
                        "p2p_metric_keys": p2p_metric_keys(client),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
