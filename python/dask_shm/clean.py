"""``dask shm clean`` / ``dask-shm clean``: remove what dead processes left.

A worker killed with SIGKILL (or a whole cluster) cannot remove its files; a
worker or nanny starting on the same roots removes them, and this command does
it by hand. Only this user's directories of processes that are gone (their
lock is free) are removed; a live process's directory is never touched.
"""

from __future__ import annotations

import os

import click
from dask.utils import format_bytes

from dask_shm.config import SharedMemorySettings
from dask_shm.shared import paths
from dask_shm.shared.tiers import tiers_of

HELP = """\
Remove this user's files of dead dask-shm processes (a killed worker or
cluster) from the shared-memory root and the disk root of the config, or from
each --root PATH given, and print what was freed. Live processes' files are
never touched. Exit code 0 when every root could be cleaned (also when there
was nothing to remove), 1 when one could not (a --root that is not a
directory, another user's directory in it).
"""


@click.command(
    name="clean",
    help=HELP,
    short_help="Remove files left by killed dask-shm processes.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--root",
    "roots",
    metavar="PATH",
    multiple=True,
    help="a root to clean; may be repeated "
    "[default: shm.shared-memory.root and shm.shared-memory.disk-root]",
)
def clean(roots: tuple[str, ...]) -> None:
    if roots:
        targets = list(roots)
    else:
        try:
            settings = SharedMemorySettings.from_config()
        except ValueError as e:
            raise click.ClickException(f"invalid configuration: {e}") from e
        targets = [t.root for t in tiers_of(settings)]
    failed = False
    total = 0
    for root in targets:
        if roots and not os.path.isdir(root):
            click.echo(f"{root}: cannot clean: not a directory", err=True)
            failed = True
            continue
        try:
            done = paths.reclaim(root)
        except (OSError, paths.UnusableRoot) as e:
            click.echo(f"{root}: cannot clean: {e}", err=True)
            failed = True
            continue
        for directory in done.directories:
            click.echo(f"removed {directory}")
        click.echo(
            f"{root}: {len(done.directories)} directories of dead processes removed, "
            f"{format_bytes(done.bytes)} freed"
        )
        total += done.bytes
    click.echo(f"freed {format_bytes(total)} in total")
    if failed:
        raise SystemExit(1)
