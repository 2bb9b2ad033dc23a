"""What one measured run of the demo gives: :class:`RunResult`, plain data shared
by the runner (which fills it) and the table and plot (which show it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dask_shm.demo.sampling import WorkerSeries


@dataclass
class RunResult:
    """Measurements of one run. Bytes are bytes; times are seconds since the
    run started (before the cluster was created)."""

    label: str
    #: Whether dask-shm's shared-memory mode was on.
    ours: bool
    #: Time from submitting the graph to having the result.
    wall_seconds: float
    #: The workload's result, ``float((x @ x.T).sum())``.
    result: float
    #: Peak of ``MemTotal - MemAvailable`` minus its value when the run
    #: started.
    host_peak_increase: int
    #: Largest private memory (RSS minus shared pages) of any worker process:
    #: :func:`peak_private` of ``private_by_worker``, the plot's source too.
    worker_peak_private: int
    #: Largest sum over workers of spilled bytes (scheduler's view): what is
    #: in spill files, on disk or on the shared-memory tmpfs.
    spilled_peak: int
    #: Bytes of values workers sent each other as bytes over TCP (stock's
    #: ``transfer_outgoing_bytes_total``; in shared-memory mode the values
    #: that were not handed over by hard link).
    tcp_bytes: int
    #: Bytes workers gave each other as hard links to shared-memory files.
    link_bytes: int
    #: Keys sent by hard link; keys (and their bytes) that a shared-memory
    #: worker sent to a peer as bytes instead (e.g. too small to share).
    link_transfers: int = 0
    fallback_transfers: int = 0
    fallback_bytes: int = 0
    #: Largest sum over workers of bytes in shared-memory files on the tmpfs
    #: (dask-shm's ``shared_bytes`` heartbeat metric; 0 for stock), and of
    #: spilled bytes that are not shared (spill files on disk), in one sample.
    shared_peak: int = 0
    disk_spilled_peak: int = 0
    #: ``(time, host used minus baseline)`` samples.
    host: list[tuple[float, int]] = field(default_factory=list)
    #: ``(time, sum of the worker processes' private memory)`` samples.
    workers_private: list[tuple[float, int]] = field(default_factory=list)
    #: Worker name -> the scheduler's view of its memory over time.
    workers: dict[str, WorkerSeries] = field(default_factory=dict)
    #: When the computation was submitted and when its result arrived.
    compute_start: float = 0.0
    compute_end: float = 0.0
    #: Worker name -> ``(time, private memory of its process)`` samples
    #: (procmem: RSS minus shared pages): the one source of private memory of
    #: the table (peak) and the plot (per-worker line, sum).
    private_by_worker: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    #: Memory limit of each worker (0: none).
    memory_limit: int = 0
    #: Cores other processes used, read every second during the run.
    other_cpu_cores: list[float] = field(default_factory=list)


def peak_private(private_by_worker: dict[str, list[tuple[float, int]]]) -> int:
    """Largest private memory of any worker in any sample (0 without samples)."""
    return max((v for series in private_by_worker.values() for _, v in series), default=0)


def private_sum(private_by_worker: dict[str, list[tuple[float, int]]]) -> list[tuple[float, int]]:
    """``(time, sum over workers)`` of per-worker samples taken together
    (same times, as procmem samples every process at once)."""
    totals: dict[float, int] = {}
    for series in private_by_worker.values():
        for t, v in series:
            totals[t] = totals.get(t, 0) + v
    return sorted(totals.items())
