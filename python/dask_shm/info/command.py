"""``dask shm info`` / ``dask-shm info``: options and entry point (click)."""

from __future__ import annotations

import click

HELP = """\
Report the shared-memory root, limits, config and (with --scheduler) the
workers' shared-memory plugin and bytes per tier, with a fix for each problem
found. Exit status 1 when a problem is reported, else 0.
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
    help="also ask this scheduler's workers whether the shared-memory plugin is active "
    "and how many bytes they hold in each tier",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="how long to try connecting to the scheduler",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="print the same facts and problems as one JSON object",
)
def info(root: str | None, scheduler: str | None, timeout: float, as_json: bool) -> None:
    import json

    from dask_shm.info import collect_info, format_info
    from dask_shm.info.render import as_json as json_data

    found = collect_info(root, scheduler, timeout=timeout)
    if as_json:
        click.echo(json.dumps(json_data(found), indent=2, default=str))
    else:
        click.echo(format_info(found))
    if found.problems:
        raise SystemExit(1)
