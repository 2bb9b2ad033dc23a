"""Real workloads (the coiled/benchmarks suite's, see tests/workloads.py) on a
LocalCluster: stock vs dask-shm's shared mode, alternated in one run.

Run: ``pytest benches/bench_workloads.py -s`` (``-k double_diff`` for one
workload). Every workload runs ``DASK_SHM_BENCH_ROUNDS`` (default 2) rounds
of stock then ours (stock, ours, stock, ours), each on a fresh LocalCluster
of ``DASK_SHM_BENCH_WORKERS`` (default 2) worker processes x 1 thread x
``DASK_SHM_BENCH_WORKER_MEMORY`` (default 512 MiB), one BLAS/OpenMP thread
per worker. Sizes follow the cluster's memory (times
``DASK_SHM_BENCH_SCALE``, default 1). Shared mode is switched on by config
alone (preloads + ``shm.shared-memory.enabled``), as a user would; its
root is dask config's (``DASK_SHM__SHARED_MEMORY__ROOT=/mnt/huge`` for a
tmpfs mounted with ``huge=within_size``, where arrays born shared turn on
by default). Timed:
the computation (graph to result), not the cluster's start. Before each
baseline the bench waits (at most 20 s) for the kernel's per-CPU free lists
to stop shrinking, so that pages the previous run freed do not lower the
next run's figures.

Those lists make single runs noisy: Linux 6.7+ lets each CPU's list grow
with its traffic (up to 632 MiB per CPU on the 2-core dev box),
``MemAvailable`` does not count their pages, and a run's peak can catch them
full or empty. As root,
``DASK_SHM_BENCH_PCP_HIGH_FRACTION=100000`` sets
``vm.percpu_pagelist_high_fraction`` to that for the bench (lists of a few
hundred pages, not auto-tuned) and restores it afterwards: the outside
measure then sees the memory the workers hold. A setting any admin can
reproduce, recorded per run as ``pcp_high_fraction`` (None: untouched).

A run that never finishes (a stock worker paused for good with every key
already spilled has been seen in ``set_index_p2p``) fails after
``DASK_SHM_BENCH_RUN_TIMEOUT`` seconds (default 3600) and the bench goes on
with the next run, so one stall does not take the rest of a series with it.

``extra_info`` of each run (the ``*_bytes`` figures are printed side by side
with ratios ours/stock by benches/conftest.py; a line per run is printed as
it goes, with the load average):

- ``host_peak_bytes``: peak of ``MemTotal - MemAvailable`` (/proc/meminfo,
  sampled every 50 ms) during the compute minus its value just before;
- ``anon_pages_bytes``, ``shmem_bytes``, ``page_tables_bytes``,
  ``slab_bytes``, ``mapped_bytes``, ``dirty_bytes``: those /proc/meminfo
  fields at the peak minus just before; ``percpu_free_bytes``: free pages
  on the kernel's per-CPU lists (/proc/zoneinfo), likewise, which
  ``MemAvailable`` does not count as available; ``outside_bytes``: host peak
  minus the AnonPages and Shmem increases (what the issue calls "ours
  outside"); ``host_less_percpu_bytes``: host peak minus the per-CPU free
  pages' increase (free memory the outside measure counts as used: shared
  mode frees tmpfs pages to the kernel, stock's heaps keep theirs);
- ``loopback_bytes``: bytes sent on ``lo`` during the compute;
- ``link_bytes``: bytes the workers handed over by hard link (0 for stock);
- ``p2p_file_bytes``: bytes of P2P shard batches handed to a peer as a file
  (0 for stock; a shuffle's or rechunk's shards, which ``link_bytes`` does
  not count);
- ``written_ahead``, ``written_ahead_unused``: values written to shared
  memory before a peer asked for them, and of those the ones deleted without
  being handed over (see ``dask_shm.shared.write_ahead``; 0 for stock);
- ``task_seconds``: the workers' time in tasks (sum of the task stream's
  compute intervals); ``busy``: that over workers x wall, the share of the
  worker threads' time spent computing (near 1: the wall is the tasks' own
  work, which no hand-over can shorten); ``transfers`` and
  ``transfer_median_ms``: hand-overs between workers and the median of their
  durations as the receiving worker timed them (request to value in memory);
- ``worker_cpu_seconds``: user + system CPU the worker processes used
  during the compute (psutil, from the bench's process: they run on this
  host), and apart ``worker_user_seconds`` and ``worker_system_seconds``;
  ``thread_cpu_seconds``: the same CPU by the workers' threads, summed per
  kind (``loop``: the event loop's thread; ``tasks``: the task threads;
  ``offload``: distributed's offload thread; ``dask-shm``: dask-shm's own
  threads, the Rust unlinking thread among them; ``other``), from each
  thread's schedstat. Threads that ended during the compute are missing.
  Unlike wall time it does not depend on how a busy host shares its
  cores. A worker that died meanwhile takes its CPU with it; one started
  meanwhile counts from its start;
- ``page_faults``, ``huge_page_faults``, ``pages_allocated``: the host's
  page faults, faults that allocated (and zeroed) a 2 MiB transparent huge
  page, and 4 KiB pages handed out by the kernel's page allocator during the
  compute (/proc/vmstat ``pgfault``, ``thp_fault_alloc``, the ``pgalloc_*``
  sum). Zeroing fresh pages is a third of a P2P shuffle's worker CPU in
  stock and ours alike (numpy and arrow madvise their large buffers into
  huge pages, and freed ones go back to the kernel); the page allocator's
  traffic is what the per-CPU lists' size changes the cost of;
- ``loop_stalled_seconds``, ``loop_stalls``, ``loop_max_stall_ms``: how
  long the workers' event loops could not run anything (transfers, the
  memory monitor's spilling, the scheduler's messages): a callback asks to
  run every 10 ms on each worker's loop, and every wait over 50 ms is a
  stall, counted with its excess over 10 ms (summed over the workers; a
  worker that restarted counts from its restart). Beside ``busy`` and
  ``worker_cpu_seconds`` it tells a wall time lost to a blocked loop from
  one lost in tasks. It says how long, not whose code: that is
  tests/loop_attribution.py's job, whose stack sampling would weigh on
  these runs;
- ``born_shared``: whether the workers allocate arrays born shared
  (False for stock);
- ``worker_restarts``: workers the scheduler removed during the compute
  (nannies restart a worker above ``terminate``). A run with a restart
  recomputes what it lost: its wall and peak are not comparable with a
  clean run's. (With ``spilling``'s old 128 MiB chunks, on 2 x 512 MiB, a
  worker was restarted in about one run of four, 44 pairs: stock 9, shared
  mode 11; see tests/workloads.py for why its chunks changed);
- ``pcp_high_fraction``: ``vm.percpu_pagelist_high_fraction`` as the bench
  set it, or None;
- ``result`` and ``equal_to_stock`` (the same number as stock's run of the
  same round, checked: a differing result fails the run; spilling's float sum
  to 1e-12: stock's spilled chunks come back unaligned and numpy sums those in
  another order, so stock's last bit depends on what it spilled).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import psutil
import pytest
from dask.utils import parse_bytes
from distributed import get_task_stream

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from clusters import process_cluster  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from dask_shm.procmem import per_cpu_free_bytes  # noqa: E402
from dask_shm.shared import shm_metrics  # noqa: E402
from dask_shm.shared.born import stats as born_stats  # noqa: E402

WORKERS = int(os.environ.get("DASK_SHM_BENCH_WORKERS", "2"))
WORKER_MEMORY = parse_bytes(os.environ.get("DASK_SHM_BENCH_WORKER_MEMORY", "512 MiB"))
SCALE = float(os.environ.get("DASK_SHM_BENCH_SCALE", "1"))
ROUNDS = int(os.environ.get("DASK_SHM_BENCH_ROUNDS", "2"))
PCP_HIGH_FRACTION = os.environ.get("DASK_SHM_BENCH_PCP_HIGH_FRACTION")
#: Seconds one run (cluster start, compute, close) may take before
#: pytest-timeout fails it and the bench goes on to the next run.
RUN_TIMEOUT = float(os.environ.get("DASK_SHM_BENCH_RUN_TIMEOUT", "3600"))
PCP_SYSCTL = Path("/proc/sys/vm/percpu_pagelist_high_fraction")
INTERVAL = 0.05

#: /proc/meminfo fields reported at the peak, as extra_info names.
FIELDS = {
    "AnonPages": "anon_pages",
    "Shmem": "shmem",
    "PageTables": "page_tables",
    "Slab": "slab",
    "Mapped": "mapped",
    "Dirty": "dirty",
    "PerCpuFree": "percpu_free",
}
ONE_THREAD = {"OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1}
SHARED_MODE = {
    "distributed.worker.preload": ["dask_shm"],
    "distributed.nanny.preload": ["dask_shm"],
    "shm.shared-memory.enabled": True,
}
#: workload -> round -> stock's result
STOCK_RESULTS: dict[str, dict[int, float]] = {}


def same_result(workload: str, stock: Any, ours: Any) -> bool:
    """Equal, or for spilling's float sum equal to 1e-12 (see the module doc)."""
    if workload == "spilling":
        return bool(math.isclose(stock, ours, rel_tol=1e-12))
    return bool(stock == ours)


