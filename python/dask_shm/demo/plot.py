"""The demo's plot: for each run side by side, host memory in use over time
and, per worker, its managed / unmanaged / spilled memory over time.

Uses matplotlib's object API with the Agg canvas only: no pyplot, no GUI
backend, no global state changed in the calling process.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from typing import Any

from dask.utils import format_bytes

from dask_shm.demo.result import RunResult

COLORS = {
    "unmanaged": "#bdbdbd",
    "managed": "#4c72b0",
    "spilled": "#dd8452",
    "host": "#c44e52",
    "private": "#55a868",
}


def _unit(peak: float) -> tuple[str, float]:
    return ("GiB", 2.0**30) if peak >= 2**30 else ("MiB", 2.0**20)


def _worker_order(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def require_matplotlib() -> None:
    """Raises ImportError saying how to install matplotlib (the ``demo``
    extra) when it is missing, before any run is started."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "dask-shm demo draws its plot with matplotlib, which is not installed: "
            'pip install "dask-shm[demo]" (or pip install matplotlib)'
        ) from None


def plot_runs(runs: Sequence[RunResult], path: str | os.PathLike[str], title: str = "") -> None:
    """Write a PNG to ``path``: one column per run. The first row shows the
    host's memory in use (``MemTotal - MemAvailable``, increase over the run's
    start; shared memory counts once) and the sum of the worker processes'
    private memory (their RSS without shared pages); a gap between the two is
    shared memory or other programs. Then one row per worker with its memory
    as the scheduler saw it, stacked: unmanaged, managed (in process memory)
    and spilled (to disk for stock; to shared memory, which is host RAM, for
    dask-shm). Rows share their y scale and all plots share the time scale, so
    heights and widths compare directly. The shaded span is the computation
    (submit to result)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    names = sorted({n for r in runs for n in r.workers}, key=_worker_order)
    nrows = 1 + len(names)
    host_peak = max((v for r in runs for _, v in [*r.host, *r.workers_private]), default=0)
    worker_peak = max(
        (
            m + u + s
            for r in runs
            for w in r.workers.values()
            for m, u, s in zip(w.managed, w.unmanaged, w.spilled, strict=True)
        ),
        default=0,
    )
    host_unit, host_div = _unit(host_peak)
    worker_unit, worker_div = _unit(worker_peak)

    width = max(9.0, 6.0 * len(runs))
    fig = Figure(figsize=(width, 2.0 + 1.9 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, max(1, len(runs)), sharex=True, sharey="row", squeeze=False)
    if title:
        fig.suptitle(textwrap.fill(title, int(width * 12)), fontsize="medium")
    for col, run in enumerate(runs):
        ax = axes[0][col]
        ax.set_title(run.label)
        if run.host:
            t, v = zip(*run.host, strict=True)
            ax.plot(
                t,
                [x / host_div for x in v],
                color=COLORS["host"],
                lw=1.2,
                label="host memory used (increase)",
            )
            ax.fill_between(t, [x / host_div for x in v], color=COLORS["host"], alpha=0.15)
        if run.workers_private:
            t, v = zip(*run.workers_private, strict=True)
            ax.plot(
                t,
                [x / host_div for x in v],
                color=COLORS["private"],
                lw=0.9,
                label="worker processes' private memory (sum)",
            )
        ax.set_ylabel(f"host\n({host_unit})")
        peak = host_peak_of(run)
        ax.axhline(peak / host_div, color=COLORS["host"], lw=0.6, ls=":")
        ax.annotate(
            f"peak +{format_bytes(int(peak))}",
            xy=(0.01, 0.97),
            xycoords="axes fraction",
            va="top",
            fontsize="small",
        )
        for row, name in enumerate(names, start=1):
            ax = axes[row][col]
            series = run.workers.get(name)
            if series is not None and series.times:
                ax.stackplot(
                    series.times,
                    [x / worker_div for x in series.unmanaged],
                    [x / worker_div for x in series.managed],
                    [x / worker_div for x in series.spilled],
                    labels=["unmanaged", "managed", "spilled (dask-shm: shared)"],
                    colors=[COLORS["unmanaged"], COLORS["managed"], COLORS["spilled"]],
                    alpha=0.85,
                )
            ax.set_ylabel(f"worker {name}\n({worker_unit})")
        for r in range(nrows):
            axes[r][col].axvspan(run.compute_start, run.compute_end, color="0.92", zorder=0)
            axes[r][col].grid(True, lw=0.3)
        axes[-1][col].set_xlabel("seconds since the run started")
    # Limits only now: setting one before every column is drawn would freeze
    # the shared scale at the first column's data.
    axes[0][0].set_ylim(0, max(host_peak / host_div * 1.08, 1e-3))
    if names:
        axes[1][0].set_ylim(0, max(worker_peak / worker_div * 1.05, 1e-3))
    handles: list[Any] = []
    labels: list[str] = []
    for row in axes[: min(2, nrows)]:
        for ax in row:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                if label not in labels:
                    handles.append(handle)
                    labels.append(label)
    handles.append(Patch(color="0.92"))
    labels.append("computing")
    fig.legend(handles, labels, loc="outside lower center", ncols=(len(labels) + 1) // 2)
    fig.savefig(os.fspath(path), format="png", dpi=100)


def host_peak_of(run: RunResult) -> float:
    return max((v for _, v in run.host), default=0)
