"""Spans extensions in real clusters: parity with stock, per-span memory, Prometheus."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from clusters import process_cluster
from distributed import Client, Scheduler, Worker, span
from distributed.scheduler import DEFAULT_EXTENSIONS as SCHEDULER_EXTENSIONS
from distributed.utils_test import gen_cluster, gen_test
from distributed.worker import DEFAULT_EXTENSIONS as WORKER_EXTENSIONS

import dask_shm
from dask_shm.spans import (
    Span,
    SpanMemory,
    SpansSchedulerExtension,
    SpansSchedulerPlugin,
    SpansWorkerExtension,
    SpansWorkerPlugin,
    install_scheduler_extension,
    install_worker_extension,
    span_memory,
)

OURS_SCHEDULER = {"extensions": {**SCHEDULER_EXTENSIONS, "spans": SpansSchedulerExtension}}
OURS_WORKER = {"extensions": {**WORKER_EXTENSIONS, "spans": SpansWorkerExtension}}
NO_MONITOR = {
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
    "distributed.worker.memory.spill": False,
}
MIB = 2**20


def inc(x: int) -> int:
    return x + 1


def double(x: int) -> int:
    return 2 * x


def block(nbytes: int, seed: int) -> np.ndarray:
    return np.full(nbytes // 8, seed, dtype="f8")


def total(*arrays: np.ndarray) -> float:
    return float(sum(a.sum() for a in arrays))


async def heartbeat_and_measure(dask_worker: Worker) -> dict[str, int]:
    """Send a heartbeat now, then measure what the worker holds (cluster is idle)."""
    await dask_worker.heartbeat()
    data: Any = dask_worker.data
    if hasattr(data, "fast"):
        memory = int(sum(data.fast.weights.values()))
        spilled, spilled_disk = (int(v) for v in data.spilled_total)
    else:
        memory = sum(dask_worker.state.tasks[k].nbytes for k in data)
        spilled = spilled_disk = 0
    return {
        "memory": memory,
        "spilled": spilled,
        "spilled_disk": spilled_disk,
        "nbytes": dask_worker.state.nbytes,
        "n_keys": len(data),
    }


# --- parity with stock on a real cluster ----------------------------------------


async def workload(c: Client) -> None:
    with span("etl"):
        with span("load"):
            x = c.map(inc, range(6), key=[f"load-{i}" for i in range(6)])
        with span("transform"):
            y = c.map(double, x, key=[f"transform-{i}" for i in range(6)])
        await c.gather(y)
    # Un-annotated work: a default span that closes once done and reopens.
    await c.submit(inc, 10, key="free-1")
    await c.submit(inc, 11, key="later-1")
    with span("etl"):  # same tag reopened: a separate span
        await c.submit(inc, 12, key="again-1")
    del x, y


def summarize(s: Scheduler) -> dict[str, Any]:
    ext = s.extensions["spans"]

    def one(sp: Any) -> dict[str, Any]:
        return {
            "name": sp.name,
            "states": sp.states,
            "done": sp.done,
            "nbytes_total": sp.nbytes_total,
            "groups": sorted(tg.name for tg in sp.traverse_groups()),
            "children": [c.name for c in sp.children],
            "annotation": sp.annotation and sp.annotation["name"],
            "executed": sorted(
                k[1]
                for k in sp.cumulative_worker_metrics
                if k[0] == "execute" and k[2] == "thread-cpu"
            ),
            # The worker reports a "disk-read" duration when loading a task's inputs
            # took more than 5 ms: timing-dependent, so only "compute" is compared
            "computed": "compute" in sp.all_durations,
            "has_start": sp.start > 0,
            "stop_after_enqueued": sp.stop >= sp.enqueued,
            # nthreads_intervals is empty when stop == enqueued: timing-dependent too
            "cpu_seconds_ok": sp.active_cpu_seconds >= 0,
            "threads": {n for _, _, n in sp.nthreads_intervals} <= {2},
        }

    # Two non-default tags, the last ones in alphabetical order (children of "etl" in
    # the main workload)
    tags = sorted(t for t in ext.spans_search_by_tag if t != "default")[-2:]
    return {
        "spans": [one(sp) for sp in ext.spans.values()],
        "roots": [sp.name for sp in ext.root_spans],
        "find": [sp.name for sp in ext.find_by_tags("load", "etl", *tags)],
        "merge_all": one(ext.merge_all()),
        "merge_tags": one(ext.merge_by_tags(*tags)),
        "task_spans": sorted(
            (str(k), ts.annotations.get("span", {}).get("name"))
            for k, ts in s.tasks.items()
            if ts.annotations is not None
        ),
    }


async def run_on_cluster(
    scheduler_kwargs: dict, worker_kwargs: dict, work: Callable[[Client], Awaitable[None]]
) -> dict[str, Any]:
    async with Scheduler(dashboard_address=":0", **scheduler_kwargs) as s:
        async with (
            Worker(s.address, nthreads=1, **worker_kwargs) as a,
            Worker(s.address, nthreads=1, **worker_kwargs) as b,
            Client(s.address, asynchronous=True) as c,
        ):
            await work(c)
            # All futures were dropped: wait until the scheduler forgot every task
            while s.tasks:
                await asyncio.sleep(0.01)
            await a.heartbeat()
            await b.heartbeat()
            return summarize(s)


@gen_test()
async def test_real_cluster_matches_stock() -> None:
    stock = await run_on_cluster({}, {}, workload)
    ours = await run_on_cluster(OURS_SCHEDULER, OURS_WORKER, workload)
    assert ours == stock
    names = [sp["name"] for sp in ours["spans"]]
    assert names.count(("default",)) == 2
    assert names.count(("etl",)) == 2
    assert ours["spans"][0]["executed"] == ["load", "transform"]


# --- memory per span -------------------------------------------------------------


def assert_spans_add_up(df: Any, measured: dict[str, dict[str, int]]) -> None:
    """Sum over spans (own figures) equals what the workers hold."""
    for field in ("memory", "spilled", "spilled_disk"):
        assert df[field].sum() == sum(m[field] for m in measured.values()), field
    held = df["memory"].sum() + df["spilled"].sum()
    assert held == sum(m["nbytes"] for m in measured.values())


def test_local_cluster_memory_per_span_matches_workers() -> None:
    config = {
        **NO_MONITOR,
        "distributed.worker.memory.target": 0.05,
    }
    # Spill target: 20 MiB per worker. process_cluster turns the AMM off: the
    # replicas made by the reduction must stay put while we compare figures.
    with process_cluster(
        2, "400MiB", config, scheduler_kwargs=OURS_SCHEDULER, **OURS_WORKER
    ) as client:
        with span("pipeline"):
            with span("big"):
                big = [client.submit(block, 4 * MIB, i, key=("big", i)) for i in range(14)]
            with span("small"):
                small = [client.submit(block, 1000, i, key=("small", i)) for i in range(4)]
            with span("reduce"):
                red = client.submit(total, *big, key="reduce-0")
            assert red.result() == pytest.approx(sum(i * 4 * MIB / 8 for i in range(14)))
        client.gather(small)

        measured = client.run(heartbeat_and_measure)
        own = span_memory(client, own=True)
        tree = span_memory(client)

        assert sum(m["spilled_disk"] for m in measured.values()) > 0, "test setup must spill"
        assert_spans_add_up(own, measured)
        assert list(own.index) == [
            "pipeline",
            "pipeline / big",
            "pipeline / small",
            "pipeline / reduce",
        ]
        big_held = own.loc["pipeline / big", "memory"] + own.loc["pipeline / big", "spilled"]
        assert big_held >= 14 * 4 * MIB
        assert 4 * 1000 <= own.loc["pipeline / small", "memory"] < 1 * MIB
        assert own.loc["pipeline", "memory"] == 0  # no keys of its own
        # The tree figures of the parent are the sums over its children
        for field in ("memory", "spilled", "spilled_disk", "shared"):
            assert tree.loc["pipeline", field] == own[field].sum()
        # Spilling was caused while "big" tasks ran, and is reported there
        assert tree.loc["pipeline / big", "spill_bytes"] > 0
        assert tree.loc["pipeline / big", "spill_count"] > 0
        assert tree.loc["pipeline", "spill_bytes"] >= tree.loc["pipeline / big", "spill_bytes"]
        assert bool(tree["done"].all())

        # Release everything: the finished computation's spans hold nothing
        del big, small, red
        client.run(_wait_empty)
        measured = client.run(heartbeat_and_measure)
        assert all(m["n_keys"] == 0 for m in measured.values())
        after = span_memory(client)
        for field in ("memory", "spilled", "spilled_disk", "shared"):
            assert (after[field] == 0).all(), field
        # cumulative metrics stay
        assert (
            after.loc["pipeline / big", "spill_bytes"] == tree.loc["pipeline / big", "spill_bytes"]
        )


async def _wait_empty(dask_worker: Worker) -> None:
    while len(dask_worker.data):
        await asyncio.sleep(0.01)


@gen_cluster(
    client=True,
    nthreads=[("", 1), ("", 1)],
    scheduler_kwargs=OURS_SCHEDULER,
    worker_kwargs={
        **OURS_WORKER,
        "memory_limit": "400MiB",
        "data": dask_shm.worker_data("400MiB"),
    },
    config={**NO_MONITOR, "distributed.worker.memory.target": 0.01},
)
async def test_memory_per_span_with_dask_shm_spill_buffer(c: Client, s: Scheduler, *workers):
    assert all(isinstance(w.data, dask_shm.SpillBuffer) for w in workers)
    with span("arrays"):
        futs = [c.submit(block, MIB, i, key=("arr", i)) for i in range(12)]
        await c.gather(futs)
    measured = {w.address: await heartbeat_and_measure(w) for w in workers}
    df = await span_memory(c, own=True)
    assert sum(m["spilled_disk"] for m in measured.values()) > 0
    assert_spans_add_up(df, measured)
    assert df.loc["arrays", "memory"] + df.loc["arrays", "spilled"] >= 12 * MIB
    ext = s.extensions["spans"]
    (sp,) = ext.find_by_tags("arrays")
    assert isinstance(sp, Span)
    assert sp.held == SpanMemory(*(int(df.loc["arrays", f]) for f in SpanMemory._fields))
    assert sp.spill_metrics["spill_bytes"] > 0
    assert ext.merge_all().held == sp.held

    del futs
    while any(len(w.data) for w in workers):
        await asyncio.sleep(0.01)
    for w in workers:
        await w.heartbeat()
    assert sp.held == SpanMemory()


class SharedDict(dict):
    """A data mapping that reports half of each value as shared (mmap-backed)."""

    def shared_bytes(self, key: Any) -> int:
        value = self[key]
        return value.nbytes // 2 if isinstance(value, np.ndarray) else 0


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    scheduler_kwargs=OURS_SCHEDULER,
    worker_kwargs={**OURS_WORKER, "data": SharedDict},
)
async def test_shared_bytes_hook(c: Client, s: Scheduler, a: Worker):
    with span("shm"):
        futs = c.map(block, [8000, 16000], [1, 2])
        await c.gather(futs)
    with span("plain"):
        await c.submit(inc, 1)
    await a.heartbeat()
    df = await span_memory(c)
    assert df.loc["shm", "shared"] == 12000
    assert df.loc["shm", "memory"] == sum(a.state.tasks[f.key].nbytes for f in futs)
    assert df.loc["shm", "spilled"] == 0


@gen_cluster(client=True, scheduler_kwargs=OURS_SCHEDULER, worker_kwargs=OURS_WORKER)
async def test_scheduler_plugins_are_stocks(c: Client, s: Scheduler, a: Worker, b: Worker):
    """The extension adds no scheduler plugin: code that lists a scheduler's
    plugins (distributed's tests among it) sees what stock has."""
    with span("x"):
        await c.submit(block, 8000, 1, workers=[a.address])
    modules = [type(p).__module__ for p in s.plugins.values()]
    assert [m for m in modules if m.startswith("dask_shm")] == []


@gen_cluster(client=True, scheduler_kwargs=OURS_SCHEDULER, worker_kwargs=OURS_WORKER)
async def test_departed_worker_figures_are_dropped(c: Client, s: Scheduler, a: Worker, b: Worker):
    with span("x"):
        fa = c.submit(block, 8000, 1, workers=[a.address], key="on-a")
        fb = c.submit(block, 8000, 2, workers=[b.address], key="on-b")
        await c.gather([fa, fb])
    await a.heartbeat()
    await b.heartbeat()
    (sp,) = s.extensions["spans"].find_by_tags("x")
    assert sp.held.memory == a.state.nbytes + b.state.nbytes
    await s.remove_worker(b.address, stimulus_id="test")
    assert sp.held.memory == a.state.nbytes


@gen_cluster(
    client=True,
    scheduler_kwargs=OURS_SCHEDULER,
    worker_kwargs=OURS_WORKER,
    # The replica must stay where it is while we look at it
    config={"distributed.scheduler.active-memory-manager.start": False},
)
async def test_replicas_are_attributed_by_the_scheduler(
    c: Client, s: Scheduler, a: Worker, b: Worker
):
    ext_a = a.extensions["spans"]
    with span("src"):
        fb = c.submit(block, 8000, 2, workers=[b.address], key=("on-b", 0))
        await fb
    with span("use"):
        fa = c.submit(total, fb, workers=[a.address], key=("on-a", 0))
        await fa
    # a holds a replica of ("on-b", 0), which has no span on a
    assert ("on-b", 0) in a.data
    assert [k for k, _ in ext_a.memory_report(a)["by_key"]] == [("on-b", 0)]
    await a.heartbeat()
    await b.heartbeat()
    df = await span_memory(c, own=True)
    replica = a.state.tasks[("on-b", 0)].nbytes
    assert df.loc["src", "memory"] == 2 * replica
    assert df["memory"].sum() == a.state.nbytes + b.state.nbytes

    # The scheduler told a the span of the replica: a now aggregates it itself
    while not ext_a.span_hints:
        await asyncio.sleep(0.01)
    (src,) = s.extensions["spans"].find_by_tags("src")
    report = ext_a.memory_report(a)
    assert report["by_key"] == []
    assert report["by_span"][src.id][0] == replica
    await a.heartbeat()
    df = await span_memory(c, own=True)
    assert df.loc["src", "memory"] == 2 * replica

    # Once a drops the replica, the hint goes too
    del fa, fb
    while ("on-b", 0) in a.data:
        await asyncio.sleep(0.01)
    assert src.id not in ext_a.memory_report(a)["by_span"]
    assert ext_a.span_hints == {}


@gen_cluster(client=True, nthreads=[("", 1)], worker_kwargs=OURS_WORKER)
async def test_slow_memory_reports_are_reused(c: Client, s: Scheduler, a: Worker):
    ext = a.extensions["spans"]
    first = ext.memory_report(a)
    fut = c.submit(block, 8000, 1, key="new-key")
    await fut
    fresh = ext.memory_report(a)  # small worker: computed afresh
    assert fresh != first
    # Pretend every report is slow and costs the whole event loop: it is reused
    ext.SLOW_REPORT_SECONDS = -1.0
    ext.MAX_LOOP_SHARE = 1e-12
    slow = ext.memory_report(a)
    del fut
    while "new-key" in a.data:
        await asyncio.sleep(0.01)
    assert ext.memory_report(a) is slow


# --- installing into running servers ---------------------------------------------


@gen_cluster(client=True)
async def test_install_carries_over_stock_state(c: Client, s: Scheduler, a: Worker, b: Worker):
    with span("before"):
        with span("inner"):
            futs = c.map(inc, range(4))
            await c.gather(futs)
    free = c.submit(inc, 100, key="free-0")
    await free
    await a.heartbeat()
    await b.heartbeat()
    stock_ext = s.extensions["spans"]
    before = summarize(s)

    ours = install_scheduler_extension(s)
    assert install_scheduler_extension(s) is ours
    for w in (a, b):
        assert install_worker_extension(w) is install_worker_extension(w)
    assert s.extensions["spans"] is ours
    assert summarize(s) == before
    assert list(ours.spans) == list(stock_ext.spans)

    with span("after"):
        more = c.map(double, range(3), key=[f"after-{i}" for i in range(3)])
        await c.gather(more)
    await a.heartbeat()
    await b.heartbeat()
    df = await span_memory(c, own=True)
    assert list(df.index) == ["before", "before / inner", "default", "after"]
    # Every key still held is attributed, including those computed before install
    assert df["memory"].sum() == a.state.nbytes + b.state.nbytes
    assert df.loc["before / inner", "memory"] > 0
    assert df.loc["after", "memory"] > 0


@gen_cluster(client=True)
async def test_carried_over_spans_drop_departed_workers(c: Client, s: Scheduler, a, b):
    with span("before"):
        await c.submit(block, 8000, 1, workers=[b.address], key="on-b")
    ours = install_scheduler_extension(s)
    install_worker_extension(b)
    await b.heartbeat()
    (sp,) = ours.find_by_tags("before")
    assert sp.held.memory == b.state.nbytes > 0
    await s.remove_worker(b.address, stimulus_id="test")
    assert sp.held.memory == 0  # read first, before any span created after install


@gen_cluster(client=True)
async def test_span_memory_needs_our_scheduler_extension(c: Client, s: Scheduler, a, b):
    with pytest.raises(RuntimeError, match="install_scheduler_extension"):
        await span_memory(c)


def test_span_memory_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="distributed.Client"):
        span_memory("tcp://127.0.0.1:8786")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="own must be"):
        span_memory(Client.__new__(Client), own="yes")  # type: ignore[arg-type]


