"""Honest memory readings for processes and the host.

A process's resident set size (RSS) includes the shared pages it has touched
(files on a tmpfs such as ``/dev/shm`` that it maps), so a Dask worker that maps
shared spill files would look as if it owned memory that it does not. On Linux
``/proc/<pid>/status`` splits RSS into anonymous, file-backed and shared-memory
pages; :func:`process_memory` reads that split, and
:attr:`ProcessMemory.private` is what the process really owns.

Host-wide, ``MemTotal - MemAvailable`` (:func:`host_memory_used`) counts each
tmpfs page once, however many processes map it, whereas summing process RSS
counts it once per process.

On platforms without ``/proc`` both functions fall back to psutil, which cannot
tell shared pages apart: the whole RSS is reported as private there.

:class:`MemorySampler` records these readings in a background thread.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import NamedTuple

__all__ = [
    "MemorySampler",
    "ProcessMemory",
    "Sample",
    "host_memory_used",
    "per_cpu_free_bytes",
    "process_memory",
]

#: Whether this platform has Linux's ``/proc`` (checked once, at import).
HAVE_PROC = os.path.exists("/proc/self/status") and os.path.exists("/proc/meminfo")


class ProcessMemory(NamedTuple):
    """Resident memory of one process, in bytes.

    On Linux ``rss == anon + file + shmem`` (``VmRSS``, ``RssAnon``,
    ``RssFile``, ``RssShmem`` of ``/proc/<pid>/status``). Elsewhere (psutil
    fallback) ``anon == rss`` and ``file == shmem == 0``.
    """

    #: Total resident set size (``VmRSS``).
    rss: int
    #: Resident anonymous pages: heap, stacks, private copies (``RssAnon``).
    anon: int
    #: Resident pages of ordinary files: code, libraries, page cache mapped
    #: by the process (``RssFile``).
    file: int
    #: Resident shared-memory pages: tmpfs files such as ``/dev/shm`` mapped by
    #: the process, SysV/POSIX shared memory (``RssShmem``).
    shmem: int

    @property
    def private(self) -> int:
        """``anon + file`` (``rss - shmem``): the memory the process owns, i.e.
        what a worker's memory monitor should compare with its memory limit."""
        return self.anon + self.file


def _kib_field(data: bytes, key: bytes) -> int | None:
    """Bytes of the ``<key>  <n> kB`` line of a /proc status-like file whose
    ``key`` is given with its leading newline and trailing colon; None if
    the line is missing."""
    start = data.find(key)
    if start < 0:
        return None
    start += len(key)
    end = data.find(b"\n", start)
    value = data[start:] if end < 0 else data[start:end]
    return int(value.split()[0]) * 1024


def _read_proc(path: str, pid: int | None) -> bytes:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(f"no process with pid {pid}") from None


def _process_memory_proc(pid: int | None) -> ProcessMemory:
    path = "/proc/self/status" if pid is None else f"/proc/{int(pid)}/status"
    data = _read_proc(path, pid)
    rss = _kib_field(data, b"\nVmRSS:")
    if rss is None:
        # No memory lines: a zombie (exited, not yet reaped) or a kernel thread.
        state = data.find(b"\nState:")
        if state >= 0 and data[state + 7 : state + 16].split()[:1] in ([b"Z"], [b"X"]):
            raise ProcessLookupError(f"process {pid} has exited")
        return ProcessMemory(0, 0, 0, 0)
    anon = _kib_field(data, b"\nRssAnon:")
    if anon is None:  # Linux < 4.5 has no split: count everything as private
        return ProcessMemory(rss, rss, 0, 0)
    file = _kib_field(data, b"\nRssFile:") or 0
    shmem = _kib_field(data, b"\nRssShmem:") or 0
    return ProcessMemory(rss, anon, file, shmem)


def _process_memory_psutil(pid: int | None) -> ProcessMemory:
    import psutil

    try:
        rss = int(psutil.Process(pid).memory_info().rss)
    except psutil.NoSuchProcess:  # includes ZombieProcess
        raise ProcessLookupError(f"no process with pid {pid}") from None
    return ProcessMemory(rss, rss, 0, 0)


def process_memory(pid: int | None = None) -> ProcessMemory:
    """Resident memory of process ``pid`` (None: this process).

    On Linux this reads ``/proc/<pid>/status`` once (one ``read`` of a ~1.5 KB
    file, a few microseconds), so it is cheap enough for a memory monitor
    running every 100 ms. Without ``/proc`` it asks psutil, which reports the
    whole RSS as private (``anon``).

    Raises ProcessLookupError if there is no such process or it has exited
    (including a zombie not yet reaped by its parent). A kernel thread reads
    as all zeros.
    """
    if HAVE_PROC:
        return _process_memory_proc(pid)
    return _process_memory_psutil(pid)


def _host_memory_used_psutil() -> int:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total - vm.available)


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PCP_COUNT = re.compile(rb"\n\s+count:\s+(\d+)")


def per_cpu_free_bytes() -> int:
    """Free pages parked on the kernel's per-CPU free lists (the ``count:`` of
    every pageset in ``/proc/zoneinfo``); 0 if unreadable."""
    try:
        with open("/proc/zoneinfo", "rb", buffering=0) as f:
            data = f.read()
    except OSError:
        return 0
    return sum(int(n) for n in _PCP_COUNT.findall(data)) * _PAGE_SIZE


