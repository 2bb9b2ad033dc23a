"""A value handed to a same-host peer by hard link exists once per host: the
sender's private copy leaves its memory on export (SharedSpillBuffer.export),
for numpy, pandas and pyarrow values alike, pyarrow's own allocator included.
Real worker processes; their resident anonymous memory read from /proc."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, wait

from dask_shm.procmem import process_memory
from dask_shm.shared import shm_metrics

MiB = 2**20
SIZE = 128 * MiB
COLUMNS = 8

SHARED = {
    "distributed.worker.preload": ["dask_shm"],
    "distributed.nanny.preload": ["dask_shm"],
    "shm.shared-memory.enabled": True,
}


def _column(i: int) -> np.ndarray:
    return np.random.default_rng(i).random(SIZE // 8 // COLUMNS)


def make_numpy() -> Any:
    return np.random.default_rng(0).random(SIZE // 8)


def make_pandas() -> Any:
    import pandas as pd

    return pd.DataFrame({f"c{i}": _column(i) for i in range(COLUMNS)})


def make_arrow_table() -> Any:
    import pyarrow as pa

    return pa.table({f"c{i}": _column(i) for i in range(COLUMNS)})


def make_pandas_on_arrow() -> Any:
    import pandas as pd

    return pd.DataFrame(
        {f"c{i}": pd.array(_column(i), dtype="float64[pyarrow]") for i in range(COLUMNS)}
    )


def anon() -> int:
    import pandas  # noqa: F401  (their imports are not the value's memory)
    import pyarrow  # noqa: F401

    gc.collect()
    return process_memory().anon


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    pytest.importorskip("pyarrow")
    pytest.importorskip("pandas")
    with process_cluster(2, "2GiB", SHARED, silence_logs=logging.ERROR) as client:
        yield client


@pytest.mark.parametrize(
    "make",
    [make_numpy, make_pandas, make_arrow_table, make_pandas_on_arrow],
    ids=lambda f: f.__name__,
)
def test_the_senders_copy_leaves_memory(client: Client, make: Callable[[], Any]) -> None:
    a, b = worker_addresses(client)
    before = client.run(anon, workers=[a])[a]
    x = client.submit(make, workers=[a], pure=False)
    wait(x)
    made = client.run(anon, workers=[a])[a]
    assert made - before > 0.8 * SIZE, "the value is in a's private memory"
    links = client.run(shm_metrics, workers=[a])[a]["link_bytes"]
    assert client.submit(len, x, workers=[b], pure=False).result() > 0
    assert client.run(shm_metrics, workers=[a])[a]["link_bytes"] - links >= 0.9 * SIZE
    sent = client.run(anon, workers=[a])[a]
    # stock keeps its copy (+SIZE); a pyarrow table used to leave its copy and
    # an IPC stream of up to twice its size in pyarrow's pool (+2 SIZE)
    assert sent - before < 0.2 * SIZE, f"{(sent - before) / MiB:.0f} MiB left on the sender"
    del x
