"""``dask-shm demo`` command-line options and entry point."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dask.utils import format_bytes, parse_bytes

DESCRIPTION = """\
Runs (x @ x.T).sum(), x a dask array of random floats, on a local cluster of
worker processes twice: with stock distributed, then with dask-shm's
shared-memory mode. Prints wall time, memory and transfer figures side by side
and writes a plot of memory over time. Sizes default to about RAM/12 (at most
2 GiB) for x, with memory limits that let the cluster hold x about twice."""


def positive_bytes(text: str) -> int:
    """argparse type: a byte size such as ``256MiB`` or ``1e9``, > 0."""
    try:
        value = parse_bytes(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try e.g. 256MiB)") from e
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from e
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def add_demo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``subparsers`` (from
    ``ArgumentParser.add_subparsers``) and return its parser."""
    demo = subparsers.add_parser(
        "demo",
        help="all-to-all array workload: stock distributed vs dask-shm shared memory",
        description=DESCRIPTION,
    )
    demo.add_argument(
        "--size", type=positive_bytes, help="bytes of x (default min(2GiB, RAM/12); --quick 256MiB)"
    )
    demo.add_argument(
        "--chunk",
        type=positive_bytes,
        help="bytes per row block of x (default 64MiB; --quick 16MiB)",
    )
    demo.add_argument(
        "--workers", type=positive_int, help="worker processes (default max(2, min(4, cores)))"
    )
    demo.add_argument("--threads", type=positive_int, help="threads per worker (default 1)")
    demo.add_argument(
        "--memory-limit",
        type=positive_bytes,
        help="memory limit per worker (default: the cluster holds x about twice, >= 512MiB)",
    )
    demo.add_argument(
        "--output",
        default="dask-shm-demo.png",
        help="PNG file for the plot (default ./dask-shm-demo.png)",
    )
    demo.add_argument(
        "--quick", action="store_true", help="small sizes: both runs in under a minute"
    )
    demo.set_defaults(demo_parser=demo)
    return demo


def run_demo_command(args: argparse.Namespace) -> int:
    """Run the demo as the parsed ``args`` ask; inconsistent options give the
    subcommand's usage error (exit code 2)."""
    from dask_shm.demo.options import default_config
    from dask_shm.demo.runner import run_demo
    from dask_shm.demo.table import results_match

    parser: argparse.ArgumentParser = args.demo_parser
    try:
        config = default_config(
            quick=args.quick,
            size=args.size,
            chunk=args.chunk,
            workers=args.workers,
            threads=args.threads,
            memory_limit=args.memory_limit,
            output=args.output,
        )
    except ValueError as e:
        parser.error(str(e))
    directory = os.path.dirname(os.path.abspath(config.output))
    if not os.path.isdir(directory):
        parser.error(f"--output: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        parser.error(f"--output: directory {directory!r} is not writable")
    import psutil

    ram = psutil.virtual_memory().total
    if config.workers * config.memory_limit > ram:
        print(
            f"dask-shm demo: warning: {config.workers} workers x "
            f"{format_bytes(config.memory_limit)} exceed this host's RAM "
            f"({format_bytes(ram)}); workers are never paused nor restarted in the demo",
            file=sys.stderr,
        )
    stock, ours = run_demo(config)
    return 0 if results_match(stock.result, ours.result) else 1
