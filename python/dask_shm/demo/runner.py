"""Runs the demo workload on a LocalCluster of worker processes and measures it."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Any, TextIO

import dask
import dask.array as da
from dask.array import PerformanceWarning
from distributed import Client, LocalCluster, Scheduler, Worker, wait
from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import IOLoop

from dask_shm.demo.busy import LoadSampler
from dask_shm.demo.options import DemoConfig
from dask_shm.demo.progress import show_progress
from dask_shm.demo.result import RunResult, peak_private, private_sum
from dask_shm.demo.sampling import ClusterMemorySampler
from dask_shm.procmem import MemorySampler

#: The same for both runs: memory target/spill fractions keep their defaults,
#: but workers never pause nor get killed, so stock is not stopped for the
#: memory it uses and both runs do the same work.
CLUSTER_CONFIG: dict[str, Any] = {
    "distributed.worker.memory.pause": False,
    "distributed.worker.memory.terminate": False,
}

STOCK_LABEL = "stock distributed"
OURS_LABEL = "dask-shm"

#: Seconds between samples of host / worker process memory (procmem) and of
#: the scheduler's view of worker memory.
HOST_INTERVAL = 0.1
CLUSTER_INTERVAL = 0.25


def shared_memory_plugin() -> WorkerPlugin:
    """dask-shm's shared-memory mode, as a worker plugin."""
    from dask_shm import SharedMemoryPlugin

    plugin: WorkerPlugin = SharedMemoryPlugin()
    return plugin


def transfer_counters(dask_worker: Worker) -> dict[str, float]:
    """Runs on a worker: what it sent to its peers (stock counter, which also
    counts hard-link handles as if bytes were sent, plus dask-shm's split)."""
    from dask_shm.shared import shm_metrics

    counters = {k: float(v) for k, v in shm_metrics(dask_worker).items()}
    counters["outgoing_bytes"] = float(dask_worker.transfer_outgoing_bytes_total)
    return counters


def workload(config: DemoConfig) -> da.Array:
    """``(x @ x.T).sum()`` with ``x`` the configured array of random floats."""
    x = da.random.default_rng(0).random(config.shape, chunks=config.chunks)
    with warnings.catch_warnings():
        # x @ x.T has (row blocks)**2 blocks: that is the point of the workload.
        warnings.simplefilter("ignore", PerformanceWarning)
        return (x @ x.T).sum()


