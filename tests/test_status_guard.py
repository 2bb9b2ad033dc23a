"""A worker with dask_shm preloaded (shared-memory mode or not) that has
begun closing stays closing: a status change the scheduler sent before
(``running``, after a refused ``retire_workers``) no longer reopens it, so it
closes once.

In stock distributed such a worker goes back to ``running``, closes a second
time when its scheduler connection breaks, and the two closes together make
one of them wait 30 s for its threads (see :mod:`dask_shm.status_guard`)."""

from __future__ import annotations

import logging

import dask
import pytest
from clusters import IN_PROCESS_NO_PAUSE, NO_AMM
from distributed import Client, Scheduler, Worker, wait
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils_test import captured_logger, gen_cluster, gen_test

from dask_shm import status_guard

PRELOADED = {"distributed.worker.preload": ["dask_shm"], **IN_PROCESS_NO_PAUSE}
SHARED = {**PRELOADED, "shm.shared-memory.enabled": True}


#: (status before, status after) per teardown of the plugin below; the
#: worker gets a copy of the plugin, which runs in this process.
SEEN: list[tuple[Status, Status]] = []


class StatusChangeWhileClosing(WorkerPlugin):
    """At teardown, which runs inside ``Worker.close``: deliver the scheduler's
    ``running`` as its stream would, and note the status before and after."""

    name = "status-change-while-closing"

    def teardown(self, worker: Worker) -> None:
        before = worker.status
        worker.stream_handlers["worker-status-change"](status="running", stimulus_id="test")
        SEEN.append((before, worker.status))


@pytest.mark.parametrize("mode", ["stock", "preloaded", "shared"])
def test_a_status_change_during_close_reopens_only_stock_workers(mode):
    SEEN.clear()
    config = {"stock": {}, "preloaded": PRELOADED, "shared": SHARED}[mode]

    @gen_cluster(client=True, nthreads=[("", 1)], config=config)
    async def run(c, s, a):
        assert bool(getattr(a.data, "shared", False)) is (mode == "shared")
        await c.register_plugin(StatusChangeWhileClosing())

    run()
    if mode == "stock":  # distributed's behaviour the guard exists for
        assert SEEN == [(Status.closing, Status.running)]
    else:
        assert SEEN == [(Status.closing, Status.closing)]


@gen_cluster(client=True, nthreads=[("", 1)], config=SHARED)
async def test_a_running_worker_takes_status_changes_through_the_guard_installed_once(c, s, a):
    guard = a.stream_handlers[status_guard.HANDLER]
    assert getattr(guard, "_dask_shm_guard", False)
    assert status_guard.install(a)
    assert a.stream_handlers[status_guard.HANDLER] is guard
    guard(status="paused", stimulus_id="test-pause")
    assert a.status == Status.paused
    guard(status="running", stimulus_id="test-unpause")
    assert a.status == Status.running


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def increment(self) -> int:
        self.n += 1
        return self.n


@gen_test(timeout=120)
async def test_workers_close_once_after_a_refused_retirement():
    """distributed's test_RetireWorker_with_actor[True], then the close it
    ends with, eight times: each worker logs its close once."""
    for _ in range(8):
        with (
            captured_logger("distributed.worker", level=logging.INFO) as log,
            dask.config.set({**SHARED, **NO_AMM}),
        ):
            async with (
                Scheduler(dashboard_address=":0") as s,
                Worker(s.address, nthreads=1, memory_limit="1 GiB") as a,
                Worker(s.address, nthreads=1, memory_limit="1 GiB") as b,
                Client(s.address, asynchronous=True) as c,
            ):
                assert a.data.shared and b.data.shared
                x = c.submit(Counter, key="x", actor=True, workers=[a.address])
                await wait(x)
                y = c.submit(lambda cnt: cnt.increment().result(), x, key="y", workers=[b.address])
                assert await y == 1
                assert not await c.retire_workers([a.address])
                addresses = (a.address, b.address)
        closes = [line for line in log.getvalue().splitlines() if "Stopping worker at" in line]
        assert [sum(addr in line for line in closes) for addr in addresses] == [1, 1], closes
