"""Issue 12: shared-memory mode loses or corrupts nothing (in-process workers,
PID namespaces, accounting, tampering, in-place writes, foreign roots).
Real clusters, real processes, real /dev/shm files."""

from __future__ import annotations

import numpy as np
import pytest
from distributed import Client, LocalCluster

from dask_shm import SharedMemoryPlugin

MB = 2**20


def _array_results(client: Client) -> tuple[float, float]:
    import dask.array as da

    x = da.random.RandomState(42).random((1200, 1200), chunks=(300, 300))
    matmul = client.compute((x @ x.T).sum()).result()
    rechunked = client.compute(x.rechunk((600, 200)).sum()).result()
    return float(matmul), float(rechunked)


def _expected() -> tuple[float, float]:
    import dask
    import dask.array as da

    x = da.random.RandomState(42).random((1200, 1200), chunks=(300, 300))
    with dask.config.set(scheduler="sync"):
        return float((x @ x.T).sum().compute()), float(x.rechunk((600, 200)).sum().compute())


@pytest.mark.parametrize("protocol", ["inproc", "tcp"])
def test_in_process_workers_get_values_not_handles(protocol: str) -> None:
    """processes=False: values between workers of one process are never
    handles over inproc:// (messages are not serialized there); over tcp://
    they may be, and come back as values."""
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=False,
            protocol=f"{protocol}://",
            dashboard_address=":0",
            memory_limit="2 GiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(SharedMemoryPlugin())
        assert all(client.run(lambda dask_worker: dask_worker.data.shared).values())
        assert _array_results(client) == pytest.approx(_expected(), rel=1e-12)
        a, b = cluster.workers.values()
        x = client.submit(np.full, MB, 1.0, workers=[a.address], key="x")
        got = client.submit(lambda v: type(v).__name__, x, workers=[b.address]).result()
        assert got == "ndarray"
        assert type(x.result()) is np.ndarray
        links = sum(w.data.shm_counters["link_transfers"] for w in cluster.workers.values())
        if protocol == "inproc":
            assert links == 0
        else:
            assert links > 0


def test_a_handle_never_enters_a_buffer(tmp_path) -> None:
    """The loud check at the boundary: a handle offered as a value is refused
    with an error naming the key, in private and shared buffers alike."""
    from distributed.protocol.serialize import to_serialize

    from dask_shm import SpillBuffer
    from dask_shm.shared.guard import HandleLeakError
    from dask_shm.shared.store import Handle

    handle = Handle("/dev/shm/nowhere", 100, 100, 100)
    for shared in (False, True):
        buffer = SpillBuffer(str(tmp_path / f"b{shared}"), 10 * MB, shared=shared)
        for value in (handle, to_serialize(handle)):
            with pytest.raises(HandleLeakError, match="'leaked'"):
                buffer["leaked"] = value
            assert "leaked" not in buffer
        buffer.close()