@gen_cluster(client=True)
async def test_plugins_install_on_running_cluster(c: Client, s: Scheduler, a: Worker, b: Worker):
    await c.register_plugin(SpansSchedulerPlugin())
    await c.register_plugin(SpansWorkerPlugin())
    assert isinstance(s.extensions["spans"], SpansSchedulerExtension)
    assert all(isinstance(w.extensions["spans"], SpansWorkerExtension) for w in (a, b))
    with span("plugged"):
        futs = c.map(block, [8000, 8000], [1, 2], key=["p-1", "p-2"])
        await c.gather(futs)
    await a.heartbeat()
    await b.heartbeat()
    df = await span_memory(c)
    assert df.loc["plugged", "memory"] == a.state.nbytes + b.state.nbytes > 0


@pytest.mark.parametrize("preload", ["dask_shm.spans", "dask_shm.spans.plugins"])
def test_preload_installs_both_extensions(preload: str) -> None:
    """Both ``--preload dask_shm.spans`` (what the README says for the spans
    alone) and the module that defines the hook install the extensions."""

    @gen_cluster(
        client=True,
        nthreads=[("", 1)],
        scheduler_kwargs={"preload": [preload]},
        worker_kwargs={"preload": [preload]},
    )
    async def run(c: Client, s: Scheduler, a: Worker) -> None:
        await check_preloaded_spans(c, s, a)

    run()


