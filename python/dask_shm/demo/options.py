"""Sizes of the demo workload, and defaults sized from the machine."""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
from dask.system import CPU_COUNT
from dask.utils import format_bytes

GiB = 2**30
MiB = 2**20

#: x is ``n`` rows by ``WIDTH_FACTOR * n`` columns, chunked by rows only: every
#: output block of ``x @ x.T`` needs two row blocks of x (a pure all-to-all), and
#: the work (``2 n**2 m`` flops) stays moderate for the bytes moved.
WIDTH_FACTOR = 4

#: ``--quick``: finishes both runs in well under a minute on a 2-core machine.
QUICK_SIZE = 256 * MiB
QUICK_CHUNK = 16 * MiB

#: Smallest default memory limit per worker: a worker process with numpy loaded
#: uses about 150 MiB before it holds any data.
MIN_MEMORY_LIMIT = 512 * MiB


@dataclass(frozen=True)
class DemoConfig:
    """What ``dask-shm demo`` runs: ``(x @ x.T).sum()`` with ``x`` a
    ``size``-byte array of random floats in row blocks of about ``chunk``
    bytes, on ``workers`` worker processes with ``threads`` threads and
    ``memory_limit`` bytes each."""

    size: int
    chunk: int
    workers: int
    threads: int
    memory_limit: int
    output: str = "dask-shm-demo.png"

    def __post_init__(self) -> None:
        for name in ("size", "chunk", "workers", "threads", "memory_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive; got {value!r}")
        if self.chunk > self.size:
            raise ValueError(
                f"--chunk ({format_bytes(self.chunk)}) must not exceed "
                f"--size ({format_bytes(self.size)})"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, WIDTH_FACTOR * n)`` float64 elements, about ``size`` bytes."""
        n = max(1, round(math.sqrt(self.size / 8 / WIDTH_FACTOR)))
        return n, WIDTH_FACTOR * n

    @property
    def chunks(self) -> tuple[int, int]:
        """Row blocks of about ``chunk`` bytes spanning all columns."""
        n, m = self.shape
        rows = min(n, max(1, round(self.chunk / 8 / m)))
        return rows, m

    @property
    def nbytes(self) -> int:
        n, m = self.shape
        return 8 * n * m

    def describe(self) -> str:
        n, m = self.shape
        rows, _ = self.chunks
        nchunks = -(-n // rows)
        return (
            f"(x @ x.T).sum(), x: {n:,} x {m:,} float64 ({format_bytes(self.nbytes)}) in "
            f"{nchunks} row blocks of {format_bytes(8 * rows * m)}; "
            f"{self.workers} worker processes x {self.threads} thread"
            f"{'s' if self.threads > 1 else ''}, {format_bytes(self.memory_limit)} each"
        )


def default_config(
    *,
    quick: bool = False,
    size: int | None = None,
    chunk: int | None = None,
    workers: int | None = None,
    threads: int | None = None,
    memory_limit: int | None = None,
    output: str | None = None,
    total_memory: int | None = None,
    cores: int | None = None,
) -> DemoConfig:
    """The demo's configuration: every size not given is derived from the
    machine (``total_memory`` bytes of RAM and ``cores``, by default this
    host's, as dask counts them) or, with ``quick``, from small sizes.

    - ``size``: ``min(2 GiB, RAM / 12)`` (256 MiB with ``quick``);
    - ``chunk``: 64 MiB (16 MiB with ``quick``), at most ``size / 4``;
    - ``workers``: ``max(2, min(4, cores))``; ``threads``: 1;
    - ``memory_limit`` per worker: the cluster holds ``x`` about twice,
      at least 512 MiB each.

    Raises ValueError (naming the option) for a non-positive value or a chunk
    larger than the array.
    """
    if total_memory is None:
        total_memory = int(psutil.virtual_memory().total)
    if cores is None:
        cores = CPU_COUNT
    if size is None:
        size = QUICK_SIZE if quick else min(2 * GiB, total_memory // 12)
    if chunk is None:
        chunk = max(1, min(QUICK_CHUNK if quick else 64 * MiB, size // 4))
    if workers is None:
        workers = max(2, min(4, cores))
    if threads is None:
        threads = 1
    if memory_limit is None and workers > 0:
        memory_limit = max(MIN_MEMORY_LIMIT, -(-2 * size // workers))
    return DemoConfig(
        size=size,
        chunk=chunk,
        workers=workers,
        threads=threads,
        memory_limit=memory_limit or 0,
        output=output or "dask-shm-demo.png",
    )


#: Host memory one run may need, as a multiple of ``size``: stock peaked at
#: +2.2x size (2 workers) in the README's runs, and the graph, the result
#: and the interpreters come on top.
PEAK_FACTOR = 2.5
#: Most row blocks of x: ``x @ x.T`` has (row blocks)**2 output blocks, and
#: the client builds that graph in its own memory before anything runs.
MAX_ROW_BLOCKS = 256
#: Smallest acceptable ``--memory-limit``: a worker process with numpy loaded
#: uses about 150 MiB before it holds any data.
MIN_WORKER_MEMORY = 256 * MiB
#: Seconds one run of ``x`` of 1 GiB took on the 2-core dev machine with 2
#: workers (``dask-shm demo --size 1GiB``: 41.6 s stock, 32.6 s ours); run time
#: grows about as ``size ** 1.5`` (2 GiB: 113 s / 85 s) and with workers
#: beyond the cores (4 workers on 2 cores: 1.9x).
SECONDS_PER_GIB_RUN = 37.0
STARTUP_SECONDS = 5.0


def row_blocks(config: DemoConfig) -> int:
    """Row blocks of x (``x @ x.T`` has this many squared output blocks)."""
    n, _ = config.shape
    rows, _ = config.chunks
    return -(-n // rows)


def unfit_reasons(config: DemoConfig, *, total_memory: int, available_memory: int) -> list[str]:
    """Why ``config`` cannot run on a host with this RAM (``total_memory``)
    and ``MemAvailable`` (``available_memory``): each reason names the option
    to change; empty when it fits. ``--force`` runs it anyway."""
    reasons = []
    need = int(PEAK_FACTOR * config.nbytes)
    if need > available_memory:
        reasons.append(
            f"--size {format_bytes(config.nbytes)} needs about {format_bytes(need)} of host "
            f"memory ({PEAK_FACTOR}x the array in the stock run) but only "
            f"{format_bytes(available_memory)} is available"
        )
    cluster = config.workers * config.memory_limit
    if cluster > total_memory:
        reasons.append(
            f"--workers {config.workers} x --memory-limit {format_bytes(config.memory_limit)} "
            f"= {format_bytes(cluster)} exceeds this host's RAM ({format_bytes(total_memory)}); "
            "workers are never paused nor restarted in the demo"
        )
    blocks = row_blocks(config)
    if blocks > MAX_ROW_BLOCKS:
        reasons.append(
            f"--size / --chunk gives {blocks:,} row blocks, so x @ x.T has {blocks**2:,} "
            f"blocks: building that graph alone would take the client's memory "
            f"(at most {MAX_ROW_BLOCKS} row blocks; use a larger --chunk)"
        )
    return reasons


def check_memory_limit(config: DemoConfig) -> None:
    """Raises ValueError (naming ``--memory-limit``) for a limit no worker of
    this workload can run under: below what an idle worker process uses, or
    smaller than the two row blocks and the output block one task holds."""
    rows, m = config.chunks
    block = 8 * rows * m
    task = 2 * block + 8 * rows * rows
    floor = max(MIN_WORKER_MEMORY, task + MIN_WORKER_MEMORY // 2)
    if config.memory_limit < floor:
        raise ValueError(
            f"--memory-limit {format_bytes(config.memory_limit)} is too small: a worker "
            f"process uses about 150 MiB idle and one task of this workload holds "
            f"{format_bytes(task)} (two row blocks and an output block); use at least "
            f"{format_bytes(floor)}"
        )


def estimated_seconds(config: DemoConfig, cores: int | None = None) -> float:
    """Rough duration of the whole demo (both runs), from the dev machine's
    measurements (see :data:`SECONDS_PER_GIB_RUN`); workers beyond ``cores``
    (default: this host's) slow it down in proportion."""
    cores = cores or CPU_COUNT
    gib = config.nbytes / GiB
    oversubscribed = max(1.0, config.workers * config.threads / cores)
    return 2 * (STARTUP_SECONDS + SECONDS_PER_GIB_RUN * gib**1.5 * oversubscribed)
