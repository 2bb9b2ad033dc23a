"""The demo's side-by-side table: stock, dask-shm, and ours/stock."""

from __future__ import annotations

import math
from collections.abc import Callable

from dask.system import CPU_COUNT
from dask.utils import format_bytes

from dask_shm.demo.busy import busy_warning
from dask_shm.demo.result import RunResult

#: Relative tolerance within which the two runs' results count as the same.
RTOL = 1e-6


def results_match(a: float, b: float, rtol: float = RTOL) -> bool:
    """Whether two results agree to ``rtol`` (NaN never matches)."""
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def _seconds(v: float) -> str:
    return f"{v:.1f} s" if v >= 10 else f"{v:.2f} s"


def _bytes(v: float) -> str:
    return format_bytes(int(v))


#: (row name, RunResult attribute, formatter)
ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("wall time", "wall_seconds", _seconds),
    ("host memory, peak increase", "host_peak_increase", _bytes),
    ("worker private memory, peak", "worker_peak_private", _bytes),
    ("shared on tmpfs, peak (all workers)", "shared_peak", _bytes),
    ("spilled to disk, peak (all workers)", "disk_spilled_peak", _bytes),
    ("moved between workers, TCP", "tcp_bytes", _bytes),
    ("moved between workers, hard link", "link_bytes", _bytes),
]


def _ratio(stock: float, ours: float) -> str:
    if stock == 0:
        return "-"
    return f"{ours / stock:.2f}"


#: Heading of the ratio column: which way round, and which way is good.
RATIO_HEADING = "ours/stock (lower is better)"


def format_table(stock: RunResult, ours: RunResult) -> str:
    """Rows of measurements with stock, ours and the ratio ours/stock (lower
    is better for every row, "-" where stock's figure is 0); the result row
    says "same" or "DIFFERENT". The TCP row and the closing line about
    transfers give the same TCP figure. A closing warning says when other
    processes kept the host busy during the runs (:func:`busy_warning` of
    both runs' readings): then the ratios are unreliable."""
    header = ("", stock.label, ours.label, RATIO_HEADING)
    rows = [header]
    for name, attr, fmt in ROWS:
        a, b = getattr(stock, attr), getattr(ours, attr)
        rows.append((name, fmt(a), fmt(b), _ratio(a, b)))
    same = results_match(stock.result, ours.result)
    rows.append(
        ("result", f"{stock.result:.9g}", f"{ours.result:.9g}", "same" if same else "DIFFERENT")
    )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [rows[0], tuple("-" * w for w in widths), *rows[1:]]
    text = "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in lines
    )
    if ours.link_transfers or ours.fallback_transfers:
        text += (
            f"\n\n{ours.label}: {ours.link_transfers:,} keys "
            f"({format_bytes(ours.link_bytes)}) sent by hard link, "
            f"{ours.fallback_transfers:,} ({format_bytes(ours.tcp_bytes)}) over TCP"
        )
    warning = busy_warning([*stock.other_cpu_cores, *ours.other_cpu_cores], CPU_COUNT)
    if warning:
        text += f"\n\nWARNING: {warning}"
    return text
