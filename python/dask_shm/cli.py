"""``dask-shm`` command line (also ``python -m dask_shm``).

``dask-shm demo`` runs one spilling workload on a LocalCluster of worker
processes twice, once with stock distributed's SpillBuffer and once with
dask-shm's, and prints the two side by side.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
from dask.utils import format_bytes, parse_bytes
from distributed import Client, LocalCluster, Worker, wait

import dask_shm


@dataclass
class RunResult:
    label: str
    wall_seconds: float
    result: float
    spilled_bytes: int
    disk_write_seconds: float
    disk_read_seconds: float
    disk_read_bytes: int


def _spill_stats(dask_worker: Worker) -> dict[str, float]:
    data = dask_worker.data
    metrics = getattr(data, "cumulative_metrics", {})
    return {
        "spilled": float(getattr(data, "spilled_total", (0, 0))[1]),
        "disk_write_seconds": metrics.get(("disk-write", "seconds"), 0.0),
        "disk_write_bytes": metrics.get(("disk-write", "bytes"), 0.0),
        "disk_read_seconds": metrics.get(("disk-read", "seconds"), 0.0),
        "disk_read_bytes": metrics.get(("disk-read", "bytes"), 0.0),
    }


def run_spilling_workload(
    label: str, *, ours: bool, size: int, chunk: int, workers: int, memory_limit: int
) -> RunResult:
    """Persist a random array larger than the cluster's spill targets, then
    reduce it twice (the second pass reads spilled chunks back)."""
    side = int((size / 8) ** 0.5)
    chunk_side = max(1, int((chunk / 8) ** 0.5))
    x = da.random.default_rng(0).random((side, side), chunks=(chunk_side, chunk_side))
    extra = {"data": dask_shm.worker_data(memory_limit)} if ours else {}
    config = {
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            memory_limit=memory_limit,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
            **extra,
        ) as cluster,
        Client(cluster) as client,
    ):
        start = time.perf_counter()
        y = (x + 1).persist()
        wait(y)
        total = float(y.sum().compute() + (y * 2).mean().compute())
        wall = time.perf_counter() - start
        stats = client.run(_spill_stats).values()
    return RunResult(
        label=label,
        wall_seconds=wall,
        result=total,
        spilled_bytes=int(sum(s["disk_write_bytes"] for s in stats)),
        disk_write_seconds=sum(s["disk_write_seconds"] for s in stats),
        disk_read_seconds=sum(s["disk_read_seconds"] for s in stats),
        disk_read_bytes=int(sum(s["disk_read_bytes"] for s in stats)),
    )


def format_table(stock: RunResult, ours: RunResult) -> str:
    """Side-by-side table of two runs with the ratio ours/stock per row."""

    def seconds(v: float) -> str:
        return f"{v:.3f} s"

    measures: list[tuple[str, str, Callable[[Any], str]]] = [
        ("wall time", "wall_seconds", seconds),
        ("bytes written to spill", "spilled_bytes", format_bytes),
        ("time writing spill files", "disk_write_seconds", seconds),
        ("bytes read back", "disk_read_bytes", format_bytes),
        ("time reading spill files", "disk_read_seconds", seconds),
    ]
    rows = []
    for label, field, fmt in measures:
        a, b = getattr(stock, field), getattr(ours, field)
        rows.append((label, fmt(a), fmt(b), f"{b / a:.2f}" if a else "-"))
    same = abs(stock.result - ours.result) <= 1e-9 * abs(stock.result)
    rows.append(
        ("result", f"{stock.result:.6g}", f"{ours.result:.6g}", "same" if same else "DIFFERENT")
    )
    header = ("", "stock distributed", "dask-shm", "ours/stock")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    lines = [header, tuple("-" * w for w in widths), *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def _positive_bytes(text: str) -> int:
    try:
        value = parse_bytes(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try e.g. 256MiB)") from e
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from e
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dask-shm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="spilling workload: stock distributed vs dask-shm")
    demo.add_argument(
        "--size",
        type=_positive_bytes,
        default=None,
        help="array size (default 1GiB, 384MiB with --quick)",
    )
    demo.add_argument(
        "--chunk",
        type=_positive_bytes,
        default=None,
        help="chunk size (default 16MiB, 4MiB with --quick)",
    )
    demo.add_argument("--workers", type=_positive_int, default=2)
    demo.add_argument(
        "--memory-limit",
        type=_positive_bytes,
        default=None,
        help="per worker (default: a third of --size)",
    )
    demo.add_argument("--quick", action="store_true", help="small sizes; under a minute")
    return parser


def demo(args: argparse.Namespace) -> int:
    size = args.size or (384 * 2**20 if args.quick else 2**30)
    chunk = args.chunk or (4 * 2**20 if args.quick else 16 * 2**20)
    memory_limit = args.memory_limit or max(128 * 2**20, size // 3)
    if chunk > size:
        print("dask-shm demo: error: --chunk must not exceed --size", file=sys.stderr)
        return 2
    print(
        f"dask-shm {dask_shm.__version__}: {format_bytes(size)} array in "
        f"{format_bytes(chunk)} chunks on {args.workers} worker processes with "
        f"{format_bytes(memory_limit)} each (spills at 60%)"
    )
    params = dict(size=size, chunk=chunk, workers=args.workers, memory_limit=memory_limit)
    results = []
    for label, ours in (("stock", False), ("dask-shm", True)):
        print(f"running with {label} SpillBuffer ...", flush=True)
        results.append(run_spilling_workload(label, ours=ours, **params))
    print()
    print(format_table(*results))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return demo(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
