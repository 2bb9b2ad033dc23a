"""dask-shm's Prometheus series, scraped from real /metrics pages and read with
prometheus_client's own text parser: types, names (units, ``_total``, the
configured namespace) and bounded per-span series."""

from __future__ import annotations

import asyncio
import logging

import dask
import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, Scheduler, Worker, span
from distributed.scheduler import DEFAULT_EXTENSIONS as SCHEDULER_EXTENSIONS
from distributed.utils_test import gen_cluster
from distributed.worker import DEFAULT_EXTENSIONS as WORKER_EXTENSIONS

import dask_shm
from dask_shm.shared import SharedMemoryPlugin, shm_metrics
from dask_shm.spans import SpansSchedulerExtension, SpansWorkerExtension
from dask_shm.spans.prometheus import FOLDED, IdleSpans

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

MIB = 2**20
OURS_SCHEDULER = {"extensions": {**SCHEDULER_EXTENSIONS, "spans": SpansSchedulerExtension}}
OURS_WORKER = {"extensions": {**WORKER_EXTENSIONS, "spans": SpansWorkerExtension}}
NO_MONITOR = {
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
    "distributed.worker.memory.spill": False,
}


def families(text: str) -> dict[str, object]:
    """Metric families of an exposition, by family name."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}  # type: ignore[attr-defined]


def spilled_by_span(found: dict[str, object]) -> dict[str, float]:
    """span_id -> bytes spilled, from the scheduler's span spill series."""
    return {
        dict(labels)["span_id"]: v
        for (_, labels), v in samples(found["dask_shm_scheduler_span_spill_bytes"]).items()
        if dict(labels)["direction"] == "spill"
    }


async def fetch(port: int) -> str:
    from tornado.httpclient import AsyncHTTPClient

    response = await AsyncHTTPClient().fetch(f"http://localhost:{port}/metrics")
    return response.body.decode()


