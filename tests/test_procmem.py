"""dask_shm.procmem on the real system: /proc readings, no mocks."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import pytest

from dask_shm.procmem import (
    HAVE_PROC,
    MemorySampler,
    ProcessMemory,
    _process_memory_psutil,
    host_memory_used,
    process_memory,
)

MiB = 2**20
linux_only = pytest.mark.skipif(not HAVE_PROC, reason="needs Linux /proc")
needs_dev_shm = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def _write_file(path: str, nbytes: int) -> None:
    chunk = b"\x5a" * MiB  # one small private buffer, written many times
    with open(path, "wb") as f:
        for _ in range(nbytes // MiB):
            f.write(chunk)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: /proc/<pid> is gone
    return proc.pid


@linux_only
def test_own_process_reading_is_plausible():
    m = process_memory()
    assert isinstance(m, ProcessMemory)
    assert m.rss > 10 * MiB  # a Python interpreter with dask imported
    assert m.rss >= m.anon > 0 and m.file > 0 and m.shmem >= 0
    assert m.rss == m.anon + m.file + m.shmem  # the kernel's VmRSS is this sum
    assert m.private == m.anon + m.file == m.rss - m.shmem
    by_pid = process_memory(os.getpid())
    assert abs(by_pid.rss - m.rss) < 16 * MiB


@linux_only
@needs_dev_shm
def test_touched_shared_mapping_counts_as_shmem_not_anon(shm_dir):
    n = 64 * MiB
    path = os.path.join(shm_dir, "data")
    with open(path, "wb") as f:
        f.truncate(n)
    chunk = b"\x01" * MiB
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), n, flags=mmap.MAP_SHARED)
    try:
        before = process_memory()
        for offset in range(0, n, MiB):
            mm[offset : offset + MiB] = chunk  # touches every page of the file
        after = process_memory()
    finally:
        mm.close()
    released = process_memory()
    assert 0.9 * n <= after.shmem - before.shmem <= 1.1 * n
    assert after.anon - before.anon < n / 4
    assert after.private - before.private < n / 4
    assert after.rss - before.rss >= 0.9 * n  # RSS alone would blame the process
    assert after.shmem - released.shmem >= 0.9 * n  # unmapping gives it back


@linux_only
def test_dead_pid_raises_process_lookup_error():
    pid = _dead_pid()
    with pytest.raises(ProcessLookupError):
        process_memory(pid)


@linux_only
def test_zombie_raises_process_lookup_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while True:  # exited but not reaped: a zombie
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(ProcessLookupError):
            process_memory(proc.pid)
    finally:
        proc.wait()


def test_psutil_fallback_reports_rss_as_private():
    m = _process_memory_psutil(None)
    assert m.rss > 10 * MiB and m.anon == m.rss and m.file == m.shmem == 0
    assert m.private == m.rss
    with pytest.raises(ProcessLookupError):
        _process_memory_psutil(_dead_pid())


def _grows_by_half(measure, n, attempts=3):
    """Whether ``measure()`` (one try: the growth it saw) reaches n / 2 in one
    of a few tries: other programs on this shared host allocate and free
    memory meanwhile, which a real bug would not get past every time."""
    seen = []
    for _ in range(attempts):
        seen.append(measure())
        if seen[-1] >= 0.5 * n:
            return True
    pytest.fail(f"grew by only {[f'{g / MiB:.0f} MiB' for g in seen]} for {n / MiB:.0f} MiB")


@needs_dev_shm
def test_host_memory_used_counts_tmpfs_data(shm_dir):
    n = 256 * MiB
    path = os.path.join(shm_dir, "data")

    def measure():
        before = host_memory_used()
        assert 0 < before
        _write_file(path, n)
        after = host_memory_used()
        os.unlink(path)
        return after - before

    assert _grows_by_half(measure, n)
    # The uncorrected figure also counts free pages parked on per-CPU lists.
    assert host_memory_used() <= host_memory_used(raw=True) + 64 * MiB


@needs_dev_shm
def test_host_memory_used_right_after_freeing_the_same_amount(shm_dir):
    # Freed pages sit on per-CPU free lists (not in MemFree) and the next
    # allocations reuse them: the raw MemTotal - MemAvailable misses such a
    # write almost entirely, the corrected figure must not.
    n = 256 * MiB
    path = os.path.join(shm_dir, "data")

    def measure():
        _write_file(path, n)
        os.unlink(path)
        before = host_memory_used()
        _write_file(path, n)
        after = host_memory_used()
        os.unlink(path)
        return after - before

    assert _grows_by_half(measure, n)


@needs_dev_shm
def test_sampler_records_samples_and_peak(shm_dir):
    n = 128 * MiB
    path = os.path.join(shm_dir, "data")
    pids = {os.getpid()}
    sampler = MemorySampler(pids, interval=0.02)

    def measure():
        with sampler:
            assert sampler.running and len(sampler.samples) == 1  # first sample at start
            _write_file(path, n)
            time.sleep(0.2)
            os.unlink(path)
            time.sleep(0.1)
        return sampler.peak_host_increase()

    assert _grows_by_half(measure, n)
    assert not sampler.running
    samples = sampler.samples  # of the last run only: start() clears them
    assert len(samples) >= 5
    times = [s.time for s in samples]
    assert times == sorted(times) and times[0] < 0.05 and times[-1] >= 0.3
    assert all(os.getpid() in s.processes for s in samples)
    assert sampler.baseline == samples[0].host_used
    assert sampler.peak_host_used() == max(s.host_used for s in samples)
    assert sampler.peak_host_increase() == sampler.peak_host_used() - sampler.baseline
    count = len(samples)
    time.sleep(0.1)
    assert len(sampler.samples) == count  # stopped means stopped


def test_sampler_skips_pids_that_exit_and_reads_pids_afresh():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    pids = {os.getpid(), child.pid}
    try:
        with MemorySampler(pids, interval=0.02) as sampler:
            time.sleep(0.15)
            assert child.pid in sampler.samples[-1].processes
            child.wait()  # exits (and is reaped) while the sampler runs
            seen_exit = len(sampler.samples) + 1  # + a sample possibly in flight
            time.sleep(0.15)
            late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
            pids.add(late.pid)  # mutating the set while it runs
            time.sleep(0.15)
    finally:
        child.wait()
    try:
        after_exit = sampler.samples[seen_exit:]
        assert after_exit and all(child.pid not in s.processes for s in after_exit)
        assert all(os.getpid() in s.processes for s in sampler.samples)
        assert late.pid in sampler.samples[-1].processes
    finally:
        late.kill()
        late.wait()


def test_sampler_accepts_a_callable_and_an_empty_source():
    calls = []

    def pids():
        calls.append(1)
        return [os.getpid()]

    with MemorySampler(pids, interval=0.01) as sampler:
        time.sleep(0.1)
    assert len(calls) == len(sampler.samples) >= 3
    with MemorySampler() as empty:
        pass
    assert [s.processes for s in empty.samples] == [{}, {}]  # start and stop


def test_sampler_contract_errors():
    with pytest.raises(ValueError, match="interval"):
        MemorySampler(interval=0)
    sampler = MemorySampler()
    with pytest.raises(RuntimeError, match="never started"):
        sampler.peak_host_used()
    sampler.stop()  # not running: no-op
    sampler.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            sampler.start()
    finally:
        sampler.stop()
    assert sampler.peak_host_increase() >= 0