def read_meminfo() -> dict[str, int]:
    """/proc/meminfo as bytes per field."""
    out = {}
    with open("/proc/meminfo", "rb", buffering=0) as f:
        for line in f.read().decode().splitlines():
            name, _, rest = line.partition(":")
            out[name] = int(rest.split()[0]) * 1024
    out["PerCpuFree"] = per_cpu_free_bytes()
    return out


def settle_percpu_free(timeout: float = 20.0) -> None:
    """Wait (at most ``timeout`` s) until the per-CPU free lists stop
    shrinking. The kernel trims them about once a second once pages stop
    being freed; a baseline taken while the previous run's pages still sit
    there would be high, and the run measured after it would look smaller
    (seen on the 16-core machine: stock's AnonPages grew by 2.7 GiB while
    its per-CPU free pages fell by 0.6 GiB)."""
    deadline = time.monotonic() + timeout
    last = per_cpu_free_bytes()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = per_cpu_free_bytes()
        if now >= last:
            return
        last = now


@pytest.fixture(scope="module", autouse=True)
def pcp_high_fraction() -> Iterator[int | None]:
    """``vm.percpu_pagelist_high_fraction`` for the bench's runs when
    ``DASK_SHM_BENCH_PCP_HIGH_FRACTION`` asks for it (restored after), else
    None (left as it is)."""
    if PCP_HIGH_FRACTION is None:
        yield None
        return
    try:
        wanted = int(PCP_HIGH_FRACTION)
    except ValueError:
        wanted = -1
    if wanted != 0 and wanted < 8:
        pytest.fail(
            f"DASK_SHM_BENCH_PCP_HIGH_FRACTION={PCP_HIGH_FRACTION!r}: "
            "the kernel takes 0 (its default sizing) or an integer >= 8"
        )
    try:
        previous = PCP_SYSCTL.read_text()
        PCP_SYSCTL.write_text(str(wanted))
    except OSError as e:
        pytest.fail(f"cannot set {PCP_SYSCTL} (needs root and Linux 5.14+): {e}")
    try:
        yield wanted
    finally:
        PCP_SYSCTL.write_text(previous)


