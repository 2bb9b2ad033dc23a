"""Latency of one same-host transfer, stock vs shared mode: on a dependent
chain of tasks, and the hand-over's own work in one process.

Run: ``pytest benches/bench_chain.py -s`` (``-k handover`` for the in-process
hand-over alone, see ``test_handover``). A chain of ``HOPS`` tasks
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
import threading
import time
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


def _spin(stop: threading.Event) -> None:
    """Run Python until ``stop`` is set, as a worker's task thread running
    pure-Python code does: it lets go of the GIL only when another thread
    has waited for it for the interpreter's switch interval (5 ms)."""
    n = 0
    while not stop.is_set():
        for _ in range(1000):
            n += 1


@pytest.mark.parametrize("impl", ["stock", "ours"])
@pytest.mark.parametrize("nbytes", [64 * KiB, MiB], ids=["64KiB", "1MiB"])
@pytest.mark.parametrize("busy", [False, True], ids=["alone", "beside-python"])
def test_handover(benchmark: Any, impl: str, nbytes: int, busy: bool, tmp_path: Any) -> None:
    """The per-value work of one same-host transfer, in one process: no
    scheduler, no sockets, so it shows the fixed cost of each side alone.
    ``beside-python``: with another thread running pure Python meanwhile,
    as a worker's task thread may while its event loop hands values over;
    every release of the GIL on the way can then cost a wait of up to the
    switch interval, which the 90th percentile per value shows.

    - stock: the sender's buffer holds the value; it is serialized into
      frames, the frames are copied into one buffer (the receiver's read of
      the socket) and deserialized, the receiver's buffer stores it, and both
      buffers delete it;
    - ours: the same buffers in shared mode; the sender exports the value
      (written into the tmpfs, sealed, hard-linked out), the receiver takes
      the handle over (validated, linked, mapped) and stores it, the handle's
      link goes, and both buffers delete it.

    Timed: 200 values per round, the time per value in ``extra_info``
    (``handover_us``, and ``p90_us``, the 90th percentile of single values
    over all rounds). The sockets stock also writes and reads are not in it.
    """
    from distributed.protocol import deserialize_bytes, serialize_bytelist
    from distributed.spill import SpillBuffer

    from dask_shm.shared import SharedSpillBuffer, transfer

    benchmark.group = f"one hand-over in one process, {nbytes // KiB} KiB values" + (
        ", beside a thread running Python" if busy else ""
    )
    values = 200
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        if impl == "ours":

            def shared(name: str) -> Any:
                return SharedSpillBuffer.create(
                    2**30,
                    root=root,
                    disk_root=str(tmp_path / "disk"),
                    budget=2**30,
                    min_size=64 * KiB,
                    min_shared_fraction=0.5,
                    name=name,
                )

            sender, receiver = shared("sender"), shared("receiver")
        else:
            sender = SpillBuffer(str(tmp_path / "sender"), target=2**30)
            receiver = SpillBuffer(str(tmp_path / "receiver"), target=2**30)

        def one(key: int) -> None:
            sender[key] = np.full(nbytes // 8, float(key))
            if impl == "ours":
                handle = sender.export(key)
                assert handle is not None
                with transfer.receiving_into(receiver):
                    value = transfer.receive(handle)
                os.unlink(handle.path)
            else:
                value = deserialize_bytes(b"".join(serialize_bytelist(sender[key])))
            receiver[key] = value
            del value
            assert receiver[key][0] == key
            del sender[key], receiver[key]

        singles: list[float] = []

        def round_() -> None:
            for key in range(values):
                start = time.perf_counter()
                one(key)
                singles.append(time.perf_counter() - start)

        stop = threading.Event()
        spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
        if busy:
            spinner.start()
        try:
            round_()  # first-use costs
            singles.clear()
            benchmark.pedantic(round_, rounds=10, iterations=1)
        finally:
            stop.set()
            if busy:
                spinner.join()
        if impl == "ours":
            sender.close()
            receiver.close()
    handover_us = benchmark.stats.stats.median / values * 1e6
    p90_us = statistics.quantiles(singles, n=10)[-1] * 1e6
    benchmark.extra_info.update(handover_us=handover_us, p90_us=p90_us)
    print(
        f"\n{impl:5s} {nbytes // KiB:5d} KiB{' beside Python' if busy else ''}: "
        f"{handover_us:7.1f} us per value (median round), 90th percentile {p90_us:7.1f} us"
    )
