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
