"""The dashboard's history of worker samples, on an in-process cluster.

Apart from tests/test_dashboard.py: a gen_cluster test's loop must not run
beside that module's synchronous LocalCluster (module-scoped), whose client
owns another loop.
"""

from __future__ import annotations

import pytest
from distributed.utils_test import gen_cluster

from dask_shm.dashboard.history import ShmHistory


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_history_keeps_the_last_samples_of_the_workers_there(c, s, a, b):
    history = ShmHistory(s, length=3)
    for t in range(5):
        history.sample(now=float(t))
    samples = history.samples()
    assert list(samples) == sorted([a.address, b.address])
    assert [x.time for x in samples[a.address]] == [2.0, 3.0, 4.0]
    # Not in shared-memory mode: the private memory is there, the tiers are 0.
    assert samples[a.address][-1].private > 0 and samples[a.address][-1].tier2 == 0
    await b.close()
    history.sample(now=5.0)
    assert list(history.samples()) == [a.address]
    with pytest.raises(ValueError, match="length"):
        ShmHistory(s, length=0)
