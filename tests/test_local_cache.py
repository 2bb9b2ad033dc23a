"""Out-of-core local computations: SpillCache as dask's ``cache=`` for the
threaded scheduler and for dask_shm.get, with a target far below the data."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import psutil
import pytest
from dask.callbacks import Callback

from dask_shm.local import SpillCache, get, parse_memory_target

pytestmark = pytest.mark.timeout(120)

MiB = 2**20


def workload() -> tuple[da.Array, float]:
    """~64 MiB of chunks that all stay alive until the column means are known
    (every chunk is used twice: once for the means, once after them)."""
    x = da.random.RandomState(7).random((4096, 2048), chunks=(256, 2048))  # 16 x 4 MiB
    centered = x - x.mean(axis=0)
    return (centered**2).sum(), x.nbytes


class MaxSpilled(Callback):
    """Records the largest number of keys the cache had on disk."""

    def __init__(self) -> None:
        super().__init__()
        self.max_spilled = 0

    def _posttask(self, key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
        cache = state["cache"]
        if isinstance(cache, SpillCache):
            self.max_spilled = max(self.max_spilled, len(cache.disk))


@pytest.fixture
def spill_base(tmp_path: Path) -> Iterator[Path]:
    with dask.config.set({"shm.local.spill-directory": str(tmp_path)}):
        yield tmp_path
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def expected() -> float:
    total, _ = workload()
    return float(total.compute(scheduler="sync"))


def test_threaded_scheduler_spills_and_gets_the_right_answer(
    spill_base: Path, expected: float
) -> None:
    total, nbytes = workload()
    with SpillCache(target=2 * MiB) as cache, MaxSpilled() as cb:
        assert cache.n == 2 * MiB
        result = total.compute(scheduler="threads", cache=cache)
        assert cb.max_spilled >= 8  # most of the 16 chunks went to disk at some point
    assert nbytes >= 30 * cache.n
    assert result == pytest.approx(expected, rel=1e-12)


def test_threaded_scheduler_through_dask_config(spill_base: Path, expected: float) -> None:
    total, _ = workload()
    with SpillCache(target="2 MiB") as cache, MaxSpilled() as cb:
        with dask.config.set(scheduler="threads", cache=cache):
            result = total.compute()
        assert cb.max_spilled >= 8
    assert result == pytest.approx(expected, rel=1e-12)


def test_shm_scheduler_with_explicit_cache(spill_base: Path, expected: float) -> None:
    total, _ = workload()
    with SpillCache(target=2 * MiB) as cache, MaxSpilled() as cb:
        result = total.compute(scheduler=get, num_workers=2, cache=cache)
        assert cb.max_spilled >= 8
    assert result == pytest.approx(expected, rel=1e-12)


def test_shm_scheduler_with_memory_target_from_config(spill_base: Path, expected: float) -> None:
    total, _ = workload()
    with dask.config.set({"shm.local.memory-target": "2 MiB"}), MaxSpilled() as cb:
        result = total.compute(scheduler=get, num_workers=2)
    assert cb.max_spilled >= 8
    assert result == pytest.approx(expected, rel=1e-12)
    # spill_base checks that the per-computation cache deleted its directory


def test_memory_target_accepts_bytes_fractions_and_percentages() -> None:
    ram = psutil.virtual_memory().total
    assert parse_memory_target(123_456) == 123_456
    assert parse_memory_target("4 GiB") == 4 * 2**30
    assert parse_memory_target(0.25) == int(ram * 0.25)
    assert parse_memory_target("50%") == int(ram * 0.5)
    assert parse_memory_target(1.0) == ram


@pytest.mark.parametrize("bad", [0, -5, 1.5, 0.0, "150%", "0%", "lots", "%", True, None, [1]])
def test_bad_memory_targets_name_the_key_and_accepted_values(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_memory_target(bad, "my.key")
    message = str(info.value)
    assert message.startswith("my.key must be")
    assert "'4 GiB'" in message and "0.5" in message and "'50%'" in message
    assert repr(bad) in message
    with pytest.raises(ValueError, match="^target must be"):
        SpillCache(bad)  # type: ignore[arg-type]


def test_close_deletes_spilled_values_and_directory(tmp_path: Path) -> None:
    cache = SpillCache(target=1000, directory=str(tmp_path))
    cache["a"] = np.zeros(10_000)
    cache["b"] = np.ones(10)
    assert len(cache.disk) == 1 and len(cache.memory) == 1
    directory = cache.spill_directory
    assert Path(directory).parent == tmp_path and os.listdir(directory) != []
    cache.close()
    assert len(cache) == 0 and not os.path.exists(directory)
    cache.close()  # idempotent
