"""The demo's pure parts: the estimate from a calibration, busy-host detection
from injected load readings, and the table and plot drawn from one source of
private memory, with tier 3 apart from tier 2 and the memory limit. The full
demo is slow and runs in test_cli.py only."""

from __future__ import annotations

from pathlib import Path

import pytest

from dask_shm.demo import calibration
from dask_shm.demo.busy import BUSY_CORES, busy_warning
from dask_shm.demo.options import default_config
from dask_shm.demo.plot import plot_runs, worker_panels
from dask_shm.demo.result import RunResult, peak_private, private_sum
from dask_shm.demo.sampling import WorkerSeries
from dask_shm.demo.table import format_table

GiB = 2**30
MiB = 2**20


def test_estimate_scales_the_workloads_flops_by_the_calibrated_rate() -> None:
    config = default_config(size=GiB, workers=2, cores=2, total_memory=24 * GiB)
    n, m = config.shape
    assert calibration.workload_flops(config) == 2.0 * n * n * m
    fast = calibration.Calibration(flops_per_second=20e9, parallel=2)
    compute = calibration.OVERHEAD * calibration.workload_flops(config) / 40e9
    assert calibration.estimated_seconds(config, fast) == pytest.approx(
        2 * (calibration.STARTUP_SECONDS + compute)
    )
    # A host half as fast now (e.g. busy) gives about twice the compute time.
    slow = calibration.Calibration(flops_per_second=10e9, parallel=2)
    assert calibration.estimated_seconds(config, slow) == pytest.approx(
        2 * (calibration.STARTUP_SECONDS + 2 * compute)
    )
    # Eight times the bytes: (2**3)**1.5 = 22.6 times the flops.
    big = default_config(size=8 * GiB, workers=2, cores=2, total_memory=240 * GiB)
    ratio = calibration.workload_flops(big) / calibration.workload_flops(config)
    assert ratio == pytest.approx(8**1.5, rel=0.01)


def test_calibration_measures_this_host_in_the_demos_block_shape() -> None:
    config = default_config(quick=True, workers=2, cores=2, total_memory=24 * GiB)
    found = calibration.measure(config, seconds=0.2)
    assert found.parallel == 2
    assert 1e7 < found.flops_per_second < 1e13  # any real CPU, busy or not
    assert calibration.estimated_seconds(config, found) > 2 * calibration.STARTUP_SECONDS


@pytest.mark.parametrize(
    "readings, busy",
    [
        ([], False),
        ([0.0, 0.1, 0.05], False),
        ([BUSY_CORES, BUSY_CORES], False),
        ([1.8, 1.9, 0.0], True),  # the median counts, not one quiet moment
        ([0.0, 0.0, 1.9], False),  # nor one spike
    ],
)
def test_busy_host_is_judged_from_other_processes_load(readings: list[float], busy: bool) -> None:
    warning = busy_warning(readings, cores=2)
    assert (warning is not None) == busy
    if busy:
        assert warning is not None
        assert "1.8 of 2 cores" in warning and "unreliable" in warning


def _run(label: str, ours: bool, private: dict[str, list[tuple[float, int]]]) -> RunResult:
    shared = [0, 0, 0] if not ours else [0, GiB // 2, 0]
    series = WorkerSeries([0.0, 1.0, 2.0], [0, GiB, 0], [100 * MiB] * 3, [0, GiB, 0], shared=shared)
    return RunResult(
        label,
        ours,
        2.0,
        1.0,
        host_peak_increase=4 * GiB,
        worker_peak_private=peak_private(private),
        spilled_peak=GiB,
        tcp_bytes=GiB,
        link_bytes=0,
        shared_peak=max(shared),
        disk_spilled_peak=GiB - max(shared),
        host=[(0.0, 0), (1.0, 3 * GiB), (2.0, GiB)],
        workers_private=private_sum(private),
        workers={"0": series, "1": series},
        compute_start=0.5,
        compute_end=2.0,
        private_by_worker=private,
        memory_limit=2 * GiB,
        other_cpu_cores=[0.0, 0.0],
    )


def test_table_and_plot_take_private_memory_from_one_source(tmp_path: Path) -> None:
    private = {
        "0": [(0.0, 100 * MiB), (1.0, 700 * MiB), (2.0, 200 * MiB)],
        "1": [(0.0, 100 * MiB), (1.0, 300 * MiB), (2.0, 900 * MiB)],
    }
    stock, ours = _run("stock distributed", False, private), _run("dask-shm", True, private)
    panels = worker_panels(ours)
    assert max(p.peak_private for p in panels.values()) == 900 * MiB
    row = next(r for r in format_table(stock, ours).splitlines() if r.startswith("worker private"))
    assert row.split()[-5:-3] == ["900.00", "MiB"]
    # The host row's sum comes from the same samples.
    assert ours.workers_private == [(0.0, 200 * MiB), (1.0, 1000 * MiB), (2.0, 1100 * MiB)]

    # Tier 3 (disk) apart from tier 2 (shared memory), and the memory limit.
    assert panels["0"].shared == [0, GiB // 2, 0]
    assert panels["0"].on_disk == [0, GiB // 2, 0]
    assert worker_panels(stock)["0"].on_disk == [0, GiB, 0]
    assert panels["0"].memory_limit == 2 * GiB
    path = tmp_path / "demo.png"
    plot_runs([stock, ours], path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_table_warns_when_the_host_was_busy_during_the_runs() -> None:
    private = {"0": [(0.0, MiB)]}
    stock, ours = _run("stock distributed", False, private), _run("dask-shm", True, private)
    assert "WARNING" not in format_table(stock, ours)
    stock.other_cpu_cores = ours.other_cpu_cores = [1.5, 1.6, 1.4]
    last = format_table(stock, ours).splitlines()[-1]
    assert last.startswith("WARNING: the host is busy: other processes used 1.5 of ")
    assert "ratios are unreliable" in last
