"""Shared-memory mode with many keys: O(1) work per key on the event loops,
and a bounded number of memory mappings per worker (real processes, real
files on /dev/shm)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import dask
import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, Worker, wait

from dask_shm import SharedMemoryNannyPlugin, SharedMemoryPlugin, _core
from dask_shm.procmem import process_memory
from dask_shm.shared import SharedSpillBuffer, dirty, transfer
from dask_shm.shared.published_share import SharePublisher, read_published_share

KIB = 2**10
MB = 2**20
#: 72 KiB: above the default min-size, so every value is a shared file
VALUE_BYTES = 72 * KIB


def make_value(i: int) -> np.ndarray:
    return np.full(VALUE_BYTES // 8, float(i))


def take_three(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> float:
    return float(a[0] + b[-1] + c[len(c) // 2])


def mappings_of(directory: str) -> int:
    """Memory mappings of this process whose file is under ``directory``
    (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if directory in line)


@pytest.fixture
def root(shm_dir, tmp_path) -> Iterator[str]:
    settings = {"shm.shared-memory.root": shm_dir, "shm.shared-memory.disk-root": str(tmp_path)}
    with dask.config.set(settings):
        yield shm_dir
    transfer.enable_receiving(None)


def test_held_values_beyond_the_map_bound_go_back_to_their_files(root):
    """More values held than ``max_mapped``: at most that many stay mapped,
    the others go back to their files (nothing written), and every value
    reads back correct, mapped again on use."""
    buf = SharedSpillBuffer.from_config(64 * MB)
    buf.max_mapped = 40
    n = 300
    for i in range(n):
        buf[f"k{i}"] = make_value(i)
    buf.evict()
    while len(buf.fast):
        buf.evict()
    assert len(buf.slow) == n
    written = buf.cumulative_metrics["disk-write", "count"]
    directory = buf.store.directory
    for _ in range(2):
        for i in range(n):
            v = buf[f"k{i}"]
            assert v[0] == i and v[-1] == i
            del v
            assert len(buf.store.retained) <= 40
        assert mappings_of(directory) <= 40
    assert buf.unmapped >= 2 * n - 40
    assert buf.cumulative_metrics["disk-write", "count"] == written, "eviction wrote nothing"
    assert buf.store.degraded_reads == 0
    # the most recently used are the mapped ones; a use keeps a value mapped
    assert list(buf.store.retained) == [f"k{i}" for i in range(n - 40, n)]
    buf[f"k{n - 40}"]
    buf["k0"]
    assert f"k{n - 40}" in buf.store.retained and f"k{n - 39}" not in buf.store.retained
    # the store's record of its mappings (what the written-in-place check
    # reads instead of /proc/self/maps) agrees with the kernel's
    st = os.stat(buf.store.path(f"k{n - 1}"))
    ranges = _core.mapped_ranges(st.st_dev, st.st_ino)
    assert len(ranges) == 1
    assert ranges == dirty.mapped_ranges(st.st_ino, st.st_dev)
    for i in range(n):
        np.testing.assert_array_equal(buf[f"k{i}"], make_value(i))
    buf.close()


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[Client]:
    # Every 72 KiB value handed over as a file (min-size's threshold): the
    # subject here is many shared files. By default values under 1 MiB still
    # in private memory travel as bytes.
    with process_cluster(4, "4GiB", {"shm.shared-memory.transfer-min-size": "64 KiB"}) as client:
        client.register_plugin(SharedMemoryPlugin())
        client.register_plugin(SharedMemoryNannyPlugin())
        yield client


