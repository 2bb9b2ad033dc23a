"""``dask shm info`` / ``dask-shm info``: options and entry point (click)."""

from __future__ import annotations

import click

HELP = """\
Report the shared-memory root, limits, config and (with --scheduler) the
workers' shared-memory plugin, with a fix for each problem found. Problems are
warnings: the exit code is 0.
"""


@click.command(
    name="info",
    help=HELP,
    short_help="Check this host (and a cluster) for shared-memory mode.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--root",
    metavar="PATH",
    default=None,
    help="shared-memory root to check [default: config shm.shared-memory.root]",
)
@click.option(
    "--scheduler",
    metavar="ADDRESS",
    default=None,
    help="also ask this scheduler's workers whether the shared-memory plugin is active",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="how long to try connecting to the scheduler",
)
def info(root: str | None, scheduler: str | None, timeout: float) -> None:
    from dask_shm.info import collect_info, format_info

    click.echo(format_info(collect_info(root, scheduler, timeout=timeout)))
