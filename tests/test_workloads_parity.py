"""The real workloads of benches/bench_workloads.py (tests/workloads.py), small,
give the same results in shared mode as in stock, with and without arrays born
shared, and on workers of one task thread or several; a task that mutates
its input in place changes what other tasks and workers see exactly as it
does in stock. Real LocalClusters of worker processes; shared mode switched
on by config, as a user does."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import dask
import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, wait
from workloads import WORKLOADS, spilling

from dask_shm.shared import shm_metrics

MiB = 2**20
WORKER_MEMORY = 384 * MiB
MEMORY = 2 * WORKER_MEMORY
#: sizes: 1/6 of the cluster's memory (e.g. double_diff: 2 x 128 MiB); the
#: spill thresholds are lowered so that spilling's array (1.79x) does spill
SCALE = 1 / 6
LOW_SPILL = {"distributed.worker.memory.target": 0.2, "distributed.worker.memory.spill": 0.3}

SHARED = {
    "distributed.worker.preload": ["dask_shm"],
    "distributed.nanny.preload": ["dask_shm"],
    "shm.shared-memory.enabled": True,
}
MODES = {
    "stock": LOW_SPILL,
    "shared": {**LOW_SPILL, **SHARED, "shm.shared-memory.born-shared": False},
    "shared-born": {**LOW_SPILL, **SHARED, "shm.shared-memory.born-shared": True},
    # LocalCluster's default on a many-core host: several task threads per
    # worker storing, spilling, exporting and reading values at once
    "shared-threads": {**LOW_SPILL, **SHARED, "shm.shared-memory.born-shared": False},
}
THREADS = {"shared-threads": 4}


@pytest.fixture(scope="module", params=list(MODES))
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[str, Client]]:
    with process_cluster(
        2,
        f"{WORKER_MEMORY}B",
        MODES[request.param],
        threads_per_worker=THREADS.get(request.param, 1),
        silence_logs=logging.ERROR,
    ) as client:
        yield request.param, client


@pytest.fixture(scope="module", params=list(MODES))
def unpressed_cluster(request: pytest.FixtureRequest) -> Iterator[tuple[str, Client]]:
    """A cluster of the mode with distributed's default thresholds and room
    to spare: nothing spills. A value spilled while a task writes to it in
    place keeps what the spill caught, in stock too: under ``LOW_SPILL``,
    after the workloads, stock lost or tore the write in 4 of 300 runs of
    :func:`mutation_scenario`, shared mode with born arrays in 4 of 300;
    unpressed, neither in 300."""
    config = {k: v for k, v in MODES[request.param].items() if k not in LOW_SPILL}
    threads = THREADS.get(request.param, 1)
    with process_cluster(
        2, "1 GiB", config, threads_per_worker=threads, silence_logs=logging.ERROR
    ) as client:
        yield request.param, client


#: mode -> workload -> result, filled as the modes run (stock first)
RESULTS: dict[str, dict[str, Any]] = {}


def record(mode: str, name: str, value: Any) -> None:
    RESULTS.setdefault(mode, {})[name] = value
    stock = RESULTS.get("stock", {}).get(name)
    assert mode == "stock" or stock is not None, "stock runs first (module fixture order)"
    assert value == stock, (mode, name, value, stock)


#: A known difference from stock, found by these tests (issue 26), left open.
#: spilling's sum in stock depends on whether the chunks were spilled: chunks
#: read back from stock's spill files can come back unaligned, and numpy sums
#: an unaligned array in buffered blocks, in another order (the last bit
#: differs). Shared mode reads chunks back 64-byte aligned, so its sum is the
#: one of a cluster that never spilled; that is what it is held to.
SPILL_ORDER_DEPENDENT = {"spilling": spilling}


#: Workloads run on the unpressed clusters. bag_groupby's lists of dicts
#: leave a worker memory no key accounts for: on LOW_SPILL's 384 MiB workers,
#: after the other workloads, a stock worker paused for good (RSS 334 MB,
#: over 80% of its limit, with every key already spilled), and the test
#: waited on it.
UNPRESSED = {"bag_groupby"}


@pytest.mark.timeout(900)  # a 2-core box shared with other jobs
@pytest.mark.parametrize("name", [name for name in WORKLOADS if name not in UNPRESSED])
def test_same_result_as_stock(cluster: tuple[str, Client], name: str) -> None:
    mode, client = cluster
    assert set(client.nthreads().values()) == {THREADS.get(mode, 1)}
    before = shm_totals(client) if mode != "stock" else {}
    value = WORKLOADS[name](client, MEMORY, SCALE)
    if name in SPILL_ORDER_DEPENDENT:
        unspilled = unspilled_result(name)
        if mode == "stock":
            assert value == pytest.approx(unspilled, rel=1e-12)
        else:
            assert value == unspilled, (mode, name, value, unspilled)
        return
    record(mode, name, value)
    if mode == "stock":
        return
    moved = {k: v - before[k] for k, v in shm_totals(client).items()}
    if name == "double_diff":
        assert moved["link_transfers"] > 0, "double_diff's shifted slices cross workers"
    if name in BY_P2P_FILE:
        assert moved["p2p_file_batches"] > 0, moved
        assert moved["p2p_file_fallbacks"] == 0, moved


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(UNPRESSED))
def test_same_result_as_stock_unpressed(unpressed_cluster: tuple[str, Client], name: str) -> None:
    mode, client = unpressed_cluster
    before = shm_totals(client) if mode != "stock" else {}
    record(mode, name, WORKLOADS[name](client, MEMORY, SCALE))
    if mode == "stock":
        return
    moved = {k: v - before[k] for k, v in shm_totals(client).items()}
    # lists of dicts, not worth sharing: sent as bytes, from the frames that told so
    assert moved["fallback_transfers"] > 0, moved


#: the P2P workloads, whose shards a same-host peer receives as files
BY_P2P_FILE = {"rechunk_p2p", "shuffle_p2p", "merge_p2p", "set_index_p2p"}


def shm_totals(client: Client) -> dict[str, float]:
    """The workers' shared-memory counters (dask_shm.shared.shm_metrics), summed."""
    totals: dict[str, float] = {}
    for figures in client.run(shm_metrics).values():
        for field, value in figures.items():
            totals[field] = totals.get(field, 0) + value
    return totals


