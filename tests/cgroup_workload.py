"""Out-of-core workload for the memory-cgroup and small-tmpfs scenarios.

Run as a script (``python cgroup_workload.py '<json options>'``), usually by
:func:`memory_cgroup.run_workload` inside a memory cgroup: starts a
LocalCluster (2 worker processes x 1 thread), persists two arrays of
``gib`` GiB in total, reduces them and prints one JSON line with the result,
the wall time and what happened to the workers (pids before/after, restart
events). Options: ``mode`` ("stock" or "ours": shared-memory mode by config
alone), ``gib``, ``memory_limit``, ``root``, ``disk_root``, ``max_bytes``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(options: dict) -> dict:
    import dask.array as da
    from clusters import process_cluster
    from distributed import wait

    config: dict = {}
    if options["mode"] == "ours":
        config.update(
            {
                "distributed.worker.preload": ["dask_shm"],
                "distributed.nanny.preload": ["dask_shm"],
                "shm.shared-memory.enabled": True,
                "shm.shared-memory.root": options.get("root", "/dev/shm"),
                "shm.shared-memory.disk-root": options.get("disk_root"),
                "shm.shared-memory.max-bytes": options.get("max_bytes", "auto"),
            }
        )
    if options.get("local_directory"):
        config["temporary-directory"] = options["local_directory"]
    n = int(options["gib"] * 2**30 / 8 / 2)
    chunk = 8 * 2**20 // 8
    with process_cluster(2, options["memory_limit"], config) as client:
        pids_before = client.run(os.getpid)
        shared = client.run(lambda dask_worker: type(dask_worker.data).__name__)
        start = time.perf_counter()
        x = da.arange(n, chunks=chunk, dtype="f8")
        y = x % 7.0
        x, y = client.persist([x, y])
        wait([x, y])
        result = float((x * y).sum().compute())
        wall = time.perf_counter() - start

        def where(dask_worker):  # type: ignore[no-untyped-def]
            data = dask_worker.data
            store = getattr(data, "store", None)
            tiers = getattr(store, "tiers", None)
            if tiers is None:
                return {"tier3_files": 0, "tier3_moves": 0}
            return {"tier3_files": len(tiers.tier("disk").store), "tier3_moves": tiers.moves}

        tiers = client.run(where)
        pids_after = client.run(os.getpid)
        restarts = len(client.get_events("worker-restart-memory") or ())
        del x, y
    return {
        "result": result,
        "wall": wall,
        "data": shared,
        "workers_replaced": len(set(pids_before.values()) - set(pids_after.values())),
        "restart_events": restarts,
        "tier3_files": sum(t["tier3_files"] for t in tiers.values()),
        "tier3_moves": sum(t["tier3_moves"] for t in tiers.values()),
    }


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(out), flush=True)