def host_used(info: dict[str, int]) -> int:
    return info["MemTotal"] - info["MemAvailable"]


class PeakMeminfo:
    """Reads /proc/meminfo every ``interval`` s in a thread; keeps the reading
    taken just before (``before``) and the one where ``MemTotal -
    MemAvailable`` was highest (``peak``)."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self.before: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        info = read_meminfo()
        if host_used(info) > host_used(self.peak):
            self.peak = info

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMeminfo:
        self.before = self.peak = read_meminfo()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def increase(self, field: str) -> int:
        return self.peak[field] - self.before[field]


def loopback_sent() -> int:
    return int(psutil.net_io_counters(pernic=True)["lo"].bytes_sent)


def worker_cpu_seconds(pids: set[int]) -> dict[int, tuple[float, float]]:
    """User and system CPU seconds used so far by each live process of ``pids``."""
    seconds = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        seconds[pid] = (times.user, times.system)
    return seconds


#: Worker threads by a part of their name (Python's, else the kernel's
#: ``comm``; the task threads' is ``<n>-Dask-Default-Threads-<pid>-<n>``), as
#: ``thread_cpu_seconds`` groups them; the rest is "other".
THREAD_GROUPS = (
    ("MainThread", "loop"),
    ("Dask-Default-Threads", "tasks"),
    ("Dask-Offload", "offload"),
    ("dask-shm", "dask-shm"),
)


def _thread_names() -> dict[int, str]:
    """This process's Python threads: native id -> name."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def thread_runtimes(pids: set[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """``(pid, tid) -> (comm, seconds on a CPU so far)`` for every thread of
    ``pids`` (``/proc/<pid>/task/<tid>/schedstat``: exact, where the
    tick-sampled ``stat`` times over-count threads that wake on timer ticks)."""
    times = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            task = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{task}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"{task}/comm") as f:
                    comm = f.read().strip()
            except (OSError, ValueError, IndexError):
                continue
            times[(pid, int(tid))] = (comm, ns / 1e9)
    return times


def thread_cpu_seconds(
    before: dict[tuple[int, int], tuple[str, float]],
    after: dict[tuple[int, int], tuple[str, float]],
    names: dict[int, dict[int, str]],
) -> dict[str, float]:
    """CPU seconds of the workers' threads between two
    :func:`thread_runtimes`, summed by :data:`THREAD_GROUPS` (``names``: pid
    -> :func:`_thread_names`). A thread that ended in between is not
    counted; one started in between counts from its start."""
    groups: dict[str, float] = {}
    for (pid, tid), (comm, seconds) in after.items():
        name = names.get(pid, {}).get(tid, comm)
        group = next((g for part, g in THREAD_GROUPS if part in name), "other")
        used = seconds - before.get((pid, tid), (comm, 0.0))[1]
        groups[group] = groups.get(group, 0.0) + used
    return {group: round(seconds, 2) for group, seconds in groups.items()}


#: /proc/vmstat counters reported over the compute, as extra_info names
#: (a name of several counters reports their sum).
VMSTAT = {
    "page_faults": ("pgfault",),
    "huge_page_faults": ("thp_fault_alloc",),
    "pages_allocated": ("pgalloc_dma", "pgalloc_dma32", "pgalloc_normal", "pgalloc_movable"),
}


def read_vmstat() -> dict[str, int]:
    """The host's counters of :data:`VMSTAT` (0 for a counter this kernel lacks)."""
    with open("/proc/vmstat") as f:
        counters = dict(line.split() for line in f)
    return {
        name: sum(int(counters.get(field, 0)) for field in fields)
        for name, fields in VMSTAT.items()
    }