def _timed(calls: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            calls.append(time.perf_counter() - start)

    timed.__wrapped__ = fn  # type: ignore[attr-defined]
    return timed


def _time_worker_monitor(dask_worker: Worker) -> None:
    calls: list[float] = []
    dask_worker.monitor.get_process_memory = _timed(calls, dask_worker.monitor.get_process_memory)
    dask_worker._shm_monitor_calls = calls  # type: ignore[attr-defined]


def _worker_report(dask_worker: Worker) -> dict[str, float]:
    calls = dask_worker._shm_monitor_calls  # type: ignore[attr-defined]
    data = dask_worker.data
    return {
        "monitor_calls": len(calls),
        "monitor_max": max(calls, default=0.0),
        "tick_max": dask_worker.digests_max["tick-duration"],
        "shared_files": data.store.tiers.tier("shared").store.shared_len(),
        "files": len(data.store.tiers),
        "mapped": len(data.store.retained),
        "degraded_reads": data.store.degraded_reads,
    }


def test_many_shared_keys_are_correct_and_stay_shared_files(shared_cluster):
    """Thousands of 72 KiB shared values, each used by a task on another
    worker: correct results, every value a shared file, no degraded read.
    The time the nanny's terminate check and the worker's memory monitor take
    is printed, not asserted (a busy host stretches any call): that the
    nanny's check does no per-file work is
    :func:`test_the_nannys_check_reads_one_published_number`, and
    ``benches/bench_scale.py`` measures event-loop ticks."""
    client = shared_cluster
    cluster = client.cluster
    workers = worker_addresses(client)
    client.run(_time_worker_monitor)
    nanny_calls: list[float] = []
    for nanny in cluster.workers.values():
        pc = nanny.periodic_callbacks["memory_monitor"]
        pc.callback = _timed(nanny_calls, pc.callback)
    n = 2000
    values = [
        client.submit(make_value, i, key=f"v-{i}", workers=[workers[i % 4]], pure=False)
        for i in range(n)
    ]
    sums = [
        client.submit(
            take_three,
            values[i],
            values[(i + 1) % n],
            values[(i + 2) % n],
            key=f"s-{i}",
            workers=[workers[(i + 1) % 4]],
            pure=False,
        )
        for i in range(n)
    ]
    wait(sums)
    got = client.gather(sums)
    assert got == [float(i + (i + 1) % n + (i + 2) % n) for i in range(n)]
    time.sleep(0.5)  # a few more monitor ticks with every file in place
    reports = client.run(_worker_report)
    for address, r in reports.items():
        assert r["files"] >= n // 4, (address, r)  # every value stays a shared file
        assert r["shared_files"] > 0, (address, r)
        assert r["monitor_calls"] > 0
        assert r["degraded_reads"] == 0
    assert nanny_calls
    scheduler_tick = cluster.scheduler.digests_max["tick-duration"]
    print(
        f"\n{n} keys: scheduler/nanny loop max tick {scheduler_tick * 1000:.0f} ms; nanny check "
        f"max {max(nanny_calls) * 1000:.2f} ms over {len(nanny_calls)} calls; workers: "
        + ", ".join(
            f"tick {r['tick_max'] * 1000:.0f} ms / monitor {r['monitor_max'] * 1000:.2f} ms"
            for r in reports.values()
        )
    )
    del values, sums


def _record_export_threads(dask_worker: Worker) -> None:
    import threading

    data = dask_worker.data
    threads: list[str] = []
    hand_over = data.hand_over  # what the sender calls

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return hand_over(*args, **kwargs)

    data.hand_over = recorded
    dask_worker._shm_export_threads = threads  # type: ignore[attr-defined]


def _export_threads(dask_worker: Worker) -> list[str]:
    data = dask_worker.data
    del data.hand_over  # the instance attribute: back to the method
    return dask_worker._shm_export_threads  # type: ignore[attr-defined]


def total_of(*values: np.ndarray) -> float:
    return float(sum(v[0] for v in values))


def test_a_large_batch_is_written_out_off_the_event_loop(shared_cluster):
    """A peer fetching many values at once: the sender writes them out and
    links them in distributed's offload thread, not on its event loop (where
    a batch of small values would block it for tens of ms); a single value
    is swapped in place. Results are the values sent."""
    from dask_shm.shared.sender import OFFLOAD_KEYS

    client = shared_cluster
    a, b = worker_addresses(client)[:2]
    client.run(_record_export_threads, workers=[a])
    n = 4 * OFFLOAD_KEYS
    many = [client.submit(make_value, i, workers=[a], pure=False) for i in range(n)]
    one = client.submit(make_value, n, workers=[a], pure=False)
    wait([*many, one])
    assert client.submit(total_of, *many, workers=[b], pure=False).result() == sum(range(n))
    assert client.submit(total_of, one, workers=[b], pure=False).result() == n
    threads = client.run(_export_threads, workers=[a])[a]
    assert len(threads) == n + 1, threads
    assert all(t.startswith("Dask-Offload") for t in threads[:n]), threads
    assert threads[n] == "MainThread", threads  # the worker's event loop
    links = client.run(lambda dask_worker: dask_worker.data.shm_counters["link_transfers"])
    assert links[a] >= n + 1, links
    del many, one


class _CountingScandir:
    """``os.scandir`` that counts the directory entries it yields."""

    def __init__(self) -> None:
        self.entries = 0
        self.real = os.scandir

    def __call__(self, path: Any = ".") -> Any:
        counter = self
        it = self.real(path)

        class Counted:
            def __enter__(self) -> Counted:
                return self

            def __exit__(self, *exc: object) -> None:
                it.close()

            def __iter__(self) -> Iterator[os.DirEntry[str]]:
                for e in it:
                    counter.entries += 1
                    yield e

        return Counted()


def test_the_nannys_check_reads_one_published_number(shared_cluster, monkeypatch):
    """The nanny counts a worker's private memory plus the share the worker
    publishes, looking at a few directory entries, not at the worker's
    files (which the workload above left by the thousand)."""
    client = shared_cluster
    cluster = client.cluster
    address, consumer = worker_addresses(client)[:2]
    n = 600
    values = [client.submit(make_value, i, workers=[address], pure=False) for i in range(n)]
    firsts = [client.submit(lambda v: v[0], v, workers=[consumer], pure=False) for v in values]
    assert client.gather(firsts) == [float(i) for i in range(n)]

    def held(dask_worker: Worker) -> int:
        return len(dask_worker.data.store.tiers)

    files = client.run(held, workers=[address])[address]
    assert files >= n
    pid = client.run(os.getpid, workers=[address])[address]
    nanny = next(n for n in cluster.workers.values() if n.worker_address == address)
    check = nanny.periodic_callbacks["memory_monitor"].callback
    terminator = getattr(check, "__wrapped__", check)
    assert terminator.root is not None

    def share() -> int:
        return client.run(lambda dask_worker: dask_worker.data.tier2_bytes(), workers=[address])[
            address
        ]

    expected = share()
    assert expected > files * VALUE_BYTES // 4
    # what the worker publishes, within a few monitor intervals
    deadline = time.monotonic() + 5
    while abs(read_published_share(terminator.root, pid) - share()) > VALUE_BYTES:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    counting = _CountingScandir()
    monkeypatch.setattr(os, "scandir", counting)
    memory = terminator.memory(pid)
    monkeypatch.setattr(os, "scandir", counting.real)
    assert abs(memory - process_memory(pid).private - share()) < 16 * MB
    # a few entries (this user's process directories, one process directory),
    # never the worker's files
    assert counting.entries <= 64, counting.entries
    assert counting.entries < files // 10
    del values, firsts


def test_a_published_share_that_cannot_be_read_counts_nothing(shm_dir):
    """The nanny sums the numbers a worker process's buffers publish; a
    missing, empty or garbled file counts 0 and never raises."""
    base = os.path.join(shm_dir, f"dask-shm-{os.geteuid()}")
    pid = 4242424  # above the kernel's largest pid_max: no such process,
    # so the directories' start times are not checked
    assert read_published_share(shm_dir, pid) == 0  # no user directory yet
    one = os.path.join(base, f"p-{pid}-100-aaaa")
    two = os.path.join(base, f"p-{pid}-200-bbbb")
    other = os.path.join(base, f"p-{pid}1-100-cccc")  # another pid, not ours
    for d in (one, two, other):
        os.makedirs(d)
    for directory, name, text in [
        (one, "w-1.share", "1000"),
        (one, "w-2.share", "24"),
        (one, "w-3.share", "garbled"),
        (two, "w-4.share", ""),
        (two, "w-5.share", "7"),
        (other, "w-6.share", "99999"),
        (one, "w-7", "5"),  # a buffer's directory name, not a published share
    ]:
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    assert read_published_share(shm_dir, pid) == 1031


_PUBLISHER_IN_A_CONTAINER = """
import os, sys, time
from dask_shm.shared import paths
from dask_shm.shared.published_share import SharePublisher, read_published_share, share_path
root, mib, ready, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
publisher = SharePublisher(share_path(paths.subdir(root, "w")), lambda: mib * 2**20, lambda: None)
publisher.start()
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.05)
print(os.getpid(), read_published_share(root, os.getpid()) // 2**20, flush=True)
"""


def test_a_nanny_counts_only_its_own_container_s_worker(shm_dir, tmp_path):
    # Two containers (PID namespaces) sharing the root, each with a process
    # of the same pid publishing a share: each reads only its own.
    import subprocess
    import sys

    from namespaces import unavailable_reason

    reason = unavailable_reason("--pid", "--fork", "--mount-proc")
    if reason:
        pytest.skip(reason)
    go = tmp_path / "go"
    procs, ready = [], []
    for i, mib in enumerate((300, 7)):
        ready.append(tmp_path / f"ready-{i}")
        command = [sys.executable, "-c", _PUBLISHER_IN_A_CONTAINER, shm_dir, str(mib)]
        procs.append(
            subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", *command, str(ready[-1]), str(go)],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    go.touch()
    answers = [p.communicate(timeout=60)[0].split() for p in procs]
    assert answers[0][0] == answers[1][0], "not the same pid: the test proves nothing"
    assert [int(a[1]) for a in answers] == [300, 7]


def test_the_publisher_follows_the_share_and_refreshes_link_counts(shm_dir):
    share = [5]
    refreshes: list[float] = []
    path = os.path.join(shm_dir, "w.share")
    publisher = SharePublisher(
        path,
        lambda: share[0],
        lambda: refreshes.append(time.monotonic()),
        interval=0.01,
        refresh_interval=0.2,
    )
    publisher.start()

    def published() -> str:
        """The number (the PID namespace written after it aside)."""
        with open(path) as f:
            return f.read().split()[0]

    assert published() == "5"  # at once
    share[0] = 123_456
    deadline = time.monotonic() + 5
    while published() != "123456":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    while len(refreshes) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # rate-limited: never closer than refresh_interval
    assert min(b - a for a, b in itertools.pairwise(refreshes)) >= 0.19
    publisher.stop()
    assert not os.path.exists(path)


def test_the_publisher_ends_with_its_worker(shm_dir):
    """Once ``alive()`` is false (its worker closed) the thread ends and
    removes the file, even if nobody calls ``stop``."""
    alive = [True]
    path = os.path.join(shm_dir, "w.share")
    publisher = SharePublisher(path, lambda: 1, lambda: None, interval=0.01, alive=lambda: alive[0])
    publisher.start()
    assert os.path.exists(path)
    alive[0] = False
    publisher._thread.join(timeout=5)
    assert not publisher._thread.is_alive()
    assert not os.path.exists(path)
