"""Our Active Memory Manager on real (in-process) clusters."""

from __future__ import annotations

import asyncio
import logging

import dask
import pytest
from distributed import Event, wait
from distributed.active_memory_manager import ReduceReplicas as StockReduceReplicas
from distributed.core import Status
from distributed.utils_test import captured_logger, gen_cluster, inc

import dask_shm.amm as ours
from dask_shm.amm import (
    ActiveMemoryManagerExtension,
    KeepReplicas,
    ReduceReplicas,
    install_scheduler_extension,
)

MANUAL = {
    "distributed.scheduler.active-memory-manager.start": False,
    "distributed.scheduler.active-memory-manager.policies": [
        {"class": "dask_shm.amm.ReduceReplicas"}
    ],
    # Tests pause workers by hand; the memory monitor would resume them on its next
    # tick (their memory is far below the pause threshold), racing the assertions.
    "distributed.worker.memory.pause": False,
}
THREE = [("", 1)] * 3


async def until(predicate, timeout: float = 10) -> None:
    """Poll ``predicate`` until true (the cluster converges asynchronously)."""

    async def loop() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(loop(), timeout)


async def pause(s, w) -> None:
    w.status = Status.paused
    await until(lambda: s.workers[w.address].status == Status.paused)


@gen_cluster(client=True, config=MANUAL)
async def test_install_replaces_stock_and_client_proxy_works(c, s, a, b):
    stock_amm = s.extensions["amm"]
    assert type(stock_amm) is not ActiveMemoryManagerExtension
    amm = install_scheduler_extension(s)
    assert s.extensions["amm"] is amm
    assert isinstance(amm, ActiveMemoryManagerExtension)
    assert install_scheduler_extension(s) is amm  # idempotent
    assert {type(p) for p in amm.policies} == {ReduceReplicas}
    assert not await c.amm.running()
    await c.amm.start()
    assert await c.amm.running()
    assert not stock_amm.running
    await c.amm.stop()
    assert not await c.amm.running()
    await c.amm.run_once()


@gen_cluster(client=True, config={"distributed.scheduler.active-memory-manager.interval": "50ms"})
async def test_install_keeps_running_state_and_policies(c, s, a, b):
    stock_amm = s.extensions["amm"]
    assert stock_amm.running
    amm = install_scheduler_extension(s)
    assert amm.running and not stock_amm.running
    assert amm.interval == stock_amm.interval == 0.05
    assert {type(p) for p in amm.policies} == {StockReduceReplicas}
    assert all(p.manager is amm for p in amm.policies)


@gen_cluster(client=True, nthreads=THREE, config=MANUAL)
async def test_excess_replicas_dropped(c, s, *workers):
    install_scheduler_extension(s)
    futs = await c.scatter({"x": 1, "y": 2}, broadcast=True)
    assert all(len(s.tasks[k].who_has) == 3 for k in futs)
    await c.amm.run_once()
    await until(lambda: all(len(s.tasks[k].who_has) == 1 for k in futs))
    assert await c.gather(list(futs.values())) == [1, 2]


@gen_cluster(client=True, nthreads=THREE, config=MANUAL)
async def test_drop_from_paused_worker_first(c, s, a, b, w3):
    install_scheduler_extension(s)
    fut = (await c.scatter({"x": 1}, broadcast=True))["x"]
    await pause(s, b)
    await c.amm.run_once()
    await until(lambda: len(s.tasks["x"].who_has) == 1)
    assert s.workers[b.address] not in s.tasks["x"].who_has
    assert await fut == 1


@gen_cluster(client=True, nthreads=THREE, config=MANUAL)
async def test_retire_worker_moves_unique_keys_and_closes(c, s, a, b, w3):
    install_scheduler_extension(s)
    futs = c.map(inc, range(20), workers=[a.address])
    await wait(futs)
    assert all(s.tasks[f.key].who_has == {s.workers[a.address]} for f in futs)
    out = await c.retire_workers([a.address])
    assert list(out) == [a.address]
    assert a.address not in s.workers
    assert await c.gather(futs) == list(range(1, 21))
    await until(lambda: a.status in (Status.closed, Status.closing, Status.closing_gracefully))


@gen_cluster(
    client=True,
    nthreads=THREE,
    config={**MANUAL, "distributed.scheduler.active-memory-manager.start": True},
)
async def test_retire_worker_with_running_manager_uses_it(c, s, a, b, w3):
    amm = install_scheduler_extension(s)
    added = []
    orig = amm.add_policy
    amm.add_policy = lambda p: (added.append(p), orig(p))[1]  # type: ignore[method-assign]
    futs = c.map(inc, range(10), workers=[a.address])
    await wait(futs)
    out = await c.retire_workers([a.address])
    assert list(out) == [a.address]
    assert [p.address for p in added] == [a.address]
    assert await c.gather(futs) == list(range(1, 11))


