"""A shared-mode LocalCluster holding data on both tiers, waiting to be killed.

Run as a script (``python killed_cluster.py '<json options>'``), in a process
group of its own, by ``test_shared_reclaim.py``: starts a LocalCluster of two
worker processes in shared-memory mode by config alone (``root``,
``disk_root``, ``max_bytes`` per worker), has each worker make ``arrays``
arrays of 8 MiB that the other one fetches (hard links on tier 2 within the
budget, tier 3 beyond it), prints one JSON line with the workers' pids and
process directories on both tiers, then sleeps until it is killed.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(options: dict) -> None:
    import numpy as np
    from clusters import process_cluster
    from distributed import wait

    config = {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.root": options["root"],
        "shm.shared-memory.disk-root": options["disk_root"],
        "shm.shared-memory.max-bytes": options["max_bytes"],
    }
    with process_cluster(2, "2 GiB", config) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        held = []
        for maker, taker in ((a, b), (b, a)):
            for i in range(options["arrays"]):
                x = client.submit(np.full, 2**20, float(i), workers=[maker], pure=False)
                held += [x, client.submit(np.sum, x, workers=[taker], pure=False)]
        wait(held)

        def directories(dask_worker):
            store = dask_worker.data.store
            return {
                "pid": os.getpid(),
                "tier2": os.path.dirname(str(store.directory)),
                "tier3": os.path.dirname(str(store.tiers.tier("disk").store.directory)),
            }

        print(json.dumps(list(client.run(directories).values())), flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