async def check_preloaded_spans(c: Client, s: Scheduler, a: Worker) -> None:
    assert isinstance(s.extensions["spans"], SpansSchedulerExtension)
    assert isinstance(a.extensions["spans"], SpansWorkerExtension)
    with span("preloaded"):
        await c.submit(block, 8000, 1, key="pre-1")
    await a.heartbeat()
    df = await span_memory(c)
    assert list(df.index) == ["preloaded"]
    assert df.loc["preloaded", "done"]


def test_preload_rejects_other_servers() -> None:
    from dask_shm.spans.plugins import dask_setup

    with pytest.raises(TypeError, match="Scheduler or a Worker"):
        dask_setup(object())  # type: ignore[arg-type]


# --- Prometheus ------------------------------------------------------------------


async def fetch_metrics(port: int) -> str:
    from tornado.httpclient import AsyncHTTPClient

    response = await AsyncHTTPClient().fetch(f"http://localhost:{port}/metrics")
    return response.body.decode()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
        out[labels] = float(m.group(2))
    return out


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    scheduler_kwargs=OURS_SCHEDULER,
    worker_kwargs={**OURS_WORKER, "memory_limit": "400MiB", "data": dask_shm.worker_data("400MiB")},
    config={**NO_MONITOR, "distributed.worker.memory.target": 0.01},
)
async def test_prometheus_metrics(c: Client, s: Scheduler, a: Worker):
    pytest.importorskip("prometheus_client")
    with span("prom"):
        futs = [c.submit(block, MIB, i, key=("p", i)) for i in range(8)]
        await c.gather(futs)
    measured = await heartbeat_and_measure(a)
    assert measured["spilled_disk"] > 0
    (sp,) = s.extensions["spans"].find_by_tags("prom")

    text = await fetch_metrics(s.http_server.port)
    mem = samples(text, "dask_shm_scheduler_span_memory_bytes")
    labels = (("span", "prom"), ("span_id", sp.id))
    for field in SpanMemory._fields:
        assert mem[tuple(sorted((*labels, ("type", field))))] == getattr(sp.own_held, field)
    assert mem[tuple(sorted((*labels, ("type", "spilled_disk"))))] == measured["spilled_disk"]
    spill = samples(text, "dask_shm_scheduler_span_spill_bytes_total")
    assert (
        spill[tuple(sorted((*labels, ("direction", "spill"))))] == sp.spill_metrics["spill_bytes"]
    )
    assert spill[tuple(sorted((*labels, ("direction", "spill"))))] > 0

    text = await fetch_metrics(a.http_server.port)
    mem = samples(text, "dask_shm_worker_span_memory_bytes")
    assert mem[(("span_id", sp.id), ("type", "memory"))] == measured["memory"]
    assert mem[(("span_id", sp.id), ("type", "spilled_disk"))] == measured["spilled_disk"]
    spill = samples(text, "dask_shm_worker_span_spill_bytes_total")
    assert spill[(("direction", "spill"), ("span_id", sp.id))] > 0