@functools.cache
def unspilled_result(name: str) -> Any:
    """The workload's result computed in this process by dask's threaded
    scheduler (no spilling), past the cluster's client."""
    with dask.config.set(scheduler="threads"):
        return SPILL_ORDER_DEPENDENT[name](None, MEMORY, SCALE)


#: the values mutation_scenario hands over: 4 MiB, above min-size and
#: born-threshold (shared in shared mode); "sliced" is a view that skips each
#: row's first 8 elements, which shared mode writes into its file row by row
#: (dask_shm.spill_store) where stock copies it before sending it
SHAPES = {
    "contiguous": lambda: np.arange(4 * MiB // 8, dtype=float),
    "sliced": lambda: np.arange(512 * 1032, dtype=float).reshape(512, 1032)[:, 8:],
}


def make(shape: str) -> np.ndarray:
    return SHAPES[shape]()


def mutate(x: np.ndarray, _after: Any = None) -> float:
    x[:] = -1.0  # in place, as careless user code does
    return float(x.sum())


def total(x: np.ndarray, _after: Any = None) -> float:
    return float(x.sum())


def mutation_scenario(client: Client, shape: str) -> list[float]:
    """x made on a; read on b (a copy arrives there), then mutated in place
    by a task on b; then read again on a and on b. Then y made on a, sent to b,
    mutated on a, read on a and b. Returns the seven sums."""
    a, b = worker_addresses(client)
    seen = []
    x = client.submit(make, shape, workers=[a], pure=False)
    first = client.submit(total, x, workers=[b], pure=False)
    seen.append(first.result())
    changed = client.submit(mutate, x, first, workers=[b], pure=False)
    seen.append(changed.result())
    for where in (a, b):
        seen.append(client.submit(total, x, changed, workers=[where], pure=False).result())
    y = client.submit(make, shape, workers=[a], pure=False)
    on_b = client.submit(total, y, workers=[b], pure=False)
    wait(on_b)
    changed = client.submit(mutate, y, on_b, workers=[a], pure=False)
    seen.append(changed.result())
    for where in (a, b):
        seen.append(client.submit(total, y, changed, workers=[where], pure=False).result())
    return seen


@pytest.mark.parametrize("shape", list(SHAPES))
def test_in_place_mutation_never_reaches_another_worker(
    unpressed_cluster: tuple[str, Client], shape: str
) -> None:
    mode, client = unpressed_cluster
    original, mutated = float(make(shape).sum()), -float(make(shape).size)
    before = shm_totals(client) if mode != "stock" else {}
    seen = mutation_scenario(client, shape)
    assert (seen[2], seen[6]) == (original, original), seen  # the other worker's copy
    assert (seen[1], seen[4]) == (mutated, mutated), seen  # the mutating task's own view
    if mode != "stock":  # x and y reached b as files
        assert shm_totals(client)["link_transfers"] - before["link_transfers"] >= 2


@pytest.mark.parametrize("shape", list(SHAPES))
def test_in_place_mutation_is_seen_as_in_stock(
    unpressed_cluster: tuple[str, Client], shape: str
) -> None:
    """Stock: the mutating worker's later tasks see the mutation, the other
    worker's do not. Shared mode shows the same, with born arrays too."""
    mode, client = unpressed_cluster
    original, mutated = float(make(shape).sum()), -float(make(shape).size)
    seen = mutation_scenario(client, shape)
    record(mode, f"mutation, {shape}", seen)
    assert seen == [original, mutated, original, mutated, mutated, mutated, original]
