"""Shared-memory mode between workers of one process (gen_cluster): who gets
handles and who gets bytes."""

from __future__ import annotations

import numpy as np
from distributed.utils_test import gen_cluster

from dask_shm import SharedMemoryPlugin, SpillBuffer

MB = 2**20


def make_array(nbytes: int, fill: float = 1.0) -> np.ndarray:
    return np.full(nbytes // 8, fill)


#: In-process workers count the whole pytest process as their memory (several
#: hundred MiB late in a run): a limit far above it, so that nothing spills
#: behind a test's back and the tier-2 budget is not used up before it starts.
LIMIT = "8 GiB"


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], worker_kwargs={"memory_limit": LIMIT})
async def test_a_worker_without_the_plugin_gets_bytes(c, s, a, b):
    await SharedMemoryPlugin().setup(a)  # only a is in shared-memory mode
    assert isinstance(a.data, SpillBuffer) and a.data.shared
    assert not getattr(b.data, "shared", False)
    x = c.submit(make_array, 4 * MB, workers=[a.address], key="to-stock")
    y = c.submit(lambda v: float(v.sum()), x, workers=[b.address])
    assert await y == MB / 2
    assert a.data.shm_counters["link_transfers"] == 0
    # and the other way round
    z = c.submit(make_array, 4 * MB, workers=[b.address], key="from-stock")
    assert await c.submit(lambda v: float(v.sum()), z, workers=[a.address]) == MB / 2
    SharedMemoryPlugin().teardown(a)


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], worker_kwargs={"memory_limit": LIMIT})
async def test_values_that_are_pickled_objects_travel_as_bytes(c, s, a, b):
    plugins = [SharedMemoryPlugin(), SharedMemoryPlugin()]
    await plugins[0].setup(a)
    await plugins[1].setup(b)
    x = c.submit(lambda: ["a string"] * 200_000, workers=[a.address], key="strings")
    assert await c.submit(len, x, workers=[b.address]) == 200_000
    assert a.data.shm_counters["link_transfers"] == 0
    assert a.data.shm_counters["fallback_transfers"] == 1
    y = c.submit(make_array, 4 * MB, workers=[a.address], key="array")
    assert await c.submit(lambda v: v.size, y, workers=[b.address]) == MB // 2
    assert a.data.shm_counters["link_transfers"] == 1
    plugins[0].teardown(a)
    plugins[1].teardown(b)


#: The activities stock reports for the fetches below (each message is under
#: ``distributed.comm.offload``, so no ``offload``).
STOCK_GET_DATA = {"memory-read", "serialize", "compress", "network"}


def _get_data_activities(worker) -> set[str]:
    return {k[1] for k in worker.digests_total if k[0] == "get-data"}


#: Two workers of one thread, and no replica dropped behind the test's back.
two_workers_no_amm = gen_cluster(
    client=True,
    nthreads=[("", 1), ("", 1)],
    worker_kwargs={"memory_limit": LIMIT},
    config={"distributed.scheduler.active-memory-manager.start": False},
)


@two_workers_no_amm
async def test_a_value_not_worth_sharing_is_sent_as_in_stock(c, s, a, b):
    """A value a same-host peer fetches but that is not worth sharing (small,
    or pickled Python objects) stays in the sender's memory, unwritten, and
    the fetch reports stock's fine metrics: no spill, no activity of ours."""
    plugins = [SharedMemoryPlugin(), SharedMemoryPlugin()]
    await plugins[0].setup(a)
    await plugins[1].setup(b)
    made = {
        "small": c.submit(lambda: 2, workers=[a.address], key="small"),
        "strings": c.submit(
            lambda: [str(i) for i in range(50_000)], workers=[a.address], key="strings"
        ),
    }
    used = [c.submit(lambda v: v == 2 or len(v), x, workers=[b.address]) for x in made.values()]
    assert await c.gather(used) == [True, 50_000]
    for key in made:
        assert key in a.data.fast, key
        assert a.data.store.file_of(key) is None, key
    assert a.data.shm_counters["fallback_transfers"] == 2
    assert a.data.shm_counters["link_transfers"] == 0
    assert _get_data_activities(a) == STOCK_GET_DATA, a.digests_total
    # An array is still handed over by link, out of the sender's memory.
    y = c.submit(make_array, 4 * MB, workers=[a.address], key="array")
    assert await c.submit(lambda v: v.size, y, workers=[b.address]) == MB // 2
    assert a.data.shm_counters["link_transfers"] == 1
    assert "array" not in a.data.fast
    assert "shm-send-link" in _get_data_activities(a)
    plugins[0].teardown(a)
    plugins[1].teardown(b)


@two_workers_no_amm
async def test_stock_get_data_activities(c, s, a, b):
    """What the test above holds shared mode to: stock's own activities for
    the same fetches."""
    x = c.submit(lambda: [str(i) for i in range(50_000)], workers=[a.address], key="strings")
    assert await c.submit(len, x, workers=[b.address]) == 50_000
    assert _get_data_activities(a) == STOCK_GET_DATA


@two_workers_no_amm
async def test_replicate_hands_each_file_to_the_worker_that_fetched_it(c, s, a, b):
    # The scheduler's replicate fetches through a worker's gather handler;
    # the handles it received once went to the process's last shared-mode
    # worker: the fetching worker held a private copy and the other an
    # orphan file, one value counted twice.
    plugins = [SharedMemoryPlugin(), SharedMemoryPlugin()]
    await plugins[0].setup(a)
    await plugins[1].setup(b)
    for holder, fetcher in ((a, b), (b, a)):
        key = f"from-{holder.name}"
        x = c.submit(make_array, 4 * MB, 2.0, workers=[holder.address], key=key)
        await x
        await c.replicate([x], n=2)
        assert float(fetcher.data[key].sum()) == MB
        assert key in fetcher.data.store.retained, "not backed by the received file"
        assert a.data.pending_arrivals() == b.data.pending_arrivals() == 0
    assert a.data.shm_counters["received_links"] == b.data.shm_counters["received_links"] == 1
    plugins[0].teardown(a)
    plugins[1].teardown(b)


@two_workers_no_amm
async def test_a_value_that_cannot_be_exported_goes_as_bytes(c, s, a, b):
    # Whatever export raises (here a bug of ours, simulated), the peer's
    # fetch gets the value the stock way instead of failing.
    plugins = [SharedMemoryPlugin(), SharedMemoryPlugin()]
    await plugins[0].setup(a)
    await plugins[1].setup(b)

    def broken_export(key, tiers=None):
        raise RuntimeError("export is broken")

    a.data.hand_over = broken_export  # what the sender calls
    x = c.submit(make_array, 4 * MB, 3.0, workers=[a.address], key="x")
    assert await c.submit(lambda v: float(v.sum()), x, workers=[b.address]) == 1.5 * MB
    assert a.data.shm_counters["fallback_transfers"] == 1
    assert a.data.shm_counters["link_transfers"] == 0
    del a.data.hand_over
    plugins[0].teardown(a)
    plugins[1].teardown(b)
