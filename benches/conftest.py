"""Prints, after a benchmark run, the ratio ours/stock for every benchmark group
whose tests are parametrized with ``impl`` in {"stock", "ours"} (plus variants
such as "ours-mmap"). Ratios use the median; for time, < 1.0 means ours is faster.
If a benchmark sets ``extra_info["bytes"]``, its bandwidth is shown too."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def _rows(session: Any) -> list[tuple[str, str, float, float | None]]:
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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    session = getattr(terminalreporter.config, "_benchmarksession", None)
    if session is None:
        return
    rows = _rows(session)
    if not rows:
        return
    terminalreporter.write_sep("=", "dask-shm: ours / stock (median time; < 1.0 is faster)")
    for label, impl, ratio, gbps in rows:
        speed = f"  {gbps:6.2f} GB/s" if gbps is not None else ""
        note = f"  ({1 / ratio:5.1f}x faster)" if impl != "stock" and ratio < 1 else ""
        terminalreporter.write_line(f"{label:<45} {impl:<12} {ratio:8.3f}{speed}{note}")