def host_memory_used(*, raw: bool = False) -> int:
    """Bytes of RAM in use on this host: ``MemTotal - MemAvailable`` of
    ``/proc/meminfo``, minus the free pages on the kernel's per-CPU free lists.

    Pages of tmpfs files (``/dev/shm``) are not "available" (they cannot be
    dropped, only swapped), so shared data counts here exactly once however
    many processes map it; reclaimable page cache does not count.

    Pages just freed go to per-CPU lists first and are not counted in
    ``MemFree`` (hence not in ``MemAvailable``) until they drain, which can
    take seconds; recent kernels keep up to hundreds of MiB there per CPU, and
    new allocations take from those lists first. Uncorrected, memory freed a
    moment ago looks used and the next allocations of that size look free;
    subtracting the lists' ``count`` from ``/proc/zoneinfo`` makes a 256 MiB
    write to ``/dev/shm`` read as 256 MiB. ``raw=True`` skips that correction
    (plain ``MemTotal - MemAvailable``; cheaper: one small file instead of two).

    Without ``/proc`` (or on kernels without ``MemAvailable``): psutil's
    ``total - available``.
    """
    if not HAVE_PROC:
        return _host_memory_used_psutil()
    with open("/proc/meminfo", "rb", buffering=0) as f:
        data = b"\n" + f.read()
    total = _kib_field(data, b"\nMemTotal:")
    available = _kib_field(data, b"\nMemAvailable:")
    if total is None or available is None:
        return _host_memory_used_psutil()
    if raw:
        return total - available
    return max(0, total - available - per_cpu_free_bytes())


@dataclass(frozen=True)
class Sample:
    """One reading of :class:`MemorySampler`."""

    #: Seconds since :meth:`MemorySampler.start`.
    time: float
    #: :func:`host_memory_used` at that time.
    host_used: int
    #: :func:`process_memory` of each watched pid that was alive.
    processes: dict[int, ProcessMemory] = field(default_factory=dict)


#: What :class:`MemorySampler` watches: pids (a set you may keep changing while
#: it runs), or a callable returning the current pids.
PidSource = Iterable[int] | Callable[[], Iterable[int]]


class MemorySampler:
    """Records host and per-process memory every ``interval`` seconds in a
    background (daemon) thread.

    ``pids`` is read afresh at every sample: pass a set and add or remove pids
    while it runs, or a callable returning the pids to watch (e.g. the current
    worker processes of a cluster). A pid whose process has exited (or cannot
    be found) is left out of that sample; nothing is raised.

    :meth:`start` takes the first sample immediately (its host figure is
    :attr:`baseline`) and :meth:`stop` takes a last one, so even a run shorter
    than ``interval`` has two samples. Use as a context manager::

        with MemorySampler({worker_pid}, interval=0.1) as sampler:
            run_workload()
        print(sampler.peak_host_increase())

    :attr:`samples` may be read while the sampler runs (it is only appended to).
    """

    def __init__(self, pids: PidSource = (), interval: float = 0.1) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds; got {interval!r}")
        self.pids: PidSource = pids
        self.interval = float(interval)
        self.samples: list[Sample] = []
        #: :func:`host_memory_used` at :meth:`start` (None before).
        self.baseline: int | None = None
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> MemorySampler:
        """Clear earlier samples, take the first one and start the thread.

        Raises RuntimeError if already running.
        """
        if self._thread is not None:
            raise RuntimeError("MemorySampler is already running")
        self.samples = []
        self._error = None
        self._stop.clear()
        self._t0 = time.monotonic()
        first = self._take_sample()
        self.baseline = first.host_used
        self._thread = threading.Thread(
            target=self._run, name="dask-shm-memory-sampler", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a last sample (no-op if not running).

        Re-raises the exception that ended the sampling thread early, if any
        (e.g. ``/proc/meminfo`` became unreadable).
        """
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._take_sample()

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def peak_host_used(self) -> int:
        """Largest :attr:`Sample.host_used` so far.

        Raises RuntimeError if the sampler was never started.
        """
        samples = list(self.samples)
        if not samples:
            raise RuntimeError("no samples: MemorySampler was never started")
        return max(s.host_used for s in samples)

    def peak_host_increase(self) -> int:
        """:meth:`peak_host_used` minus :attr:`baseline` (>= 0): how much more
        host memory was in use at the peak than at :meth:`start`. On a busy
        host this includes what other programs allocated meanwhile."""
        peak = self.peak_host_used()
        assert self.baseline is not None
        return peak - self.baseline

    def _current_pids(self) -> tuple[int, ...]:
        source = self.pids
        for _ in range(5):
            try:
                return tuple(source() if callable(source) else source)
            except RuntimeError:  # a set changed size while being copied
                continue
        return ()

    def _take_sample(self) -> Sample:
        processes: dict[int, ProcessMemory] = {}
        for pid in self._current_pids():
            try:
                processes[pid] = process_memory(pid)
            except ProcessLookupError:
                continue
        sample = Sample(time.monotonic() - self._t0, host_memory_used(), processes)
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        deadline = time.monotonic()
        try:
            while True:
                deadline += self.interval
                delay = deadline - time.monotonic()
                if delay < 0:  # fell behind (slow host): skip, do not burst
                    deadline = time.monotonic()
                    delay = 0
                if self._stop.wait(delay):
                    return
                self._take_sample()
        except BaseException as e:  # reported by stop()
            self._error = e