class DemoRun:
    """One run of the workload on a fresh LocalCluster, as a context manager::

        with DemoRun(config, ours=True) as run:
            run.compute()
        result = run.result()

    Entering starts the memory samplers (the host baseline is taken then),
    the cluster and the client, and with ``ours`` registers dask-shm's
    shared-memory plugin before anything is computed. Leaving closes the
    cluster and stops the samplers.
    """

    def __init__(
        self,
        config: DemoConfig,
        *,
        ours: bool,
        label: str | None = None,
        progress: TextIO | None = None,
        show_progress: bool = True,
    ) -> None:
        self.config = config
        self.ours = ours
        self.label = label or (OURS_LABEL if ours else STOCK_LABEL)
        self.progress_stream = progress
        self.show_progress = show_progress
        self._pids: set[int] = set()
        self.memory = MemorySampler(self._pids, interval=HOST_INTERVAL)
        #: Worker pid -> its name (as the scheduler's samples name it).
        self._names: dict[int, str] = {}
        self.load = LoadSampler(self._pids)
        self.t0 = 0.0
        self.cluster: LocalCluster | None = None
        self.client: Client | None = None
        self.scheduler_sampler: ClusterMemorySampler | None = None
        self.value: float | None = None
        self.wall_seconds = 0.0
        self.compute_start = 0.0
        self.compute_end = 0.0
        self.counters: dict[str, float] = {}
        self._config_ctx: Any = None

    def __enter__(self) -> DemoRun:
        self._config_ctx = dask.config.set(CLUSTER_CONFIG)
        self._config_ctx.__enter__()
        try:
            self.t0 = time.monotonic()
            self.memory.start()
            self.cluster = LocalCluster(
                n_workers=self.config.workers,
                threads_per_worker=self.config.threads,
                processes=True,
                memory_limit=self.config.memory_limit,
                dashboard_address=":0",
                silence_logs=logging.ERROR,
            )
            self.client = Client(self.cluster)
            pids = self.client.run(os.getpid)
            self._pids.update(pids.values())
            scheduler = self._scheduler_and_loop()[0]
            self._names = {pid: str(scheduler.workers[a].name) for a, pid in pids.items()}
            self.load.start()
            if self.ours:
                self.client.register_plugin(shared_memory_plugin())
            scheduler, loop = self._scheduler_and_loop()
            self.scheduler_sampler = ClusterMemorySampler(
                scheduler, loop, self.t0, CLUSTER_INTERVAL
            ).start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _scheduler_and_loop(self) -> tuple[Scheduler, IOLoop]:
        """The LocalCluster's in-process scheduler and its event loop."""
        cluster = self.cluster
        assert cluster is not None, "use DemoRun as a context manager"
        scheduler, loop = cluster.scheduler, cluster.loop
        assert scheduler is not None and loop is not None
        return scheduler, loop

    def compute(self) -> float:
        """Run the workload once; returns its result (also kept as
        :attr:`value`) and sets :attr:`wall_seconds`."""
        assert self.client is not None, "use DemoRun as a context manager"
        collection = workload(self.config)
        start = time.monotonic()
        future = self.client.compute(collection)
        if self.show_progress:
            scheduler, loop = self._scheduler_and_loop()
            show_progress([future], scheduler, loop, self.label, self.progress_stream)
        else:
            wait(future)
        value = float(future.result())
        end = time.monotonic()
        del future
        self.value = value
        self.wall_seconds = end - start
        self.compute_start = start - self.t0
        self.compute_end = end - self.t0
        totals: dict[str, float] = {}
        for counters in self.client.run(transfer_counters).values():
            for k, v in counters.items():
                totals[k] = totals.get(k, 0.0) + v
        self.counters = totals
        return value

    def __exit__(self, *exc: object) -> None:
        try:
            if self.scheduler_sampler is not None and self.cluster is not None:
                try:
                    self.scheduler_sampler.stop()
                except RuntimeError:  # the loop is already gone
                    pass
            if self.client is not None:
                self.client.close()
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.load.stop()
            try:
                if self.memory.running:
                    self.memory.stop()
            finally:
                if self._config_ctx is not None:
                    self._config_ctx.__exit__(None, None, None)
                    self._config_ctx = None

    def result(self) -> RunResult:
        """The measurements (after :meth:`compute` and leaving the context)."""
        if self.value is None:
            raise RuntimeError("the workload has not been computed")
        samples = list(self.memory.samples)
        baseline = self.memory.baseline or 0
        private_by_worker: dict[str, list[tuple[float, int]]] = {}
        for s in samples:
            for pid, pm in s.processes.items():
                if pid in self._names:
                    private_by_worker.setdefault(self._names[pid], []).append((s.time, pm.private))
        outgoing = int(self.counters.get("outgoing_bytes", 0))
        link_bytes = int(self.counters.get("link_bytes", 0))
        fallback_bytes = int(self.counters.get("fallback_bytes", 0))
        # Stock's outgoing counter also counts values handed over as hard-link
        # handles; in shared-memory mode every peer of the demo is on this
        # host, so what went over TCP as bytes is exactly the fallbacks.
        tcp_bytes = fallback_bytes if self.ours else outgoing
        sampler = self.scheduler_sampler
        return RunResult(
            label=self.label,
            ours=self.ours,
            wall_seconds=self.wall_seconds,
            result=self.value,
            host_peak_increase=max(0, max((s.host_used for s in samples), default=0) - baseline),
            worker_peak_private=peak_private(private_by_worker),
            spilled_peak=sampler.peak_spilled if sampler else 0,
            tcp_bytes=tcp_bytes,
            link_bytes=link_bytes,
            link_transfers=int(self.counters.get("link_transfers", 0)),
            fallback_transfers=int(self.counters.get("fallback_transfers", 0)),
            fallback_bytes=fallback_bytes,
            shared_peak=sampler.peak_shared if sampler else 0,
            disk_spilled_peak=sampler.peak_disk_spilled if sampler else 0,
            host=[(s.time, s.host_used - baseline) for s in samples],
            workers_private=private_sum(private_by_worker),
            workers=self.scheduler_sampler.workers if self.scheduler_sampler else {},
            compute_start=self.compute_start,
            compute_end=self.compute_end,
            private_by_worker=private_by_worker,
            memory_limit=self.config.memory_limit,
            other_cpu_cores=list(self.load.readings),
        )


def run_workload(
    config: DemoConfig,
    *,
    ours: bool,
    progress: TextIO | None = None,
    show_progress: bool = True,
) -> RunResult:
    """One measured run of the workload on a fresh cluster."""
    with DemoRun(config, ours=ours, progress=progress, show_progress=show_progress) as run:
        run.compute()
    return run.result()


def run_demo(
    config: DemoConfig, *, out: TextIO | None = None, plot: bool = True
) -> tuple[RunResult, RunResult]:
    """The whole demo: stock, then dask-shm; prints the table to ``out``
    (default stdout) and writes the plot to ``config.output``."""
    from dask_shm.demo.table import format_table

    out = out if out is not None else sys.stdout
    print(config.describe(), file=out, flush=True)
    stock = run_workload(config, ours=False, progress=out)
    ours = run_workload(config, ours=True, progress=out)
    print(file=out)
    print(format_table(stock, ours), file=out)
    if plot:
        from dask_shm.demo.plot import plot_runs

        plot_runs([stock, ours], config.output, title=config.describe())
        print(f"\nplot: {config.output}", file=out, flush=True)
    return stock, ours
