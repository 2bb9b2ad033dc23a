"""``dask-shm demo``: one all-to-all array workload, ``(x @ x.T).sum()``, run on
a LocalCluster of worker processes twice, with stock distributed and then with
dask-shm's shared-memory mode, measured and shown side by side.

- :mod:`~dask_shm.demo.options`: the workload's sizes (:class:`DemoConfig`),
  defaults sized from the machine;
- :mod:`~dask_shm.demo.runner`: runs the workload on a cluster while sampling
  memory (:class:`DemoRun`, :func:`run_workload`);
- :mod:`~dask_shm.demo.result`: what a run gives (:class:`RunResult`), plain data;
- :mod:`~dask_shm.demo.sampling`: the scheduler-side sampler of each worker's
  managed / unmanaged / spilled memory (host and per-process memory come from
  :mod:`dask_shm.procmem`);
- :mod:`~dask_shm.demo.progress`: a text progress bar that does not flood a
  pipe or a log file;
- :mod:`~dask_shm.demo.table` and :mod:`~dask_shm.demo.plot`: the report.
"""

from __future__ import annotations

from dask_shm.demo.options import DemoConfig, default_config
from dask_shm.demo.result import RunResult
from dask_shm.demo.runner import DemoRun, run_demo, run_workload
from dask_shm.demo.table import format_table, results_match

__all__ = [
    "DemoConfig",
    "DemoRun",
    "RunResult",
    "default_config",
    "format_table",
    "results_match",
    "run_demo",
    "run_workload",
]
