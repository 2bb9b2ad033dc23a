"""Shared-memory mode switched on by config (preloads) keeps what distributed's
users and its own tests see: a client's serializers are honoured, and no plugin
appears in a server's plugin lists, while the mode is still undone on close."""

from __future__ import annotations

import inspect
import os

import dask
import numpy as np
import pytest
from clusters import IN_PROCESS_NO_PAUSE
from distributed import Nanny, Worker
from distributed.utils_test import gen_cluster, inc

from dask_shm import SharedMemoryPlugin
from dask_shm.preload import preloaded_plugins
from dask_shm.shared.plugin import PLUGIN_NAME

SHARED_BY_CONFIG = {
    "distributed.worker.preload": ["dask_shm"],
    "distributed.nanny.preload": ["dask_shm"],
    "shm.shared-memory.enabled": True,
}
SHARED_IN_PROCESS = {**SHARED_BY_CONFIG, **IN_PROCESS_NO_PAUSE}
MB = 2**20


def _ours(plugins: dict) -> list[str]:
    """Names of the dask-shm plugins in a server's plugin list."""
    return [name for name, p in plugins.items() if type(p).__module__.startswith("dask_shm")]


def _shared_mode(dask_worker: Worker) -> tuple[bool, list[str]]:
    """Whether the worker is in shared-memory mode, and dask-shm's plugins it lists."""
    return bool(getattr(dask_worker.data, "shared", False)), _ours(dask_worker.plugins)


@gen_cluster(client=True, config=SHARED_IN_PROCESS, worker_kwargs={"memory_limit": "1 GiB"})
async def test_get_data_shows_the_signature_of_the_handler_it_wraps(c, s, a, b):
    assert a.data.shared
    wrapper = a.handlers["get_data"]
    assert wrapper != a.get_data  # replaced, yet it looks the same to distributed
    assert inspect.signature(wrapper) == inspect.signature(a.get_data)
    assert "serializers" in inspect.signature(wrapper).parameters


@pytest.mark.parametrize("direct", [True, False])
@gen_cluster(
    client=True,
    config=SHARED_IN_PROCESS,
    worker_kwargs={"memory_limit": "1 GiB"},
    client_kwargs={"serializers": ["dask", "msgpack"]},
)
async def test_a_client_that_refuses_pickle_gets_no_pickle(c, s, a, b, direct):
    """distributed's test_client.py::test_turn_off_pickle with shared memory on."""
    assert a.data.shared and b.data.shared
    x = c.submit(inc, 1, workers=[a.address])
    assert await c.gather(x, direct=direct) == 2
    y = c.submit(np.full, MB // 8, 1.0, workers=[b.address])
    assert float((await c.gather(y, direct=direct)).sum()) == MB // 8
    # A value that only pickle can carry is refused, as without dask-shm.
    z = c.submit(lambda f: f, inc, workers=[a.address])
    with pytest.raises(TypeError):
        await c.gather(z, direct=direct)


@gen_cluster(
    client=True,
    # The AMM would drop a's replica of x once b has one: a's file with it.
    config={**SHARED_IN_PROCESS, "distributed.scheduler.active-memory-manager.start": False},
    worker_kwargs={"memory_limit": "1 GiB"},
)
async def test_the_preload_lists_no_plugin_and_still_tears_down_on_close(c, s, a, b):
    assert _shared_mode(a) == (True, [])
    assert await c.run(_shared_mode) == {a.address: (True, []), b.address: (True, [])}
    assert PLUGIN_NAME in preloaded_plugins(a)
    x = c.submit(np.full, 4 * MB // 8, 2.0, workers=[a.address])
    assert await c.submit(lambda v: float(v.sum()), x, workers=[b.address]) == MB
    assert a.data.shm_counters["link_transfers"] == 1  # x went to b as a file of a's
    directory = a.data.store.directory
    assert os.path.isdir(directory)
    await a.close()
    assert not os.path.exists(directory)  # torn down: its files are gone
    assert preloaded_plugins(a) == {}


@gen_cluster(
    client=True, Worker=Nanny, config=SHARED_BY_CONFIG, worker_kwargs={"memory_limit": "1 GiB"}
)
async def test_nannies_list_no_plugin(c, s, a, b):
    """distributed's test_client.py::test_upload_directory counts a nanny's plugins."""
    assert a.plugins == {} and b.plugins == {}  # as a stock nanny
    assert list((await c.run(_shared_mode)).values()) == [(True, []), (True, [])]


@gen_cluster(client=True, config=SHARED_IN_PROCESS, worker_kwargs={"memory_limit": "1 GiB"})
async def test_register_plugin_on_a_preloaded_worker_is_listed_and_changes_nothing(c, s, a, b):
    buffer = a.data
    await c.register_plugin(SharedMemoryPlugin())
    assert PLUGIN_NAME in a.plugins and PLUGIN_NAME in b.plugins
    assert a.data is buffer  # already in shared-memory mode: set up once
    x = c.submit(np.full, 4 * MB // 8, 3.0, workers=[a.address])
    assert await c.submit(lambda v: float(v.sum()), x, workers=[b.address]) == 1.5 * MB
    assert a.data.shm_counters["link_transfers"] == 1
    directory = buffer.store.directory
    await a.close()
    assert not os.path.exists(directory)


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config=IN_PROCESS_NO_PAUSE,
    worker_kwargs={"memory_limit": "1 GiB"},
)
async def test_register_plugin_without_the_preload_is_listed_and_torn_down(c, s, a):
    await c.register_plugin(SharedMemoryPlugin())
    assert PLUGIN_NAME in a.plugins and a.data.shared
    assert preloaded_plugins(a) == {}
    directory = a.data.store.directory
    await c.unregister_worker_plugin(PLUGIN_NAME)
    assert not os.path.exists(directory)


@gen_cluster(client=True, nthreads=[], config=SHARED_BY_CONFIG)
async def test_the_buffer_checks_the_worker_memory_against_its_spill_threshold(c, s):
    """After an unspill through a mapping the buffer asks whether the worker's
    memory (the figure its memory monitor reads) is above
    ``memory_limit * spill``; not with spilling off."""
    async with (
        Worker(s.address, memory_limit="8 GiB") as roomy,
        Worker(s.address, memory_limit="64 MiB") as tight,
    ):
        assert roomy.data.over_spill_threshold() is False
        assert tight.monitor.get_process_memory() > 0.7 * 64 * MB
        assert tight.data.over_spill_threshold() is True
    with dask.config.set({"distributed.worker.memory.spill": False}):
        async with Worker(s.address, memory_limit="64 MiB") as unspilling:
            assert unspilling.monitor.get_process_memory() > 0.7 * 64 * MB
            assert unspilling.data.over_spill_threshold() is False