HANDED_OVER = ("link_bytes", "p2p_file_bytes", "written_ahead", "written_ahead_unused")


def _handed_over(dask_worker: Any) -> list[float]:
    """This worker's :data:`HANDED_OVER` figures."""
    figures = shm_metrics(dask_worker)
    return [figures[name] for name in HANDED_OVER]


def task_stream_figures(records: list[dict[str, Any]], workers: int, wall: float) -> dict[str, Any]:
    """:func:`distributed.get_task_stream` records -> ``task_seconds``,
    ``busy``, ``transfers`` and ``transfer_median_ms`` (see the module's
    docstring)."""
    durations: dict[str, list[float]] = {"compute": [], "transfer": []}
    for record in records:
        for interval in record["startstops"]:
            if interval["action"] in durations:
                durations[interval["action"]].append(interval["stop"] - interval["start"])
    computes, transfers = durations["compute"], durations["transfer"]
    task_seconds = sum(computes)
    return {
        "task_seconds": round(task_seconds, 2),
        "busy": round(task_seconds / (workers * wall), 3) if wall > 0 else None,
        "transfers": len(transfers),
        "transfer_median_ms": round(statistics.median(transfers) * 1000, 2) if transfers else None,
    }


def _workers_removed(dask_scheduler: Any) -> int:
    """Workers the scheduler has removed so far (a nanny restarting one above
    ``terminate`` removes it): events, not the current count, so a restarted
    worker that came back still counts."""
    events = dask_scheduler.get_events("all")
    return sum(1 for _, msg in events if msg.get("action") == "remove-worker")


