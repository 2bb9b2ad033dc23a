"""Latency of one same-host transfer on a dependent chain: stock vs shared mode.

Run: ``pytest benches/bench_chain.py -s``. A chain of ``HOPS`` tasks
alternates between two worker processes (1 thread, 1 GiB each), each task
adding 1 to the array it receives, so every hop is one transfer of a value
fresh in the sender's private memory followed by one task; nothing else
runs. Shared mode is switched on by config alone, on the default root.
Timed: the chain (first submit to result), three chains per value size
after a warm-up chain of 10; stock and ours alternate per size.

The time ratio ours/stock is printed by benches/conftest.py. ``extra_info``:
``hop_ms``, the median chain's wall time per hop, and ``transfer_ms``, the
median of the receivers' own transfer durations
(``Worker.transfer_incoming_log``: request sent to value stored). What the chain measures is the
latency a transfer adds to a critical path (the export of a fresh value
writes it into the tmpfs before the peer can map it; stock's socket copy
overlaps with the receiver's read), which throughput figures do not show.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from clusters import process_cluster, worker_addresses  # noqa: E402
from p2p_workload import shared_config  # noqa: E402

KiB = 2**10
MiB = 2**20
HOPS = 200


def _bump(x: np.ndarray) -> np.ndarray:
    return x + 1


def _transfer_ms(dask_worker: Any) -> list[float]:
    return [e["duration"] * 1e3 for e in dask_worker.transfer_incoming_log]


@pytest.mark.parametrize("impl", ["stock", "ours"])
@pytest.mark.parametrize("nbytes", [64 * KiB, MiB, 8 * MiB], ids=["64KiB", "1MiB", "8MiB"])
def test_chain(benchmark: Any, impl: str, nbytes: int) -> None:
    benchmark.group = f"chain of {HOPS} hops, {nbytes // KiB} KiB values, 2 workers"
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        config = shared_config(root) if impl == "ours" else {}
        with process_cluster(2, "1GiB", config) as client:
            a, b = worker_addresses(client)

            def chain(hops: int) -> float:
                x = client.submit(np.zeros, nbytes // 8, workers=[a], pure=False)
                for i in range(hops):
                    x = client.submit(_bump, x, workers=[b if i % 2 == 0 else a], pure=False)
                return float(x.result()[0])

            assert chain(10) == 10  # connections, imports, first-use costs
            client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
            result = benchmark.pedantic(chain, args=(HOPS,), rounds=3, iterations=1)
            assert result == HOPS
            durations = [d for ds in client.run(_transfer_ms).values() for d in ds]

    hop_ms = benchmark.stats.stats.median / HOPS * 1e3
    transfer_ms = statistics.median(durations)
    benchmark.extra_info.update(hop_ms=hop_ms, transfer_ms=transfer_ms)
    print(
        f"\n{impl:5s} {nbytes // KiB:5d} KiB: {hop_ms:6.2f} ms per hop (median of 3 chains), "
        f"median transfer {transfer_ms:5.2f} ms ({len(durations)} transfers)"
    )
