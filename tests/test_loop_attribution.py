"""The bench helper that attributes a worker's long event-loop callbacks
(tests/loop_attribution.py) charges them to the code that really ran."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from distributed import Client, LocalCluster
from loop_attribution import LoopAttribution, report, reset, summary

from dask_shm.spill_store import file_stem


def _spin_in_dask_shm(seconds: float) -> tuple[float, float]:
    """Hold the worker's loop inside dask-shm code (``client.run`` calls a
    plain function in the event loop); returns when it began and ended."""
    start = time.perf_counter()
    n = 0
    while time.perf_counter() < start + seconds:
        # A long key: each call is long next to the loop's own lines (charged
        # to distributed), which a loaded host's samples otherwise hit often
        # enough to bring dask-shm's share near the 0.8 asserted below.
        file_stem(("x" * 4000, n))
        n += 1
    return start, time.perf_counter()


def _spin_here(seconds: float) -> tuple[float, float]:
    """Hold it in code of neither package: charged to distributed, the
    innermost owned frame (its ``run`` handler)."""
    start = time.perf_counter()
    n = 0
    while time.perf_counter() < start + seconds:
        n += 1
    return start, time.perf_counter()


def _the_callback(slow: list[dict], window: tuple[float, float]) -> dict:
    """The slow callback that ran throughout ``window`` (worker clock)."""
    found = [
        s for s in slow if s["started"] <= window[0] and window[1] <= s["started"] + s["seconds"]
    ]
    assert len(found) == 1, (window, slow)
    return found[0]


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    """One worker process with the plugin registered."""
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(LoopAttribution(threshold=0.1))
        client.run(_spin_here, 0)  # imports this module (and dask-shm) on the worker
        yield client


def test_long_callbacks_are_charged_to_the_code_that_ran(client: Client) -> None:
    client.run(reset)
    (ours_window,) = client.run(_spin_in_dask_shm, 0.4).values()
    (theirs_window,) = client.run(_spin_here, 0.4).values()
    (worker_report,) = client.run(report).values()
    slow = worker_report["slow"]
    assert worker_report["callbacks"] > 0
    ours = _the_callback(slow, ours_window)
    theirs = _the_callback(slow, theirs_window)
    assert ours["seconds"] >= 0.4
    assert ours["owner_seconds"]["dask_shm"] > 0.8 * ours["seconds"]
    assert ours["owner_cpu_seconds"]["dask_shm"] > 0.8 * ours["cpu_seconds"]
    assert theirs["seconds"] >= 0.4
    assert theirs["owner_seconds"].get("dask_shm", 0) < 0.05
    assert theirs["owner_seconds"]["distributed"] > 0.8 * theirs["seconds"]
    figures = summary({"w": worker_report})
    assert figures["slow_callbacks"] >= 2
    assert 0.8 * 400 < figures["max_dask_shm_ms"] <= figures["max_callback_ms"]


def _collect_garbage_in_the_loop(objects: int) -> float:
    """Hold the loop in a full collection of a heap of ``objects`` cycles."""
    import gc

    heap = [[i] for i in range(objects)]
    for cell in heap:
        cell.append(cell)  # a reference cycle each: the collector must walk them
    start = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - start
    del heap
    return seconds


def test_garbage_collection_is_charged_to_gc(client: Client) -> None:
    client.run(reset)
    (gc_seconds,) = client.run(_collect_garbage_in_the_loop, 3_000_000).values()
    (worker_report,) = client.run(report).values()
    assert gc_seconds > 0.1, "the collection was too quick to be a slow callback"
    slow = max(worker_report["slow"], key=lambda s: s["owner_seconds"].get("gc", 0))
    assert slow["owner_seconds"]["gc"] >= 0.9 * gc_seconds
    assert slow["owner_seconds"].get("dask_shm", 0) < 0.05, slow
