"""dask_shm.stop_signal.StopSignal: the stop flag of the workers' periodic
threads behaves as the ``threading.Event`` it replaced does for them."""

from __future__ import annotations

import threading
import time

from dask_shm.stop_signal import StopSignal


def test_wait_times_out_while_not_set():
    stop = StopSignal()
    start = time.monotonic()
    assert stop.wait(0.05) is False
    assert time.monotonic() - start >= 0.04
    assert not stop.is_set()


def test_a_waiting_thread_wakes_when_set_and_every_later_wait_returns_at_once():
    stop = StopSignal()
    woke: list[float] = []

    def waiter() -> None:
        start = time.monotonic()
        assert stop.wait(30)
        woke.append(time.monotonic() - start)
        assert stop.wait(30) and stop.wait(0)  # set stays set

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert woke and woke[0] < 10
    assert stop.is_set() and stop.wait(0)


def test_set_twice_and_from_many_threads_at_once_is_harmless():
    stop = StopSignal()
    threads = [threading.Thread(target=stop.set) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    assert stop.is_set() and stop.wait(0)


def test_a_negative_timeout_is_a_poll():
    stop = StopSignal()
    assert stop.wait(-1) is False
    stop.set()
    assert stop.wait(-1) is True
