"""Writing fresh values out before a peer asks for them: the forecast (pure),
the buffer on real files in /dev/shm, and a cluster of worker processes."""

from __future__ import annotations

import os
import threading
import time

import dask
import numpy as np
import pytest
from clusters import process_cluster, worker_addresses

from dask_shm.shared import SharedSpillBuffer, shm_metrics, transfer
from dask_shm.shared.write_ahead import MIN_SEEN, ExportForecast

MB = 2**20


# -- the forecast ----------------------------------------------------------------------


def train(forecast: ExportForecast, prefix: str, exported: int, deleted: int) -> None:
    for i in range(exported + deleted):
        key = f"{prefix}-{i:08x}"
        forecast.stored(key)
        if i < exported:
            forecast.exported(key)
        else:
            forecast.deleted(key)


def test_a_prefix_is_written_ahead_once_peers_fetched_almost_all_of_its_values():
    forecast = ExportForecast()
    assert not forecast.stored("hop-00000000")  # nothing known yet
    forecast.exported("hop-00000000")
    train(forecast, "hop", MIN_SEEN - 2, 0)
    assert forecast.share("hop") == (MIN_SEEN - 1, MIN_SEEN - 1)
    assert not forecast.stored("hop-ffffffff")  # too few known
    forecast.exported("hop-ffffffff")
    assert forecast.stored("hop-eeeeeeee")  # 8 of 8
    # Tuple keys (dask arrays' chunks) go by their name's prefix.
    train(forecast, "block", 8, 1)
    assert forecast.stored(("block-1234", 3, 4))


def test_prefixes_fetched_a_third_of_the_time_are_never_written_ahead():
    """dask's tree reductions and element-wise graphs (docs/benchmarks.md)."""
    forecast = ExportForecast()
    train(forecast, "mean_chunk", 30, 70)
    # Halved whenever 64 are known: (30, 64) -> (15, 32), (15, 64) -> (7, 32), + 4.
    assert forecast.share("mean_chunk") == (7, 36)
    assert not forecast.stored(("mean_chunk-1234", 0))
    train(forecast, "random", 7, 1)  # 7 of 8 >= 0.8
    assert forecast.stored(("random-5678", 0))
    assert not forecast.stored(("mean_chunk-1234", 1))  # prefixes stay apart


def test_the_forecast_follows_a_prefix_whose_use_changes():
    forecast = ExportForecast()
    train(forecast, "x", 40, 0)
    assert forecast.stored("x-100")
    forecast.deleted("x-100")
    train(forecast, "x", 0, 40)  # the same names, now used locally only
    assert not forecast.stored("x-101")


def test_keys_never_stored_are_ignored():
    forecast = ExportForecast()
    forecast.exported("y-1")
    forecast.deleted("y-2")
    assert forecast.share("y") == (0, 0)
    forecast.stored("y-3")
    forecast.exported("y-3")
    forecast.exported("y-3")  # a second peer: counted once
    forecast.deleted("y-3")
    assert forecast.share("y") == (1, 1)


