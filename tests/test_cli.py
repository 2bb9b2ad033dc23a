"""The ``dask-shm`` command line, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dask_shm.cli import RunResult, format_table, main


def test_demo_runs_end_to_end_and_prints_the_comparison():
    proc = subprocess.run(
        [sys.executable, "-m", "dask_shm", "demo", "--quick", "--size", "192MiB"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "stock distributed" in out and "dask-shm" in out
    for row in ("wall time", "bytes written to spill", "time reading spill files", "result"):
        assert row in out
    result_line = next(line for line in out.splitlines() if line.startswith("result"))
    assert result_line.rstrip().endswith("same")
    spilled_line = next(line for line in out.splitlines() if line.startswith("bytes written"))
    assert "0 B " not in spilled_line  # both runs really spilled


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--size", "lots"], "not a byte size"),
        (["demo", "--workers", "0"], "must be positive"),
        (["demo", "--workers", "two"], "not an integer"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_options_give_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_chunk_larger_than_size_is_refused(capsys):
    assert main(["demo", "--size", "1MiB", "--chunk", "2MiB"]) == 2
    assert "--chunk must not exceed --size" in capsys.readouterr().err


def test_table_reports_ratios_and_flags_different_results():
    stock = RunResult("stock", 10.0, 1.0, 1000, 2.0, 1.0, 500)
    ours = RunResult("dask-shm", 5.0, 1.5, 1000, 1.0, 0.5, 500)
    table = format_table(stock, ours)
    assert "0.50" in table.splitlines()[2]  # wall time ratio
    assert "DIFFERENT" in table
