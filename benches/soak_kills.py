"""A soak with workers killed at random: run by hand, not by pytest.

A LocalCluster of nanny'd worker processes, dask-shm switched on by config
(``--mode shared``, the default) or not (``--mode stock``), runs a P2P
rechunk, a P2P shuffle, an all-to-all and a persist larger than the workers'
memory (so it spills), in random order, and in about half the runs SIGKILLs
a random worker at a random moment. Each result is compared with the
synchronous scheduler's. After the cluster closes nothing may be left in
the shared-memory root but its identity token (``root-id``).

    python benches/soak_kills.py --minutes 10 [--mode stock] [--seed 1] [--threads 1]

Prints one JSON line per run, then a summary; exits 1 if a result differed
or files were left. Computations that failed are listed but do not fail the
soak: distributed's P2P can itself fail a computation when a worker dies at
the wrong moment (a scheduler-side race), so compare their count with a
``--mode stock`` run. ``distributed.deploy.lost-worker-timeout`` is set to an
hour: otherwise the LocalCluster closes a nanny whose worker is killed twice
within 15 s, a stock race that would leave the cluster a worker short.
Found with it (stop 54): a worker its nanny had to kill at close left its
files on the tmpfs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client, LocalCluster, wait

WORKERS = 3
PARTITIONS = 16
ROWS = 2_000_000


def part(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    n = ROWS // PARTITIONS
    return pd.DataFrame({"k": rng.integers(0, 1000, n), "v": rng.random(n)})


def square(seed: int, side: int, chunks: tuple[int, int]) -> da.Array:
    return da.random.RandomState(seed).random_sample((side, side), chunks=chunks)


class Synchronous:
    """Computes with dask's synchronous scheduler: the expected results (P2P
    needs a cluster, so these move data the task-based way)."""

    method = "tasks"

    def get(self, collection: Any) -> Any:
        return collection.compute(scheduler="sync")

    def persist(self, collection: Any) -> Any:
        return collection


class OnCluster:
    """Computes on the cluster of ``client``, moving data by P2P."""

    method = "p2p"

    def __init__(self, client: Client):
        self.client = client

    def get(self, collection: Any) -> Any:
        return self.client.compute(collection).result(timeout=300)

    def persist(self, collection: Any) -> Any:
        persisted = self.client.persist(collection)
        wait(persisted, timeout=300)
        return persisted


Runner = Synchronous | OnCluster


def matmul(seed: int, run: Runner) -> Any:
    x = square(seed, 3000, (500, 500))
    return float(run.get((x @ x.T).sum()))


def rechunk(seed: int, run: Runner) -> Any:
    x = square(seed, 4000, (4000, 100))
    with dask.config.set({"array.rechunk.method": run.method}):
        y = x.rechunk((100, 4000))
    return float(run.get((y * np.arange(4000)).sum()))


def shuffle(seed: int, run: Runner) -> Any:
    df = dd.from_map(part, range(PARTITIONS)).shuffle("k", shuffle_method=run.method)
    per_part = df.map_partitions(
        lambda p: pd.DataFrame(
            {"n": [len(p)], "s": [float((p["v"] * p["k"]).sum())], "u": [p["k"].nunique()]}
        )
    )
    got = run.get(per_part)
    # a correct shuffle puts each key in one partition: the distinct keys add up
    return (int(got["n"].sum()), float(got["s"].sum()), int(got["u"].sum()))


def persist(seed: int, run: Runner) -> Any:
    """More than the workers' memory held at once: spilled, then read twice."""
    x = run.persist(da.random.RandomState(seed).random_sample((12000, 4000), chunks=(500, 4000)))
    return (float(run.get(x.sum())), float(run.get((x[::-1] + x).sum())))


WORKLOADS: dict[str, Callable[[int, Runner], Any]] = {
    "matmul": matmul,
    "rechunk": rechunk,
    "shuffle": shuffle,
    "persist": persist,
}


def equal(got: Any, expected: Any) -> bool:
    """Equal, floats to 1e-9 relative: sums taken in another order (P2P
    partitions, another chunking) differ in their last bits."""
    if isinstance(expected, tuple):
        return len(got) == len(expected) and all(map(equal, got, expected))
    if isinstance(expected, float):
        return math.isclose(got, expected, rel_tol=1e-9)
    return bool(got == expected)


def files_under(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)


def worker_pids(client: Client) -> list[int]:
    pids = client.run(os.getpid, on_error="ignore")
    return [p for p in pids.values() if isinstance(p, int)]


def soak(mode: str, root: str, seconds: float, seed: int, threads: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    config: dict[str, Any] = {
        "distributed.scheduler.allowed-failures": 10,
        "distributed.deploy.lost-worker-timeout": "1h",
    }
    if mode == "shared":
        config.update(
            {
                "distributed.worker.preload": ["dask_shm"],
                "distributed.nanny.preload": ["dask_shm"],
                "shm.shared-memory.enabled": True,
                "shm.shared-memory.root": root,
            }
        )
    expected: dict[tuple[str, int], Any] = {}
    summary: dict[str, Any] = {"runs": 0, "kills": 0, "differed": [], "failed": []}
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=WORKERS,
            threads_per_worker=threads,
            memory_limit="600 MiB",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        on_cluster = OnCluster(client)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            name, data_seed = rng.choice(sorted(WORKLOADS)), rng.randrange(4)
            workload = WORKLOADS[name]
            if (name, data_seed) not in expected:
                expected[name, data_seed] = workload(data_seed, Synchronous())
            pids = worker_pids(client) if rng.random() < 0.5 else []
            killer = None
            if pids:
                victim, delay = rng.choice(pids), rng.uniform(0.2, 3.0)

                def kill(victim: int = victim, delay: float = delay) -> None:
                    time.sleep(delay)
                    try:
                        os.kill(victim, signal.SIGKILL)
                        summary["kills"] += 1
                    except ProcessLookupError:
                        pass

                killer = threading.Thread(target=kill)
                killer.start()
            start = time.monotonic()
            try:
                got = workload(data_seed, on_cluster)
                if not equal(got, expected[name, data_seed]):
                    summary["differed"].append([name, data_seed, got, expected[name, data_seed]])
            except Exception as e:
                summary["failed"].append([name, data_seed, bool(pids), f"{type(e).__name__}: {e}"])
            if killer is not None:
                killer.join()
            summary["runs"] += 1
            line = {"run": summary["runs"], "workload": name, "kill": bool(pids)}
            line["seconds"] = round(time.monotonic() - start, 1)
            print(json.dumps(line), flush=True)
            client.wait_for_workers(WORKERS, timeout=300)
    time.sleep(1)
    summary["left"] = [
        os.path.relpath(f, root) for f in files_under(root) if os.path.basename(f) != "root-id"
    ]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--mode", choices=["shared", "stock"], default="shared")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="task threads per worker")
    parser.add_argument("--root", help="a tmpfs directory (default: a new one on /dev/shm)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="dask-shm-soak-", dir="/dev/shm")
    try:
        summary = soak(args.mode, root, args.minutes * 60, args.seed, args.threads)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {"mode": args.mode, "seed": args.seed, "threads": args.threads, **summary}, default=str
        )
    )
    return 1 if summary["differed"] or summary["left"] else 0


if __name__ == "__main__":
    sys.exit(main())