@pytest.mark.parametrize(
    "kwargs", [{"min_share": 0}, {"min_share": 1.5}, {"min_seen": 0}, {"min_seen": 40}]
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ExportForecast(**kwargs)


# -- the buffer ------------------------------------------------------------------------


@pytest.fixture
def forecast():
    return ExportForecast()


@pytest.fixture
def buffer(shm_dir, tmp_path, forecast):
    settings = {"shm.shared-memory.root": shm_dir, "shm.shared-memory.disk-root": str(tmp_path)}
    with dask.config.set(settings):
        buf = SharedSpillBuffer.from_config(200 * MB)
        transfer.enable_receiving(buf)
        buf.start_writing_ahead(MB, forecast)
        yield buf
        buf.close()
    transfer.enable_receiving(None)


def array(fill: float, nbytes: int = 2 * MB) -> np.ndarray:
    return np.full(nbytes // 8, fill)


def hand_over(buf: SharedSpillBuffer, key: str) -> np.ndarray:
    """Export ``key`` as the sender does and read the file as a peer would."""
    handle = buf.export(key)
    assert handle is not None
    try:
        with open(handle.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
    finally:
        os.unlink(handle.path)
    assert size >= buf[key].nbytes
    return buf[key]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def files_in(buf: SharedSpillBuffer) -> list[str]:
    """The files of the buffer's shared-memory tier, temporary ones included."""
    return sorted(os.listdir(buf.store.tiers.tiers[0].store.directory))


def test_a_value_whose_prefix_goes_to_peers_is_in_its_file_before_the_request(buffer):
    for i in range(MIN_SEEN):
        buffer[f"hop-{i}"] = array(i)
        assert key_in_memory(buffer, f"hop-{i}")  # not written ahead yet
        hand_over(buffer, f"hop-{i}")
        del buffer[f"hop-{i}"]
    buffer["hop-100"] = array(42.0)
    wait_for(lambda: buffer.store.file_of("hop-100") is not None)
    assert not key_in_memory(buffer, "hop-100")  # it left private memory
    assert buffer.shm_counters["written_ahead"] == 1
    np.testing.assert_array_equal(hand_over(buffer, "hop-100"), array(42.0))
    del buffer["hop-100"]
    assert buffer.shm_counters["written_ahead_unused"] == 0
    wait_for(lambda: files_in(buffer) == [])


def key_in_memory(buf: SharedSpillBuffer, key: str) -> bool:
    return key in buf.fast.d and buf.store.file_of(key) is None


def test_values_used_only_here_small_values_and_unknown_prefixes_stay_in_memory(buffer, forecast):
    for i in range(3 * MIN_SEEN):
        buffer[f"local-{i}"] = array(i)
        if i % 2:
            hand_over(buffer, f"local-{i}")  # half of them: not enough
        del buffer[f"local-{i}"]
    train(forecast, "small", 20, 0)
    buffer["local-100"] = array(1.0)
    buffer["small-100"] = array(1.0, nbytes=MB // 2)  # under min_bytes
    buffer["new-100"] = array(1.0)
    time.sleep(0.2)
    for key in ("local-100", "small-100", "new-100"):
        assert key_in_memory(buffer, key), key
    assert buffer.shm_counters["written_ahead"] == 0


def test_a_value_written_ahead_and_deleted_unused_is_counted_and_leaves_no_file(buffer, forecast):
    train(forecast, "hop", 20, 0)
    buffer["hop-101"] = array(1.0)
    wait_for(lambda: buffer.shm_counters["written_ahead"] == 1)
    del buffer["hop-101"]
    assert buffer.shm_counters["written_ahead_unused"] == 1
    wait_for(lambda: files_in(buffer) == [])


def test_a_value_replaced_or_deleted_during_its_write_keeps_no_file(buffer, forecast):
    """The write runs without the buffer's locks: a key that changes meanwhile
    drops the new file, and what the key holds now is what counts."""
    train(forecast, "hop", 20, 0)
    for round_ in range(20):
        buffer["hop-102"] = array(float(round_), nbytes=16 * MB)
        buffer["hop-102"] = array(-1.0)  # replaced while the first is being written
        del buffer["hop-102"]
    wait_for(lambda: not buffer._ahead)  # no write left registered as in flight
    buffer.close()  # waits for the write in flight
    assert files_in(buffer) == []
    assert not any(t.name.startswith("dask-shm-write-ahead") for t in threading.enumerate())


def test_an_export_during_the_write_waits_for_it_instead_of_writing_again(buffer, forecast):
    train(forecast, "hop", 20, 0)
    value = array(7.0, nbytes=64 * MB)
    buffer["hop-103"] = value
    # Right away: the write is in flight (or queued).
    np.testing.assert_array_equal(hand_over(buffer, "hop-103"), value)
    assert buffer.shm_counters["written_ahead"] == 1  # one file, written ahead
    assert len(files_in(buffer)) == 1


# -- a cluster -------------------------------------------------------------------------


def bump(x: np.ndarray) -> np.ndarray:
    return x + 1


@pytest.mark.parametrize("write_ahead", [True, False])
def test_a_chain_across_two_workers_is_written_ahead_unless_switched_off(write_ahead):
    """Every hop of the chain hands a fresh value to the other worker: after
    the first few, the sender has it in its file before the request comes.
    Results are stock's; ``write-ahead: false`` writes nothing ahead."""
    config = {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.write-ahead": write_ahead,
    }
    with process_cluster(2, "1GiB", config) as client:
        a, b = worker_addresses(client)
        x = client.submit(np.zeros, 2 * MB // 8, workers=[a], pure=False)
        hops = 4 * MIN_SEEN
        for i in range(hops):
            x = client.submit(bump, x, workers=[b if i % 2 == 0 else a], pure=False)
        assert float(client.submit(np.sum, x).result()) == hops * 2 * MB / 8
        figures = client.run(shm_metrics)
        written = sum(f["written_ahead"] for f in figures.values())
        linked = sum(f["link_transfers"] for f in figures.values())
        assert linked == hops
        if write_ahead:
            assert written >= hops - 2 * (MIN_SEEN + 1)
        else:
            assert written == 0


def test_an_export_waiting_for_a_write_that_close_cancelled_returns(buffer, forecast):
    """Writes queued behind a long one are cancelled by close; an export
    waiting for one of them returns instead of waiting forever."""
    train(forecast, "hop", 20, 0)
    for i in range(4):
        buffer[f"hop-{200 + i}"] = array(float(i), nbytes=48 * MB)
    results = []
    exporter = threading.Thread(target=lambda: results.append(buffer.export("hop-203")))
    closer = threading.Thread(target=buffer.close)
    exporter.start()
    closer.start()
    exporter.join(timeout=60)
    closer.join(timeout=60)
    assert not exporter.is_alive() and not closer.is_alive()
    assert len(results) == 1  # a handle or None: whichever came first
    if results[0] is not None:
        os.unlink(results[0].path)
