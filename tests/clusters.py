"""The real cluster most cluster tests run on, in one place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import dask
from distributed import Client, LocalCluster

NO_AMM = {"distributed.scheduler.active-memory-manager.start": False}

#: For in-process workers given a memory limit: their memory monitor reads the
#: whole pytest process, whose RSS grows past 800 MiB over the suite (freed
#: heap that glibc keeps), so a 1 GiB worker would pause and its next task
#: would wait for ever. Tests that are about pausing do not use this.
IN_PROCESS_NO_PAUSE = {"distributed.worker.memory.pause": False}


@contextlib.contextmanager
def process_cluster(
    n_workers: int,
    memory_limit: str | int,
    config: dict | None = None,
    threads_per_worker: int = 1,
    **cluster_kwargs: Any,
) -> Iterator[Client]:
    """A client of a LocalCluster of ``n_workers`` worker processes
    (``threads_per_worker`` threads each, no dashboard) with ``memory_limit``
    each, under ``config`` with the Active Memory Manager off (it would drop
    the replicas tests count); extra keyword arguments go to LocalCluster."""
    with (
        dask.config.set({**NO_AMM, **(config or {})}),
        LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads_per_worker,
            processes=True,
            memory_limit=memory_limit,
            dashboard_address=":0",
            **cluster_kwargs,
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def worker_addresses(client: Client) -> list[str]:
    """The addresses of the cluster's workers as the scheduler has them now, sorted.

    Not ``client.scheduler_info()["workers"]``: the client's periodic refresh
    stores an identity without workers, and it can land between the fetch and
    the return of ``scheduler_info()``, which then has no workers."""
    identity = client.sync(client.scheduler.identity, n_workers=-1)
    return sorted(identity["workers"])
