"""The dashboard's history of worker samples, on an in-process cluster.

Apart from tests/test_dashboard.py: a gen_cluster test's loop must not run
beside that module's synchronous LocalCluster (module-scoped), whose client
owns another loop.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from distributed.utils_test import gen_cluster

from dask_shm.dashboard.history import ShmHistory
from dask_shm.shared import SharedSpillBuffer, metrics
from dask_shm.shared.tiers import TierSpec
from dask_shm.worker import install_spill_buffer

MiB = 2**20


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_history_keeps_the_last_samples_of_the_workers_there(c, s, a, b):
    history = ShmHistory(s, length=3)
    for t in range(5):
        history.sample(now=float(t))
    samples = history.samples()
    assert list(samples) == sorted([a.address, b.address])
    assert [x.time for x in samples[a.address]] == [2.0, 3.0, 4.0]
    # Not in shared-memory mode: the private memory is there, the tiers are 0.
    assert samples[a.address][-1].private > 0 and samples[a.address][-1].files == ()
    assert samples[a.address][-1].figures().keys() == {"private", "tier1", "link", "tcp"}
    await b.close()
    history.sample(now=5.0)
    assert list(history.samples()) == [a.address]
    with pytest.raises(ValueError, match="length"):
        ShmHistory(s, length=0)


#: What the page showed when there were always two file tiers.
TWO_TIER_TITLES = {
    "private": "Private memory (process memory without shared pages)",
    "tier1": "Tier 1: values in private memory",
    "tier2": "Tier 2: shared-memory files (dashed: budget)",
    "tier3": "Tier 3: files on disk",
    "link": "Sent to peers by hard link (since start)",
    "tcp": "Sent to peers as bytes over TCP (since start)",
}
TWO_TIER_HEADERS = [
    "Worker",
    "Private memory",
    "Tier 1 (memory)",
    "Tier 2 (shared)",
    "Tier 2 budget",
    "Tier 3 (disk)",
    "Sent by link",
    "Sent over TCP",
]


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_the_page_shows_each_file_tier_the_workers_report(c, s, a, b):
    """With the default tiers, the plots and table of old; a third file tier
    that a worker reports later gets its own plot and columns, named and
    numbered as the worker has it."""
    pytest.importorskip("bokeh")
    from dask_shm.dashboard.page import ShmPage

    root = tempfile.mkdtemp(prefix="dask-shm-test-", dir="/dev/shm")
    scratch = tempfile.mkdtemp(prefix="dask-shm-test-")
    buffers = []
    futures = []

    async def publish(buffer: SharedSpillBuffer, values: int) -> None:
        buffers.append(buffer)
        install_spill_buffer(a, buffer)
        metrics.install(a)
        for i in range(values):  # 2 MiB each
            key = f"x{i}-{len(buffers)}"
            futures.append(c.submit(np.full, MiB // 4, i, key=key, workers=[a.address]))
        await c.gather(futures)
        await a.heartbeat()
        await b.heartbeat()
        history.sample()

    try:
        history = ShmHistory(s)
        two = SharedSpillBuffer.create(
            0,
            root=root,
            disk_root=f"{scratch}/disk",
            budget=3 * MiB,
            min_size=2**16,
            min_shared_fraction=0.5,
            name="two",
        )
        await publish(two, 2)
        page = ShmPage(history)
        assert {k: f.title.text for k, f in page.figures.items()} == TWO_TIER_TITLES
        assert [c.title for c in page.table.columns] == TWO_TIER_HEADERS
        data = page.history_source.data
        [i] = [n for n, w in enumerate(data["worker"]) if w == a.address]
        assert data["tier2_budget"][i][-1] == 3 * MiB and data["tier3"][i][-1] >= 2 * MiB

        specs = [
            TierSpec("shared", root, ram=True, registry=True),
            TierSpec("middle", f"{scratch}/middle", ram=False),
            TierSpec("disk", f"{scratch}/disk", ram=False),
        ]
        budgets = {"shared": 3 * MiB, "middle": 3 * MiB}
        three = SharedSpillBuffer.on_tiers(
            0, specs, budgets, min_size=2**16, min_shared_fraction=0.5, name="three"
        )
        await publish(three, 4)
        page.update()
        titles = {k: f.title.text for k, f in page.figures.items()}
        assert list(titles) == ["private", "tier1", "tier2", "tier3", "tier4", "link", "tcp"]
        assert titles["tier3"] == "Tier 3: middle files (dashed: budget)"
        assert titles["tier4"] == "Tier 4: files on disk"
        assert [c.title for c in page.table.columns][3:7] == [
            "Tier 2 (shared)",
            "Tier 2 budget",
            "Tier 3 (middle)",
            "Tier 3 budget",
        ]
        data = page.history_source.data
        [i] = [n for n, w in enumerate(data["worker"]) if w == a.address]
        assert data["tier3_budget"][i][-1] == 3 * MiB
        assert data["tier4"][i][-1] >= 2 * MiB  # the disk, tier 4 now
        [j] = [n for n, w in enumerate(data["worker"]) if w == b.address]
        assert data["tier4"][j][-1] == 0  # b is not in shared-memory mode
        assert page.current_source.data["tier4"][i].endswith("iB")
    finally:
        await c.cancel(futures)
        metrics.uninstall(a)
        for buffer in buffers:
            buffer.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
