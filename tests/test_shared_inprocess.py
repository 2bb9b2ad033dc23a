"""Shared-memory mode between workers of one process (gen_cluster): who gets
handles and who gets bytes."""

from __future__ import annotations

import numpy as np
from distributed.utils_test import gen_cluster

from dask_shm import SharedMemoryPlugin, SpillBuffer

MB = 2**20


def make_array(nbytes: int, fill: float = 1.0) -> np.ndarray:
    return np.full(nbytes // 8, fill)


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], worker_kwargs={"memory_limit": "1 GiB"})
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


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], worker_kwargs={"memory_limit": "1 GiB"})
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
