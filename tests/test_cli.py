"""The ``dask-shm demo`` command, run as a user would run it, and its parts."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dask_shm.cli import main
from dask_shm.demo import DemoConfig, RunResult, default_config, format_table
from dask_shm.demo.options import GiB, MiB
from dask_shm.demo.plot import plot_runs
from dask_shm.demo.progress import TextBar
from dask_shm.demo.sampling import WorkerSeries

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROWS = (
    "wall time",
    "host memory, peak increase",
    "worker private memory, peak",
    "shared on tmpfs, peak (all workers)",
    "spilled to disk, peak (all workers)",
    "moved between workers, TCP",
    "moved between workers, hard link",
    "result",
)


class Demo:
    def __init__(self, proc: subprocess.CompletedProcess[str], png: Path) -> None:
        self.proc = proc
        self.png = png
        self.lines = proc.stdout.splitlines()

    def row(self, name: str) -> list[str]:
        """Cells of the table row ``name``: [stock, ours, ratio]."""
        line = next(line for line in self.lines if line.startswith(name + "  "))
        return re.split(r"\s{2,}", line[len(name) :].strip())


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """``python -m dask_shm demo --quick``, end to end, once for the module."""
    png = tmp_path_factory.mktemp("demo") / "x.png"
    proc = subprocess.run(
        [sys.executable, "-m", "dask_shm", "demo", "--quick", "--output", str(png)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Demo(proc, png)


def test_demo_prints_the_side_by_side_table(demo: Demo) -> None:
    header = next(line for line in demo.lines if "ours/stock" in line)
    assert "stock distributed" in header and "dask-shm" in header
    assert header.rstrip().endswith("ours/stock (lower is better)")
    for name in ROWS:
        assert len(demo.row(name)) == 3, name
    # Ratios (ours/stock) are numbers, or "-" where stock's figure is zero.
    for name in ROWS[:-1]:
        assert re.fullmatch(r"\d+\.\d\d|-", demo.row(name)[2]), demo.row(name)
    assert re.fullmatch(r"\d+\.\d\d", demo.row("wall time")[2])
    assert re.fullmatch(r"\d+\.\d\d", demo.row("host memory, peak increase")[2])


def test_both_runs_give_the_same_result(demo: Demo) -> None:
    stock, ours, verdict = demo.row("result")
    assert verdict == "same"
    assert float(stock) == pytest.approx(float(ours), rel=1e-6)
    assert float(stock) > 0


def test_stock_moves_bytes_over_tcp_and_dask_shm_by_hard_link(demo: Demo) -> None:
    stock_tcp, _, _ = demo.row("moved between workers, TCP")
    stock_link, ours_link, ratio = demo.row("moved between workers, hard link")
    assert not stock_tcp.startswith("0 B")  # all-to-all: workers need each other's blocks
    assert stock_link == "0 B" and ratio == "-"
    assert not ours_link.startswith("0 B")


def test_tcp_figures_agree_and_shared_bytes_are_not_called_spilled(demo: Demo) -> None:
    _, ours_tcp, _ = demo.row("moved between workers, TCP")
    closing = next(line for line in demo.lines if line.startswith("dask-shm: ") and "TCP" in line)
    assert closing.endswith(f"({ours_tcp}) over TCP")
    stock_shared, ours_shared, _ = demo.row("shared on tmpfs, peak (all workers)")
    assert stock_shared == "0 B" and ours_shared != "0 B"
    assert "Both runs take roughly" in demo.lines[0]


def test_progress_is_shown_without_flooding_a_pipe(demo: Demo) -> None:
    bars = [line for line in demo.lines if "% of " in line and " tasks | " in line]
    assert any(line.startswith("stock distributed: [") for line in bars)
    assert any(line.startswith("dask-shm: [") for line in bars)
    assert any(" 100% of " in line for line in bars)
    assert "\r" not in demo.proc.stdout
    assert len(bars) <= 2 * 6  # at most one line per quarter (and 0%) per run


def test_demo_writes_a_png_plot(demo: Demo) -> None:
    from matplotlib.image import imread

    assert demo.png.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(demo.png)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert f"plot: {demo.png}" in demo.proc.stdout


def test_bad_option_exits_2_with_usage_from_the_command_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dask_shm", "demo", "--size=-1GiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("Usage: dask-shm demo")
    assert "Invalid value for '--size': must be positive" in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--size", "lots"], "Invalid value for '--size': not a byte size: 'lots'"),
        (["demo", "--size=-1GiB"], "Invalid value for '--size': must be positive"),
        (["demo", "--size", "0"], "Invalid value for '--size': must be positive"),
        (["demo", "--chunk", "1.5 fortnights"], "Invalid value for '--chunk': not a byte size"),
        (["demo", "--memory-limit", "-3"], "Invalid value for '--memory-limit': must be positive"),
        (["demo", "--memory-limit", "1MB"], "--memory-limit 0.95 MiB is too small"),
        (["demo", "--quick", "--memory-limit", "200MiB"], "use at least 256.00 MiB"),
        (["demo", "--workers", "0"], "Invalid value for '--workers'"),
        (["demo", "--workers", "two"], "'two' is not a valid integer"),
        (["demo", "--threads", "-1"], "Invalid value for '--threads'"),
        (["demo", "--size", "1MiB", "--chunk", "2MiB"], "--chunk (2.00 MiB) must not exceed"),
        (["demo", "--output", "/nonexistent-dir/x.png"], "Invalid value for --output: directory"),
        (["demo", "--frobnicate"], "No such option '--frobnicate'"),
        (["frobnicate"], "No such command 'frobnicate'"),
    ],
)
def test_bad_options_give_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: dask-shm")
    assert message in err


def test_no_command_shows_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([])
    out = capsys.readouterr()
    assert "info" in out.out + out.err and "demo" in out.out + out.err


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--size", "10TB"], "of host memory (2.5x the array in the stock run) but only"),
        (["--size", "1GiB", "--workers", "64"], "exceeds this host's RAM"),
        (["--size", "1GiB", "--chunk", "1MiB"], "row blocks, so x @ x.T has"),
    ],
)
def test_sizes_that_do_not_fit_are_refused_before_anything_runs(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "these sizes do not fit on this host" in err and reason in err
    assert "pass --force to run anyway" in err


def test_unfit_reasons_and_estimate_follow_the_sizes() -> None:
    from dask_shm.demo.options import estimated_seconds, unfit_reasons

    config = default_config(size=2 * GiB, workers=2, cores=2, total_memory=24 * GiB)
    assert unfit_reasons(config, total_memory=24 * GiB, available_memory=20 * GiB) == []
    [reason] = unfit_reasons(config, total_memory=24 * GiB, available_memory=4 * GiB)
    assert reason.startswith("--size 2.00 GiB needs about 5.00 GiB")
    # The README's default run (2 GiB, 2 workers, 2 cores): about 4 minutes.
    assert 180 <= estimated_seconds(config, cores=2) <= 270
    quick = default_config(quick=True, cores=2, total_memory=24 * GiB)
    assert estimated_seconds(quick, cores=2) < 60


def test_defaults_are_sized_from_the_machine() -> None:
    big = default_config(total_memory=64 * GiB, cores=16)
    assert (big.size, big.chunk, big.workers, big.threads) == (2 * GiB, 64 * MiB, 4, 1)
    assert big.memory_limit == 1 * GiB  # the cluster holds x twice
    small = default_config(total_memory=6 * GiB, cores=1)
    assert small.size == GiB // 2 and small.workers == 2
    assert small.memory_limit == 512 * MiB
    quick = default_config(quick=True, total_memory=64 * GiB, cores=2)
    assert quick.size < big.size and quick.chunk < big.chunk
    mine = default_config(quick=True, size=64 * MiB, workers=3, memory_limit=GiB)
    assert (mine.size, mine.workers, mine.memory_limit) == (64 * MiB, 3, GiB)


def test_config_shape_matches_the_requested_sizes() -> None:
    config = DemoConfig(size=2 * GiB, chunk=64 * MiB, workers=2, threads=1, memory_limit=4 * GiB)
    n, m = config.shape
    assert config.nbytes == pytest.approx(2 * GiB, rel=0.01)
    rows, cols = config.chunks
    assert cols == m and 8 * rows * m == pytest.approx(64 * MiB, rel=0.02)
    assert "2 worker processes x 1 thread, 4.00 GiB each" in config.describe()


def _result(label: str, ours: bool, wall: float, result: float, **kw: int) -> RunResult:
    figures = dict(
        host_peak_increase=4 * GiB,
        worker_peak_private=2 * GiB,
        spilled_peak=0,
        tcp_bytes=GiB,
        disk_spilled_peak=GiB // 2,
        link_bytes=0,
    )
    figures.update(kw)
    return RunResult(label, ours, wall, result, **figures)  # type: ignore[arg-type]


def test_table_reports_ratios_and_flags_different_results() -> None:
    stock = _result("stock distributed", False, 10.0, 1.0)
    ours = _result("dask-shm", True, 5.0, 1.0 + 1e-3, host_peak_increase=2 * GiB, tcp_bytes=0)
    ours.shared_peak, ours.disk_spilled_peak = GiB, 0
    ours.link_transfers, ours.fallback_transfers, ours.tcp_bytes = 3, 1, 4875
    lines = format_table(stock, ours).splitlines()
    assert lines[0].split() == [
        "stock",
        "distributed",
        "dask-shm",
        "ours/stock",
        "(lower",
        "is",
        "better)",
    ]
    by_name = {line.split("  ")[0]: line for line in lines[2:]}
    assert by_name["wall time"].endswith("0.50")
    assert by_name["host memory, peak increase"].endswith("0.50")
    assert by_name["moved between workers, TCP"].endswith("0.00")
    assert by_name["moved between workers, hard link"].endswith("-")
    assert by_name["result"].endswith("DIFFERENT")
    # Shared tmpfs bytes and disk spilling are separate rows.
    assert by_name["shared on tmpfs, peak (all workers)"].split()[-3:] == ["1.00", "GiB", "-"]
    assert by_name["spilled to disk, peak (all workers)"].split()[-3:] == ["0", "B", "0.00"]
    # The TCP row and the closing line give the same figure.
    assert by_name["moved between workers, TCP"].split()[-3:-1] == ["4.76", "kiB"]
    assert lines[-1].endswith("1 (4.76 kiB) over TCP")
    ours_close = _result("dask-shm", True, 5.0, 1.0 + 1e-9)
    assert format_table(stock, ours_close).splitlines()[-1].endswith("same")


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_redraws_on_a_terminal_and_writes_quarters_elsewhere(tty: bool) -> None:
    stream = _Stream(tty)
    bar = TextBar("run", stream)
    for done in range(101):
        bar.update(done, 100)
    bar.finish(100, 100)
    out = stream.getvalue()
    if tty:
        assert out.count("\r") == 102 and out.count("\n") == 1
    else:
        assert "\r" not in out
        assert [line.split("]")[1].split("%")[0].strip() for line in out.splitlines()] == [
            "0",
            "25",
            "50",
            "75",
            "100",
        ]


def test_plot_of_synthetic_runs(tmp_path: Path) -> None:
    from matplotlib.image import imread

    series = WorkerSeries([0.0, 1.0, 2.0], [0, GiB, 0], [100 * MiB] * 3, [0, 0, GiB])
    runs = [
        _result(label, ours, 2.0, 1.0)
        for label, ours in (("stock distributed", False), ("dask-shm", True))
    ]
    for run in runs:
        run.host = [(0.0, 0), (1.0, 3 * GiB), (2.0, GiB)]
        run.workers = {"0": series, "1": series}
        run.compute_start, run.compute_end = 0.5, 2.0
    path = tmp_path / "p.png"
    plot_runs(runs, path, title="synthetic")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(path).shape[2] in (3, 4)


def test_demo_without_matplotlib_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as info:
        main(["demo", "--quick"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert 'pip install "dask-shm[demo]"' in err
