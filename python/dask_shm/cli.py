"""dask-shm's commands: ``dask shm info``, ``dask shm clean`` and ``dask shm demo``.

dask's own CLI (``dask``) adds the click command or group of every
``dask_cli`` entry point as a subcommand, the way distributed adds ``dask
scheduler`` and ``dask worker``; ours is the group :data:`shm`. The
``dask-shm`` script and ``python -m dask_shm`` run the same group.

Importing this module registers dask-shm's config defaults
(:func:`dask_shm.config.load_defaults`): the ``dask`` CLI imports every
``dask_cli`` entry point before it runs a command, which is how ``dask config
get shm`` and ``dask config list`` see our defaults (distributed's the same
way).
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from dask_shm.clean import clean
from dask_shm.config import load_defaults
from dask_shm.demo.command import demo
from dask_shm.info.command import info

load_defaults()


@click.group(name="shm", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dask-shm")
def shm() -> None:
    """dask-shm: Rust-accelerated spilling and shared memory for Dask workers."""


shm.add_command(info)
shm.add_command(clean)
shm.add_command(demo)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``dask-shm`` script: ``dask-shm info``, ``dask-shm clean``, ``dask-shm demo``.

    Returns 0 on success; a usage error exits with code 2, and a failed demo
    (different results) or a root ``clean`` could not clean with 1, through
    SystemExit, as click does."""
    shm.main(args=list(argv) if argv is not None else None, prog_name="dask-shm")
    return 0


if __name__ == "__main__":
    main()
