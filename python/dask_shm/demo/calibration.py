"""A short calibration before the demo: how fast this host multiplies row
blocks now, and from that how long the demo will take.

The workload, ``(x @ x.T).sum()``, is bound by its ``2 n**2 m`` flops, done
one row-block product at a time by single-threaded BLAS in each worker
thread (distributed's nannies set ``OMP_NUM_THREADS=1`` and friends). So
:func:`measure` times such products in as many single-threaded processes at
once as the demo will run worker threads, under whatever load the host has
now, and :func:`estimated_seconds` scales the flops by that rate.
:data:`OVERHEAD` (scheduling, transfers, spilling, the random numbers) was
fitted on the 2-core dev machine; the estimate is for both runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NamedTuple

from dask_shm.demo.options import DemoConfig

#: Wall seconds of one run per second of pure row-block products at the
#: measured rate: random numbers, transfers, spilling and scheduling on top.
#: Fitted on the 2-core dev machine (shared, partly busy) from both runs of
#: ``--quick`` (38 s measured; 3.6) and ``--size 1GiB`` (174 s; 3.1).
OVERHEAD = 3.2
#: Seconds to start and close a LocalCluster of worker processes, per run.
STARTUP_SECONDS = 5.0
#: Seconds each calibration process spends multiplying.
CALIBRATION_SECONDS = 1.0

_PROBE = """
import sys, time
import numpy as np
rows, cols, budget = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
a = np.random.default_rng(0).random((rows, cols))
a @ a.T
flops, start = 0.0, time.perf_counter()
while time.perf_counter() - start < budget:
    a @ a.T
    flops += 2.0 * rows * rows * cols
print(flops / (time.perf_counter() - start))
"""

#: The environment distributed's nannies give workers: single-threaded BLAS.
_SINGLE_THREADED = {
    name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
}


class Calibration(NamedTuple):
    """What :func:`measure` found: the flops per second of one worker thread
    while ``parallel`` of them ran at once on this host."""

    flops_per_second: float
    parallel: int


def workload_flops(config: DemoConfig) -> float:
    """Flops of ``x @ x.T`` for ``x`` of ``config.shape``: ``2 n**2 m``."""
    n, m = config.shape
    return 2.0 * n * n * m


def estimated_seconds(config: DemoConfig, calibration: Calibration) -> float:
    """Both runs' duration: per run, :data:`STARTUP_SECONDS` plus the
    workload's flops at ``calibration``'s rate times the worker threads that
    ran at once, times :data:`OVERHEAD`."""
    rate = calibration.flops_per_second * max(1, calibration.parallel)
    return 2 * (STARTUP_SECONDS + OVERHEAD * workload_flops(config) / rate)


def measure(config: DemoConfig, seconds: float = CALIBRATION_SECONDS) -> Calibration:
    """Time row-block products of the demo's own block shape (at most 1024
    rows, to stay short) in ``workers * threads`` single-threaded processes
    at once. Raises OSError/RuntimeError if a probe cannot run."""
    block_rows, m = config.chunks
    block_rows = min(1024, block_rows)
    parallel = config.workers * config.threads
    env = {**os.environ, **_SINGLE_THREADED}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROBE, str(block_rows), str(m), str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(parallel)
    ]
    rates = []
    for proc in procs:
        out, err = proc.communicate(timeout=60 + 10 * seconds)
        if proc.returncode != 0:
            raise RuntimeError(f"calibration probe failed: {err.strip()[-500:]}")
        rates.append(float(out))
    return Calibration(sum(rates) / len(rates), parallel)
