"""Enabling dask-shm by preload and by config alone, as a user would."""

from __future__ import annotations

import asyncio
import logging

import dask
import pytest
from clusters import IN_PROCESS_NO_PAUSE
from distributed import Client, LocalCluster, Scheduler, Worker
from distributed.utils_test import captured_logger, gen_cluster, gen_test

import dask_shm
from dask_shm import SpillBuffer
from dask_shm.amm import ActiveMemoryManagerExtension
from dask_shm.config import enabled
from dask_shm.preload import InvalidConfig
from dask_shm.spans import SpansSchedulerExtension, SpansWorkerExtension


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config=IN_PROCESS_NO_PAUSE,
    scheduler_kwargs={"preload": ["dask_shm"]},
    worker_kwargs={"preload": ["dask_shm"], "memory_limit": "1 GiB"},
)
async def test_preload_installs_everything(c, s, a):
    assert isinstance(s.extensions["amm"], ActiveMemoryManagerExtension)
    assert isinstance(s.extensions["spans"], SpansSchedulerExtension)
    assert isinstance(a.extensions["spans"], SpansWorkerExtension)
    assert isinstance(a.data, SpillBuffer)
    assert a.data.n == int(2**30 * 0.6)
    assert await c.submit(lambda x: x + 1, 1) == 2
    # client.amm drives ours
    assert await c.amm.running() in (True, False)
    await c.amm.run_once()


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={
        "distributed.scheduler.preload": ["dask_shm"],
        "distributed.worker.preload": ["dask_shm"],
        "shm.amm": False,
    },
    worker_kwargs={"memory_limit": "1 GiB"},
)
async def test_config_alone_enables_and_switches_disable(c, s, a):
    assert not isinstance(s.extensions["amm"], ActiveMemoryManagerExtension)  # switched off
    assert isinstance(s.extensions["spans"], SpansSchedulerExtension)
    assert isinstance(a.data, SpillBuffer)


def test_preload_in_worker_processes():
    with dask.config.set({"distributed.worker.preload": ["dask_shm"]}):
        with (
            LocalCluster(
                n_workers=1, processes=True, memory_limit="512MiB", dashboard_address=":0"
            ) as cluster,
            Client(cluster) as client,
        ):
            kinds = client.run(lambda dask_worker: type(dask_worker.data).__name__)
    assert list(kinds.values()) == ["SpillBuffer"]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_switch_value_names_the_key(value):
    with dask.config.set({"shm.amm": value}), pytest.raises(ValueError, match="shm.amm must be"):
        enabled("amm")


@gen_test()
async def test_bad_switch_value_makes_the_preload_refuse_to_start_naming_the_key():
    # distributed only logs an Exception raised by a preload; the preload makes
    # the server's start fail instead, with InvalidConfig as the cause.
    with dask.config.set({"shm.spans": "maybe"}):
        with pytest.raises(RuntimeError, match="Scheduler failed to start") as info:
            await Scheduler(preload=["dask_shm"], dashboard_address=":0")
    assert isinstance(info.value.__cause__, InvalidConfig)
    assert "shm.spans must be true or false; got 'maybe'" in str(info.value.__cause__)


def test_bad_shared_memory_value_stops_worker_processes_from_starting():
    config = {
        "distributed.worker.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.min-size": "lots",
    }
    with dask.config.set(config), pytest.raises(RuntimeError, match="failed to start"):
        LocalCluster(n_workers=1, processes=True, memory_limit="512MiB", dashboard_address=":0")


def test_preload_refuses_other_servers():
    with pytest.raises(TypeError, match="Scheduler, Worker or Nanny"):
        asyncio.run(dask_shm.dask_setup(object()))
    assert callable(Worker)