#: The loop watch's period and what counts as a stall (see the module's docstring).
LOOP_TICK = 0.01
LOOP_STALL = 0.05


def _watch_loop(dask_worker: Any) -> None:
    """Start recording the stalls of this worker's event loop."""
    from tornado.ioloop import PeriodicCallback

    stalls: list[float] = []
    last = time.perf_counter()

    def tick() -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last > LOOP_STALL:
            stalls.append(now - last - LOOP_TICK)
        last = now

    callback = PeriodicCallback(tick, LOOP_TICK * 1000)
    callback.start()
    dask_worker._bench_loop_watch = (callback, stalls)


def _loop_stalls(dask_worker: Any) -> list[float]:
    """Stop the watch and return the stalls' excesses in seconds (none for a
    worker started after the watch)."""
    watch = getattr(dask_worker, "_bench_loop_watch", None)
    if watch is None:
        return []
    callback, stalls = watch
    callback.stop()
    return stalls


def _born_shared() -> bool:
    return born_stats()["directory"] is not None


def cluster_config(impl: str) -> dict[str, Any]:
    import distributed  # noqa: F401  (loads distributed's config defaults)

    environ = {**dask.config.get("distributed.nanny.pre-spawn-environ"), **ONE_THREAD}
    config: dict[str, Any] = {
        "distributed.nanny.pre-spawn-environ": environ,
        # distributed's default, which tests/clusters.py turns off
        "distributed.scheduler.active-memory-manager.start": True,
    }
    if impl == "ours":
        config.update(SHARED_MODE)
    return config