@gen_cluster(client=True, config=MANUAL)
async def test_retire_ad_hoc_manager_is_ours(c, s, a, b):
    install_scheduler_extension(s)
    created = []
    orig_init = ActiveMemoryManagerExtension.__init__

    def spy(self, *args, **kwargs):
        created.append(self)
        orig_init(self, *args, **kwargs)

    ActiveMemoryManagerExtension.__init__ = spy  # type: ignore[method-assign]
    try:
        fut = c.submit(inc, 1, workers=[a.address])
        await fut
        assert list(await c.retire_workers([a.address])) == [a.address]
    finally:
        ActiveMemoryManagerExtension.__init__ = orig_init  # type: ignore[method-assign]
    assert len(created) == 1  # the temporary manager retire_workers built
    assert await fut == 2


@gen_cluster(client=True, config=MANUAL)
async def test_no_recipients_aborts_retirement(c, s, a, b):
    install_scheduler_extension(s)
    fut = c.submit(inc, 1, workers=[a.address])
    await fut
    await pause(s, b)
    with captured_logger("distributed.scheduler", level=logging.WARNING) as log:
        out = await c.retire_workers([a.address])
    assert out == {}
    assert "Could not retire worker" in log.getvalue()
    assert a.address in s.workers
    await until(lambda: s.workers[a.address].status == Status.running)
    assert await fut == 2


@gen_cluster(client=True, nthreads=THREE, config=MANUAL)
async def test_retirement_skips_paused_recipients(c, s, a, b, w3):
    install_scheduler_extension(s)
    await pause(s, b)
    futs = c.map(inc, range(10), workers=[a.address])
    await wait(futs)
    assert list(await c.retire_workers([a.address])) == [a.address]
    assert all(s.tasks[f.key].who_has == {s.workers[w3.address]} for f in futs)


@gen_cluster(client=True, nthreads=THREE, config=MANUAL)
async def test_keep_replicas_broadcast_survives_reduce_replicas(c, s, a, b, w3):
    amm = install_scheduler_extension(s)
    x = c.submit(inc, 1, key="x", workers=[a.address])
    y = c.submit(inc, 2, key="y", workers=[a.address])
    await wait([x, y])
    amm.add_policy(KeepReplicas(["x"]))
    await c.amm.run_once()
    await until(lambda: len(s.tasks["x"].who_has) == 3)
    for _ in range(3):
        await c.amm.run_once()
    assert len(s.tasks["x"].who_has) == 3
    assert len(s.tasks["y"].who_has) == 1


@gen_cluster(client=True, nthreads=THREE, config=MANUAL)
async def test_keep_n_replicas_from_config(c, s, a, b, w3):
    with dask.config.set(
        {
            "distributed.scheduler.active-memory-manager.policies": [
                {"class": "dask_shm.amm.ReduceReplicas"},
                {"class": "dask_shm.amm.KeepReplicas", "keys": ["x"], "n": 2},
            ]
        }
    ):
        amm = ActiveMemoryManagerExtension(s, register=False, start=False)
    futs = await c.scatter({"x": 1}, broadcast=True)
    amm.run_once()
    await until(lambda: len(s.tasks["x"].who_has) == 2)
    for _ in range(3):
        amm.run_once()
    assert len(s.tasks["x"].who_has) == 2
    assert await futs["x"] == 1


@gen_cluster(client=True, scheduler_kwargs={"preload": ["dask_shm.amm.preload"]}, config=MANUAL)
async def test_preload_installs_ours(c, s, a, b):
    assert isinstance(s.extensions["amm"], ActiveMemoryManagerExtension)
    assert s.handlers["amm_handler"] == s.extensions["amm"].amm_handler
    assert not await c.amm.running()


@gen_cluster(client=True, nthreads=THREE, config=MANUAL)
async def test_dependents_running_keep_their_replica(c, s, a, b, w3):
    """A replica on a worker where a dependent is processing is not dropped."""
    install_scheduler_extension(s)
    ev = Event()
    x = (await c.scatter({"x": 1}, workers=[a.address, b.address], broadcast=True))["x"]

    def block(v, ev):
        ev.wait()
        return v

    y = c.submit(block, x, ev, key="y", workers=[a.address])
    await until(lambda: "y" in s.tasks and s.tasks["y"].processing_on is not None)
    assert s.tasks["y"].processing_on is s.workers[a.address]
    assert len(s.tasks["x"].who_has) == 2
    await c.amm.run_once()
    await until(lambda: len(s.tasks["x"].who_has) == 1)
    assert s.tasks["x"].who_has == {s.workers[a.address]}
    await ev.set()
    assert await y == 1


def test_keep_replicas_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n must be None or an int >= 1"):
        KeepReplicas(["x"], n=0)
    with pytest.raises(ValueError, match="n must be None or an int >= 1"):
        KeepReplicas(["x"], n=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="iterable of keys"):
        KeepReplicas("x")


def test_public_names() -> None:
    assert set(ours.__all__) >= {
        "ActiveMemoryManagerExtension",
        "KeepReplicas",
        "ReduceReplicas",
        "RetireWorker",
        "install_scheduler_extension",
    }


@gen_cluster(
    client=True,
    config={**MANUAL, "distributed.scheduler.preload": ["dask_shm.amm.preload"]},
)
async def test_preload_from_config(c, s, a, b):
    assert isinstance(s.extensions["amm"], ActiveMemoryManagerExtension)
    futs = await c.scatter({"x": 1}, broadcast=True)
    await c.amm.run_once()
    await until(lambda: len(s.tasks["x"].who_has) == 1)
    assert await futs["x"] == 1