PRELOAD_BY_CONFIG = {
    "distributed.scheduler.preload": ["dask_shm"],
    "distributed.worker.preload": ["dask_shm"],
}


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={**PRELOAD_BY_CONFIG, **IN_PROCESS_NO_PAUSE},
    scheduler_kwargs={"extensions": {}},
    worker_kwargs={"extensions": {}, "memory_limit": "1 GiB"},
)
async def test_preload_adds_no_extension_a_server_was_built_without(c, s, a):
    """As without the preload: no spans extension means task metrics carry no
    span id (distributed's test_worker_metrics.py::test_no_spans_extension)."""
    assert "spans" not in s.extensions and "amm" not in s.extensions
    assert "spans" not in a.extensions
    assert isinstance(a.data, SpillBuffer)  # the stock buffer is still replaced
    assert await c.submit(lambda: 1, key="x") == 1
    await a.heartbeat()
    execute = [k for k in a.digests_total if isinstance(k, tuple) and k[0] == "execute"]
    assert execute and all(k[1] is None for k in execute)


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={**PRELOAD_BY_CONFIG, **IN_PROCESS_NO_PAUSE},
    worker_kwargs={"data": dict, "memory_limit": "1 GiB"},
)
async def test_preload_keeps_a_data_mapping_of_the_users(c, s, a):
    assert type(a.data) is dict
    assert isinstance(s.extensions["spans"], SpansSchedulerExtension)
    assert isinstance(a.extensions["spans"], SpansWorkerExtension)
    assert await c.submit(lambda: 2, key="y") == 2
    assert a.data["y"] == 2


@gen_cluster(
    client=True,
    nthreads=[("", 1)],
    config={**PRELOAD_BY_CONFIG, **IN_PROCESS_NO_PAUSE, "shm.shared-memory.enabled": True},
    worker_kwargs={"data": dict, "memory_limit": "1 GiB"},
)
async def test_shared_memory_preload_keeps_a_data_mapping_of_the_users(c, s, a):
    assert type(a.data) is dict
    assert await c.submit(lambda: 3, key="z") == 3
    assert a.data["z"] == 3


NO_SPILLING = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False}


@pytest.mark.parametrize(
    "worker_kwargs, config, why",
    [
        (
            {"memory_limit": 0},
            {},
            "the worker has no memory limit, so distributed gave it a plain dict, which "
            "dask-shm keeps as stock does; give it a memory limit and leave spilling on",
        ),
        (
            {"memory_limit": "1 GiB"},
            NO_SPILLING,
            "distributed.worker.memory.target and .spill are both False, so distributed "
            "gave it a plain dict",
        ),
        (
            {"memory_limit": "1 GiB", "data": dict},
            {},
            "its data mapping is the user's (builtins.dict), which dask-shm keeps; "
            "register dask_shm.SharedMemoryPlugin() to replace it",
        ),
    ],
)
def test_shared_memory_left_off_by_a_kept_data_mapping_says_why_in_the_worker_log(
    worker_kwargs, config, why
):
    """Stock gives a worker without a memory limit, or with spilling off, a
    plain dict, and the preload keeps it (distributed's own tests check its
    type): shared-memory mode is then off, and the worker's log says so."""

    async def start() -> None:
        async with Scheduler(dashboard_address=":0") as s:
            async with Worker(s.address, preload=["dask_shm"], **worker_kwargs) as w:
                assert type(w.data) is dict
                address = w.address
        [line] = [x for x in logs.getvalue().splitlines() if "shared-memory mode off" in x]
        assert line.startswith(f"dask-shm: shared-memory mode off on {address}: {why}")

    with (
        dask.config.set({"shm.shared-memory.enabled": True, **config}),
        captured_logger("dask_shm", level=logging.WARNING) as logs,
    ):
        asyncio.run(start())


def test_unknown_keys_are_warned_about_once_at_worker_start_naming_the_closest_key() -> None:
    """By the dask_shm logger, once per key in a process that starts two
    workers; the keys are otherwise ignored."""
    config = {"shm.shared-memory.enable": True, "shm.local.warmpool": False, "shm.zzz": 1}
    with dask.config.set(config), captured_logger("dask_shm", level=logging.WARNING) as logs:
        asyncio.run(_start_and_close_a_worker())
        asyncio.run(_start_and_close_a_worker())
    lines = [line for line in logs.getvalue().splitlines() if "unknown config key" in line]
    assert sorted(lines) == [
        "dask-shm: unknown config key shm.local.warmpool is ignored; "
        "did you mean shm.local.warm-pool?",
        "dask-shm: unknown config key shm.shared-memory.enable is ignored; "
        "did you mean shm.shared-memory.enabled?",
        "dask-shm: unknown config key shm.zzz is ignored",
    ]


async def _start_and_close_a_worker() -> None:
    async with Scheduler(dashboard_address=":0") as s:
        async with Worker(s.address, preload=["dask_shm"], memory_limit="1 GiB") as w:
            # the typo did not turn shared-memory mode on
            assert type(w.data) is SpillBuffer