RUNS = [(r, impl) for r in range(ROUNDS) for impl in ("stock", "ours")]


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize(("round_", "impl"), RUNS, ids=[f"{r}-{i}" for r, i in RUNS])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_workload(
    benchmark: Any, workload: str, round_: int, impl: str, pcp_high_fraction: int | None
) -> None:
    benchmark.group = f"{workload}, {WORKERS} workers x {WORKER_MEMORY / 2**20:.0f} MiB"
    run = WORKLOADS[workload]
    memory = WORKERS * WORKER_MEMORY
    results: list[float] = []
    with process_cluster(
        WORKERS, f"{WORKER_MEMORY}B", cluster_config(impl), silence_logs=logging.ERROR
    ) as client:
        kinds = set(client.run(lambda dask_worker: type(dask_worker.data).__name__).values())
        assert kinds == {"SharedSpillBuffer" if impl == "ours" else "SpillBuffer"}, kinds
        born = all(client.run(_born_shared).values())
        gc.collect()
        time.sleep(0.5)  # let the workers' start settle before the baseline
        settle_percpu_free()
        lo0 = loopback_sent()
        removed0 = client.run_on_scheduler(_workers_removed)
        cpu0 = worker_cpu_seconds(set(client.run(os.getpid).values()))
        threads0 = thread_runtimes(set(cpu0))
        vmstat0 = read_vmstat()
        client.run(_watch_loop)
        with PeakMeminfo() as peak, get_task_stream(client) as stream:

            def compute() -> None:
                results.append(run(client, memory, SCALE))

            benchmark.pedantic(compute, rounds=1, iterations=1)
        stalls = [s for worker in client.run(_loop_stalls).values() for s in worker]
        tasks = task_stream_figures(stream.data, WORKERS, benchmark.stats.stats.median)
        loopback = loopback_sent() - lo0
        vmstat = {name: n - vmstat0[name] for name, n in read_vmstat().items()}
        pids = client.run(os.getpid)
        cpu1 = worker_cpu_seconds(set(cpu0) | set(pids.values()))
        names = {pids[w]: n for w, n in client.run(_thread_names).items()}
        threads = thread_cpu_seconds(threads0, thread_runtimes(set(cpu1)), names)
        user, system = (
            sum(times[i] - cpu0.get(pid, (0.0, 0.0))[i] for pid, times in cpu1.items())
            for i in (0, 1)
        )
        restarts = client.run_on_scheduler(_workers_removed) - removed0
        handed = list(client.run(_handed_over).values())
        totals = {name: int(sum(h[i] for h in handed)) for i, name in enumerate(HANDED_OVER)}
    result = results[0]
    figures = {f"{name}_bytes": peak.increase(field) for field, name in FIELDS.items()}
    host = host_used(peak.peak) - host_used(peak.before)
    info: dict[str, Any] = {
        "host_peak_bytes": host,
        **figures,
        "outside_bytes": host - figures["anon_pages_bytes"] - figures["shmem_bytes"],
        "host_less_percpu_bytes": host - figures["percpu_free_bytes"],
        "loopback_bytes": loopback,
        **totals,
        **tasks,
        "worker_cpu_seconds": round(user + system, 2),
        "worker_user_seconds": round(user, 2),
        "worker_system_seconds": round(system, 2),
        "thread_cpu_seconds": threads,
        **vmstat,
        "loop_stalled_seconds": round(sum(stalls), 2),
        "loop_stalls": len(stalls),
        "loop_max_stall_ms": round(max(stalls, default=0.0) * 1000),
        "born_shared": born,
        "worker_restarts": restarts,
        "pcp_high_fraction": pcp_high_fraction,
        "result": result,
        "load_average": round(os.getloadavg()[0], 1),
    }
    if impl == "stock":
        STOCK_RESULTS.setdefault(workload, {})[round_] = result
    else:
        stock = STOCK_RESULTS.get(workload, {}).get(round_)
        info["equal_to_stock"] = same_result(workload, stock, result) if stock is not None else None
    benchmark.extra_info.update(info)
    mib = {k: v / 2**20 for k, v in info.items() if k.endswith("_bytes")}
    print(
        f"\n{workload:<23} {impl:<5} r{round_} wall {benchmark.stats.stats.median:6.1f} s"
        f"  host {mib['host_peak_bytes']:7.0f} MiB  anon {mib['anon_pages_bytes']:6.0f}"
        f"  shmem {mib['shmem_bytes']:6.0f}  ptables {mib['page_tables_bytes']:4.0f}"
        f"  slab {mib['slab_bytes']:4.0f}  mapped {mib['mapped_bytes']:5.0f}"
        f"  dirty {mib['dirty_bytes']:4.0f}  pcp {mib['percpu_free_bytes']:5.0f}"
        f"  outside {mib['outside_bytes']:5.0f}  host-pcp {mib['host_less_percpu_bytes']:6.0f}"
        f"  lo {mib['loopback_bytes']:6.0f}  link {mib['link_bytes']:6.0f}"
        f"  p2p-file {mib['p2p_file_bytes']:6.0f} MiB"
        f"  ahead {info['written_ahead']} ({info['written_ahead_unused']} unused)"
        f"  tasks {tasks['task_seconds']} s (busy {tasks['busy']})"
        f"  cpu {info['worker_cpu_seconds']} s (system {info['worker_system_seconds']} s;"
        f" by thread {' '.join(f'{g} {t}' for g, t in sorted(threads.items()))})"
        f"  faults {vmstat['page_faults']} (huge {vmstat['huge_page_faults']})"
        f"  pages allocated {vmstat['pages_allocated']}"
        f"  loop stalls {info['loop_stalls']} ({info['loop_stalled_seconds']} s,"
        f" max {info['loop_max_stall_ms']} ms)"
        f"  transfers {tasks['transfers']} (median {tasks['transfer_median_ms']} ms)"
        f"  equal {info.get('equal_to_stock', '-')}  born {born}  restarts {restarts}"
        f"  load {info['load_average']}"
        f"  pcp-fraction {pcp_high_fraction}"
    )
    if impl == "ours":
        assert info["equal_to_stock"] is not False, (workload, result, stock)
