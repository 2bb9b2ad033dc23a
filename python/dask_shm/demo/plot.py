"""The demo's plot: for each run side by side, host memory in use over time
and, per worker, its managed / unmanaged / spilled memory over time.

Uses matplotlib's object API with the Agg canvas only: no pyplot, no GUI
backend, no global state changed in the calling process.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dask.utils import format_bytes

from dask_shm.demo.result import RunResult
from dask_shm.demo.sampling import WorkerSeries

COLORS = {
    "unmanaged": "#bdbdbd",
    "managed": "#4c72b0",
    "tier2": "#dd8452",
    "disk": "#8c564b",
    "host": "#c44e52",
    "private": "#55a868",
    "limit": "#000000",
}


@dataclass
class WorkerPanel:
    """What one worker's plot shows (bytes): the scheduler's stacked view
    (unmanaged, managed, spilled to shared memory = tier 2, spilled to disk =
    stock's spill or dask-shm's tier 3), its process's private memory (the
    table's source too) and its memory limit (0: none)."""

    times: list[float]
    unmanaged: list[int]
    managed: list[int]
    shared: list[int]
    on_disk: list[int]
    private: list[tuple[float, int]]
    memory_limit: int

    @property
    def peak_private(self) -> int:
        return max((v for _, v in self.private), default=0)


def worker_panels(run: RunResult) -> dict[str, WorkerPanel]:
    """Per worker name, the data of its plot (pure: no matplotlib)."""
    names = sorted({*run.workers, *run.private_by_worker}, key=_worker_order)
    panels = {}
    for name in names:
        series = run.workers.get(name) or WorkerSeries()
        shared = series.shared or [0] * len(series.spilled)
        panels[name] = WorkerPanel(
            times=list(series.times),
            unmanaged=list(series.unmanaged),
            managed=list(series.managed),
            shared=list(shared),
            on_disk=[s - t for s, t in zip(series.spilled, shared, strict=True)],
            private=list(run.private_by_worker.get(name, [])),
            memory_limit=run.memory_limit,
        )
    return panels


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
    shared memory or other programs. Then one row per worker
    (:func:`worker_panels`) with its memory as the scheduler saw it, stacked:
    unmanaged, managed (in process memory), spilled to shared memory (tier 2,
    host RAM) and spilled to disk (stock's spill, dask-shm's tier 3), its
    process's private memory (the table's source) as a line and its memory
    limit as a dashed line. Rows share their y scale and all plots share the time scale, so
    heights and widths compare directly. The shaded span is the computation
    (submit to result)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [worker_panels(r) for r in runs]
    names = sorted({n for p in panels for n in p}, key=_worker_order)
    nrows = 1 + len(names)
    host_peak = max((v for r in runs for _, v in [*r.host, *r.workers_private]), default=0)
    worker_peak = max(
        [
            *(
                u + m + t + d
                for p in panels
                for w in p.values()
                for u, m, t, d in zip(w.unmanaged, w.managed, w.shared, w.on_disk, strict=True)
            ),
            *(w.peak_private for p in panels for w in p.values()),
            *(w.memory_limit for p in panels for w in p.values()),
        ],
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
            f"peak +{format_bytes(int(peak))}; a worker's private memory peaked at "
            f"{format_bytes(run.worker_peak_private)}",
            xy=(0.01, 0.97),
            xycoords="axes fraction",
            va="top",
            fontsize="small",
        )
        for row, name in enumerate(names, start=1):
            ax = axes[row][col]
            panel = panels[col].get(name)
            if panel is not None and panel.times:
                ax.stackplot(
                    panel.times,
                    [x / worker_div for x in panel.unmanaged],
                    [x / worker_div for x in panel.managed],
                    [x / worker_div for x in panel.shared],
                    [x / worker_div for x in panel.on_disk],
                    labels=[
                        "unmanaged",
                        "managed",
                        "spilled to shared memory (tier 2, RAM)",
                        "spilled to disk (stock; dask-shm tier 3)",
                    ],
                    colors=[
                        COLORS["unmanaged"],
                        COLORS["managed"],
                        COLORS["tier2"],
                        COLORS["disk"],
                    ],
                    alpha=0.85,
                )
            if panel is not None and panel.private:
                t, v = zip(*panel.private, strict=True)
                ax.plot(
                    t,
                    [x / worker_div for x in v],
                    color=COLORS["private"],
                    lw=0.9,
                    label="process private memory (as in the table)",
                )
            if panel is not None and panel.memory_limit:
                ax.axhline(
                    panel.memory_limit / worker_div,
                    color=COLORS["limit"],
                    lw=0.8,
                    ls="--",
                    label="memory limit",
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
    for row in axes:
        for ax in row:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                if label not in labels:
                    handles.append(handle)
                    labels.append(label)
    handles.append(Patch(color="0.92"))
    labels.append("computing")
    fig.legend(handles, labels, loc="outside lower center", ncols=3)
    fig.savefig(os.fspath(path), format="png", dpi=100)


def host_peak_of(run: RunResult) -> float:
    return max((v for _, v in run.host), default=0)
