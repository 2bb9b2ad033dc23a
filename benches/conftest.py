"""Prints, after a benchmark run, the ratio ours/stock for every benchmark group
whose tests are parametrized with ``impl`` in {"stock", "ours"} (plus variants
such as "ours-mmap"). Ratios use the median; for time, < 1.0 means ours is faster.
If a benchmark sets ``extra_info["bytes"]``, its bandwidth is shown too.

Memory figures a benchmark records in ``extra_info`` under a key ending in
``_bytes`` (e.g. ``host_peak_increase_bytes``) are printed in a second table,
stock's and ours side by side with their ratio (< 1.0 means ours uses less)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def _groups(session: Any) -> dict[str, dict[str, Any]]:
    """label -> impl -> benchmark, for benchmarks parametrized with ``impl``."""
    by_group: dict[str, dict[str, Any]] = defaultdict(dict)
    for bench in session.benchmarks:
        impl = (bench.params or {}).get("impl")
        if impl is None or not bench.stats:
            continue
        label = bench.group or bench.name.split("[")[0]
        others = {k: v for k, v in (bench.params or {}).items() if k != "impl"}
        if others:
            label += " " + ",".join(f"{k}={v}" for k, v in sorted(others.items()))
        by_group[label][impl] = bench
    return by_group


def _rows(session: Any) -> list[tuple[str, str, float, float | None]]:
    by_group = _groups(session)
    rows = []
    for label, impls in sorted(by_group.items()):
        stock = impls.get("stock")
        for impl, bench in sorted(impls.items()):
            if impl == "stock":
                continue
            median = bench.stats.median
            ratio = median / stock.stats.median if stock else float("nan")
            nbytes = bench.extra_info.get("bytes")
            gbps = nbytes / median / 1e9 if nbytes else None
            rows.append((label, impl, ratio, gbps))
            if stock is not None and nbytes:
                rows.append((label, "stock", 1.0, nbytes / stock.stats.median / 1e9))
    return rows


def _memory_rows(session: Any) -> list[tuple[str, str, str, int | None, int, float | None]]:
    """(group label, figure, impl, stock's value, this impl's value, ratio) for
    every ``*_bytes`` figure in ``extra_info`` of a non-stock impl."""
    rows = []
    for label, impls in sorted(_groups(session).items()):
        stock = impls.get("stock")
        stock_info = stock.extra_info if stock is not None else {}
        for impl, bench in sorted(impls.items()):
            if impl == "stock":
                continue
            for key, value in sorted(bench.extra_info.items()):
                if not key.endswith("_bytes") or not isinstance(value, int | float):
                    continue
                base = stock_info.get(key)
                if not isinstance(base, int | float):
                    base = None
                ratio = value / base if base else None
                rows.append((label, key[: -len("_bytes")], impl, base, int(value), ratio))
    return rows


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MiB"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    session = getattr(terminalreporter.config, "_benchmarksession", None)
    if session is None:
        return
    rows = _rows(session)
    if rows:
        terminalreporter.write_sep("=", "dask-shm: ours / stock (median time; < 1.0 is faster)")
    for label, impl, ratio, gbps in rows:
        speed = f"  {gbps:6.2f} GB/s" if gbps is not None else ""
        note = f"  ({1 / ratio:5.1f}x faster)" if impl != "stock" and ratio < 1 else ""
        terminalreporter.write_line(f"{label:<45} {impl:<12} {ratio:8.3f}{speed}{note}")
    memory = _memory_rows(session)
    if memory:
        terminalreporter.write_sep(
            "=", "dask-shm: memory figures (extra_info), stock vs ours; < 1.0 uses less"
        )
    for label, figure, impl, base, value, ratio in memory:
        shown = f"{ratio:8.3f}" if ratio is not None else "       -"
        terminalreporter.write_line(
            f"{label:<45} {figure:<26} stock {_mib(base):>11}  {impl:<9} {_mib(value):>11}  {shown}"
        )