def make_array(nbytes: int) -> np.ndarray:
    return np.ones(nbytes // 8)


def block(nbytes: int, seed: int) -> np.ndarray:
    return np.full(nbytes // 8, seed, dtype="f8")


# The gen_cluster tests come before the module-scoped LocalCluster below: its
# synchronous default Client, alive until the module ends, would otherwise be
# picked up inside their event loop.

# --- per-span series: bounded --------------------------------------------------------


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    scheduler_kwargs=OURS_SCHEDULER,
    worker_kwargs={**OURS_WORKER, "memory_limit": "400MiB", "data": dask_shm.worker_data("400MiB")},
    config={**NO_MONITOR, "distributed.worker.memory.target": 0.01},
)
async def test_finished_spans_are_folded_into_one_series(c: Client, s: Scheduler, a: Worker):
    spans_ids = []
    for name in ("first", "second"):
        with span(name) as span_id:
            futs = [c.submit(block, MIB, i, key=(name, i)) for i in range(8)]
            await c.gather(futs)
        spans_ids.append(span_id)
        del futs
    await a.heartbeat()

    # Within the retention: each span has series of its own.
    per_span = spilled_by_span(families(await fetch(s.http_server.port)))
    assert set(spans_ids) <= set(per_span) and FOLDED not in per_span
    assert all(per_span[i] > 0 for i in spans_ids)

    # Retention 0: the finished spans (nothing held any more) are folded; the
    # folded series is their sum, so the counter total is unchanged.
    while a.data:
        await asyncio.sleep(0.05)
    await a.heartbeat()
    with dask.config.set({"shm.prometheus.span-retention": 0}):
        found = families(await fetch(s.http_server.port))
    after = spilled_by_span(found)
    assert not set(spans_ids) & set(after)
    assert after[FOLDED] == pytest.approx(sum(per_span[i] for i in spans_ids))
    assert found["dask_shm_scheduler_span_spill_bytes"].type == "counter"  # type: ignore[attr-defined]
    assert found["dask_shm_scheduler_span_memory_bytes"].type == "gauge"  # type: ignore[attr-defined]

    # The worker folds the same spans once their counters stop changing.
    with dask.config.set({"shm.prometheus.span-retention": 0}):
        await fetch(a.http_server.port)  # first sight: counters recorded
        found = families(await fetch(a.http_server.port))
    worker_spill = {
        dict(labels)["span_id"]
        for (name, labels), v in samples(found["dask_shm_worker_span_spill_bytes"]).items()
    }
    assert FOLDED in worker_spill and not set(spans_ids) & worker_spill


def test_idle_spans_fold_after_the_retention_and_stay_folded():
    idle = IdleSpans()
    fig = {"spill_bytes": 1.0}
    live, folded = idle.split({"s1": fig, "s2": fig}, holding=["s2"], now=0.0, retention=10)
    assert set(live) == {"s1", "s2"} and folded == {}
    live, folded = idle.split({"s1": fig, "s2": fig}, holding=["s2"], now=5.0, retention=10)
    assert set(live) == {"s1", "s2"}
    # s1 unchanged for 10 s and holding nothing: folded; s2 still holds keys.
    live, folded = idle.split({"s1": fig, "s2": fig}, holding=["s2"], now=10.0, retention=10)
    assert set(live) == {"s2"} and folded == {"spill_bytes": 1.0}
    # A folded span never comes back, even if its counters move again.
    live, folded = idle.split(
        {"s1": {"spill_bytes": 3.0}, "s2": fig}, holding=[], now=11.0, retention=10
    )
    assert set(live) == {"s2"} and folded == {"spill_bytes": 3.0}
    # A span whose counters change stays live.
    live, _ = idle.split({"s2": {"spill_bytes": 2.0}}, holding=[], now=30.0, retention=10)
    assert set(live) == {"s2"}


# --- shared-memory series -----------------------------------------------------------

COUNTERS = {
    "link_transfers": "dask_shm_worker_link_transfers",
    "link_bytes": "dask_shm_worker_link_bytes",
    "fallback_transfers": "dask_shm_worker_fallback_transfers",
    "fallback_bytes": "dask_shm_worker_fallback_bytes",
    "received_links": "dask_shm_worker_received_links",
    "received_bytes": "dask_shm_worker_received_bytes",
    "adopt_failures": "dask_shm_worker_adopt_failures",
    "receive_fallback_transfers": "dask_shm_worker_receive_fallback_transfers",
    "degraded_reads": "dask_shm_worker_degraded_reads",
}
GAUGES = {
    "shared_bytes": "dask_shm_worker_shared_bytes",
    "retained_keys": "dask_shm_worker_retained_keys",
}


async def scrape(dask_worker: Worker) -> str:
    """This worker's own /metrics page, fetched over HTTP from its process."""
    return await fetch(dask_worker.http_server.port)


@pytest.fixture(scope="module")
def shm_client():
    with process_cluster(2, "2GiB", silence_logs=logging.ERROR) as client:
        client.register_plugin(SharedMemoryPlugin())
        yield client


def test_shared_memory_series_are_counters_and_gauges_named_like_distributeds(shm_client):
    client = shm_client
    a, b = worker_addresses(client)
    x = client.submit(make_array, 8 * MIB, workers=[a], key="prom-x")
    assert client.submit(lambda v: float(v.sum()), x, workers=[b]).result() == MIB
    figures = client.run(shm_metrics, workers=[a])[a]
    assert figures["link_transfers"] >= 1  # so the counters below are not all zero
    text = client.run(scrape, workers=[a])[a]
    found = families(text)
    for figure, name in COUNTERS.items():
        family = found[name]
        assert family.type == "counter", name  # type: ignore[attr-defined]
        assert samples(family) == {(name + "_total", (("worker", a),)): figures[figure]}
    for figure, name in GAUGES.items():
        family = found[name]
        assert family.type == "gauge", name  # type: ignore[attr-defined]
        assert samples(family) == {(name, (("worker", a),)): figures[figure]}
    # Units as distributed spells them: bytes series end in _bytes (_bytes_total).
    assert {"dask_shm_worker_link_bytes_total"} <= {
        s.name
        for f in found.values()
        for s in f.samples  # type: ignore[attr-defined]
    }


def test_shared_memory_series_follow_the_configured_namespace(shm_client):
    client = shm_client
    a, _ = worker_addresses(client)

    async def scrape_with_namespace(dask_worker: Worker) -> str:
        with dask.config.set({"distributed.dashboard.prometheus.namespace": "acme"}):
            return await scrape(dask_worker)

    found = families(client.run(scrape_with_namespace, workers=[a])[a])
    assert "acme_shm_worker_link_bytes" in found
    assert found["acme_shm_worker_link_bytes"].type == "counter"  # type: ignore[attr-defined]
    assert not any(name.startswith("dask_shm_worker_") for name in found)


def _worker_families(config: dict) -> set[str]:
    """Family names on a worker's /metrics page, in a fresh process cluster."""
    with process_cluster(1, "1GiB", config, silence_logs=logging.ERROR) as client:
        (a,) = worker_addresses(client)
        assert client.submit(make_array, MIB, workers=[a]).result().size == MIB // 8
        return set(families(client.run(scrape, workers=[a])[a]))


def test_distributeds_own_worker_series_stay_exactly_stocks():
    """With dask-shm switched on as users do (preloads, shared memory on),
    every family of ours is under ``dask_shm_`` and the rest of the page is
    stock's, family for family: distributed's own test_prometheus checks its
    ``dask_worker_*`` families for equality."""
    stock = _worker_families({})
    ours = _worker_families(
        {
            "distributed.worker.preload": ["dask_shm"],
            "distributed.nanny.preload": ["dask_shm"],
            "shm.shared-memory.enabled": True,
        }
    )
    assert {f for f in ours if not f.startswith("dask_shm_")} == stock
    assert {"dask_shm_worker_link_bytes", "dask_shm_worker_span_memory_bytes"} <= ours
