"""``dask-shm`` command line (also ``python -m dask_shm``).

``dask-shm demo`` runs an all-to-all array workload on a LocalCluster of worker
processes twice, with stock distributed and with dask-shm's shared-memory
mode, and prints the two side by side (see :mod:`dask_shm.demo`).
``dask-shm info`` reports whether this host is ready for shared-memory mode.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dask_shm.demo.command import add_demo_parser, run_demo_command
from dask_shm.info import add_info_parser, collect_info, format_info


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dask-shm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_info_parser(sub)
    add_demo_parser(sub)
    return parser


def _run_info(args: argparse.Namespace) -> int:
    """``dask-shm info``: print the report; problems are warnings, so exit 0."""
    print(format_info(collect_info(args.root, args.scheduler, timeout=args.timeout)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return _run_info(args)
    if args.command == "demo":
        return run_demo_command(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
