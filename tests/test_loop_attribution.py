"""The bench helper that attributes a worker's long event-loop callbacks
(tests/loop_attribution.py) charges them to the code that really ran."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from distributed import Client, LocalCluster
from loop_attribution import LoopAttribution, report, reset, summary

from dask_shm.spill_store import file_stem

#: Stack samples a spin waits for: the sampler gets the GIL about once per
#: switch interval of the loop thread's running, so on a loaded host a 0.4 s
#: window held as few as 5, and one sample in the spin's own lines (charged
#: to distributed) was a 20% share.
MIN_SAMPLES = 100


def _spin(seconds: float, dask_worker: Any, step: Callable[[int], object]) -> tuple[float, float]:
    """Hold the worker's loop in ``step`` for at least ``seconds`` and until
    the sampler has taken MIN_SAMPLES samples in this callback (``client.run``
    calls a plain function in the event loop); returns when it began and
    ended."""
    plugin = dask_worker.plugins[LoopAttribution.name]
    start = time.perf_counter()
    n = 0
    while True:
        for _ in range(100):
            step(n)
            n += 1
        if (
            time.perf_counter() >= start + seconds
            and plugin.samples_in_running_callback() >= MIN_SAMPLES
        ):
            return start, time.perf_counter()


def _spin_in_dask_shm(seconds: float, dask_worker: Any) -> tuple[float, float]:
    """In dask-shm code: charged to dask_shm."""
    return _spin(seconds, dask_worker, lambda n: file_stem(("x", n)))


def _spin_here(seconds: float, dask_worker: Any) -> tuple[float, float]:
    """In code of neither package: charged to distributed, the innermost
    owned frame (its ``run`` handler)."""
    return _spin(seconds, dask_worker, lambda n: n + 1)


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
    # the spin's own lines and lambda are charged to distributed: 5-15%
    assert ours["samples"] >= MIN_SAMPLES
    assert ours["owner_seconds"]["dask_shm"] > 0.7 * ours["seconds"]
    assert ours["owner_cpu_seconds"]["dask_shm"] > 0.7 * ours["cpu_seconds"]
    assert theirs["seconds"] >= 0.4
    assert theirs["owner_seconds"].get("dask_shm", 0) < 0.05
    assert theirs["owner_seconds"]["distributed"] > 0.8 * theirs["seconds"]
    figures = summary({"w": worker_report})
    assert figures["slow_callbacks"] >= 2
    assert 0.7 * 400 < figures["max_dask_shm_ms"] <= figures["max_callback_ms"]


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
