"""Many shared keys on a LocalCluster (issue 24, item 1): stock vs dask-shm in one run.

Run: ``pytest --timeout=0 benches/bench_scale.py`` (the project's 300 s
per-test limit stops a 100,000-key run on a small host). The ours/stock
time ratio is printed at the end by benches/conftest.py; the largest
event-loop ticks are in each benchmark's ``extra_info`` and printed as the
run goes.

Workload: ``keys`` makers of 72 KiB float arrays (above ``min-size``: each is
a shared file in shared mode), then ``keys`` tasks taking 3 of them each
(``i``, ``i + 1`` and ``i + keys / 2``, so most inputs live on another
worker), summed in a tree of 1,000-key partial sums; 4 worker processes x 1
thread x 4 GiB, distributed's default memory thresholds (the nanny's
terminate check included). Shared mode is switched on by config alone
(preloads + ``shm.shared-memory.enabled``), as a user would. Timed: the
computation (submit to result), not the cluster's start; run once each.

``extra_info``: ``max_tick_loop_ms``, the largest tick of the event loop that
runs the scheduler and the nannies (the client's too: one process), and
``max_tick_worker_ms``, the largest of any worker's, from distributed's own
``tick-duration`` metric (``Server.digests_max``), reset once the cluster is
up; ``shared_files`` (ours: files held by the workers at the end). Every
worker event-loop callback of 100 ms or more is timed and attributed to the
code that ran in it by sampling the loop thread's stack every 2 ms
(``tests/loop_attribution.py``). That sampler takes the GIL 500 times a
second per worker; ``DASK_SHM_BENCH_LOOP_SAMPLES=0`` turns it off (the
callbacks are then timed only, their time ``unsampled``) for wall times
without it. Whether it slows shared mode more than stock is not settled
(10,000 keys, dev box, stock / preload / shared alternated: shared mode
1.29x, 1.17x, 1.25x and 0.85x stock's wall with it, 0.82x, 0.87x and
1.11x without): ``slow_callbacks``,
``max_callback_ms``, and ``max_dask_shm_ms`` / ``max_distributed_ms``, the
most any one of them spent in dask-shm's / distributed's code
(``max_dask_shm_cpu_ms``: on the loop thread's CPU), ``max_gc_ms``; the five
longest are printed (all of them written to ``$DASK_SHM_BENCH_LOOPS.<impl>.json``
when that variable is set).

``worker_cpu_s``: the workers' CPU time (user + system, ``psutil``) over the
computation. ``DASK_SHM_BENCH_IMPLS`` (default ``stock,ours``) lists the runs,
in order; ``default`` is dask-shm preloaded without shared memory (on the
workers, nannies and, for its AMM and spans, the scheduler; ``ours`` preloads
the workers and nannies), so ``stock,default,ours`` separates what shared
mode costs from what the preload does.

``DASK_SHM_BENCH_KEYS`` (default 100000; e.g. 5000 for a run of a few
minutes on a small host) sets the number of keys.
``DASK_SHM_BENCH_TRANSFER_MIN_SIZE`` (default ``64 KiB``, ``min-size``'s)
sets ``shm.shared-memory.transfer-min-size``: at the default every value
is handed over as a file; ``1 MiB`` (the product's default) sends them as
bytes, as stock does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import dask
import numpy as np
import psutil
import pytest
from distributed import Client, LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import loop_attribution  # noqa: E402

KIB = 2**10
VALUE_BYTES = 72 * KIB
PARTIAL = 1000
KEYS = int(os.environ.get("DASK_SHM_BENCH_KEYS", "100000"))
TRANSFER_MIN_SIZE = os.environ.get("DASK_SHM_BENCH_TRANSFER_MIN_SIZE", "64 KiB")
#: the module of the workers' buffer in each run: what shows it switched on
BUFFER_MODULES = {
    "stock": "distributed.spill",
    "default": "dask_shm.spill",
    "ours": "dask_shm.shared.buffer",
}
IMPLS = os.environ.get("DASK_SHM_BENCH_IMPLS", "stock,ours").split(",")

#: worker callbacks this long or longer are attributed (issue 24's bound)
SLOW_CALLBACK = 0.1
#: seconds between samples of a worker loop's stack; None: no sampling
SAMPLE_INTERVAL = None if os.environ.get("DASK_SHM_BENCH_LOOP_SAMPLES") == "0" else 0.002

RESULTS: dict[int, dict[str, float]] = {}


def make_value(i: int) -> np.ndarray:
    return np.full(VALUE_BYTES // 8, float(i))


def take_three(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> float:
    return float(a[0] + b[-1] + c[len(c) // 2])


def total(parts: list[float]) -> float:
    return float(sum(parts))


def graph(n: int) -> dict[Any, Any]:
    """The workload as a task graph whose output key is ``"total"``."""
    dsk: dict[Any, Any] = {}
    for i in range(n):
        dsk[("v", i)] = (make_value, i)
    for i in range(n):
        dsk[("s", i)] = (take_three, ("v", i), ("v", (i + 1) % n), ("v", (i + n // 2) % n))
    chunks = range(0, n, PARTIAL)
    for j, start in enumerate(chunks):
        dsk[("t", j)] = (total, [("s", i) for i in range(start, min(start + PARTIAL, n))])
    dsk["total"] = (total, [("t", j) for j in range(len(chunks))])
    return dsk


def expected(n: int) -> float:
    return float(sum(i + (i + 1) % n + (i + n // 2) % n for i in range(n)))


def _reset_ticks(dask_worker: Any = None, dask_scheduler: Any = None) -> None:
    server = dask_worker or dask_scheduler
    server.digests_max.pop("tick-duration", None)


def _worker_figures(dask_worker: Any) -> dict[str, float]:
    data = dask_worker.data
    # Only the shared buffer's store has tiers and retained values.
    store = data.store if getattr(data, "shared", False) else None
    return {
        "tick": dask_worker.digests_max.get("tick-duration", 0.0),
        "files": len(store.tiers) if store is not None else 0,
        "mapped": len(store.retained) if store is not None else 0,
    }


def _cpu_seconds(dask_worker: Any = None) -> float:
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


def _config(impl: str) -> dict[str, Any]:
    """The dask config that switches ``impl`` on, as a user would."""
    preloads = {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
    }
    if impl == "stock":
        return {}
    if impl == "default":
        return {**preloads, "distributed.scheduler.preload": ["dask_shm"]}
    if impl == "ours":
        return {
            **preloads,
            "shm.shared-memory.enabled": True,
            # Every 72 KiB value goes to its peers as a file: what this bench
            # measures is many shared files per worker. By default values under
            # transfer-min-size (1 MiB) travel as bytes, as in stock.
            "shm.shared-memory.transfer-min-size": TRANSFER_MIN_SIZE,
        }
    raise ValueError(f"DASK_SHM_BENCH_IMPLS: unknown run {impl!r} (stock, default, ours)")


def _print_slow_callbacks(impl: str, loops: dict[str, dict[str, Any]]) -> None:
    """The five longest worker callbacks, with the seconds charged to each
    owner; all of them as JSON where ``DASK_SHM_BENCH_LOOPS`` names a file."""
    slow = sorted(
        (s for r in loops.values() for s in r["slow"]), key=lambda s: s["seconds"], reverse=True
    )
    print(f"\n{impl}: {len(slow)} worker callbacks of {SLOW_CALLBACK * 1000:.0f} ms or more")
    for s in slow[:5]:
        owners = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sorted(s["owner_seconds"].items()))
        print(
            f"  {s['seconds'] * 1000:.0f} ms, {s['cpu_seconds'] * 1000:.0f} ms CPU, "
            f"{s['samples']} samples ({owners}): {s['callback'][:100]}"
        )
        print(f"    innermost: {s['top'][:3]}")
    out = os.environ.get("DASK_SHM_BENCH_LOOPS")
    if out:
        with open(f"{out}.{impl}.json", "w") as f:
            json.dump(loops, f, indent=1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("keys", [KEYS])
def test_many_shared_keys(benchmark: Any, impl: str, keys: int) -> None:
    benchmark.group = f"{keys:,} 72 KiB keys, tasks taking 3 each, 4 workers"
    config = _config(impl)
    results: list[float] = []
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=4,
            threads_per_worker=1,
            processes=True,
            memory_limit="4GiB",
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):
        kinds = client.run(lambda dask_worker: type(dask_worker.data).__module__)
        assert set(kinds.values()) == {BUFFER_MODULES[impl]}, kinds
        dsk = graph(keys)
        timer = loop_attribution.LoopAttribution(threshold=SLOW_CALLBACK, interval=SAMPLE_INTERVAL)
        client.register_plugin(timer)
        client.run(loop_attribution.reset)
        client.run(_reset_ticks)
        cluster.scheduler.digests_max.pop("tick-duration", None)

        def compute() -> None:
            results.append(client.get(dsk, "total"))

        cpu_before = sum(client.run(_cpu_seconds).values())
        benchmark.pedantic(compute, rounds=1, iterations=1)
        worker_cpu = sum(client.run(_cpu_seconds).values()) - cpu_before
        loop_tick = cluster.scheduler.digests_max.get("tick-duration", 0.0)
        figures = client.run(_worker_figures)
        loops = client.run(loop_attribution.report)
    assert results[0] == expected(keys), (results[0], expected(keys))
    worker_tick = max(f["tick"] for f in figures.values())
    benchmark.extra_info.update(
        {
            "max_tick_loop_ms": round(loop_tick * 1000, 1),
            "max_tick_worker_ms": round(worker_tick * 1000, 1),
            "worker_cpu_s": round(worker_cpu, 2),
            "shared_files": int(sum(f["files"] for f in figures.values())),
            "mapped_values": int(sum(f["mapped"] for f in figures.values())),
            **{k: round(v, 1) for k, v in loop_attribution.summary(loops).items()},
        }
    )
    _print_slow_callbacks(impl, loops)
    print(
        f"\n{impl} {keys:,} keys: {benchmark.stats.stats.median:.1f} s, workers' CPU "
        f"{worker_cpu:.1f} s, max tick scheduler/nanny loop {loop_tick * 1000:.0f} ms, "
        f"workers {worker_tick * 1000:.0f} ms"
    )
    RESULTS.setdefault(keys, {})[impl] = results[0]
