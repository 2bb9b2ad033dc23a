"""``dask shm demo`` / ``dask-shm demo``: options and entry point (click)."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import click
from dask.utils import format_bytes, format_time, parse_bytes

HELP = """\
Run (x @ x.T).sum(), x a dask array of random floats, on a local cluster of
worker processes twice: with stock distributed, then with dask-shm's
shared-memory mode. Prints wall time, memory and transfer figures side by side
(ratios are ours/stock, lower is better) and writes a plot of memory over time.

Sizes default to about RAM/12 (at most 2 GiB) for x, with memory limits that
let the cluster hold x about twice. The default run took 7.5 minutes on a
quiet 2-core machine and 34 minutes on a busy one; the estimate for the chosen sizes,
from a short calibration of this host's speed now, is printed first, and a
warning when other processes keep the host busy (then ratios are
unreliable). Sizes that do not fit in this host's memory are refused unless
--force is given. Needs matplotlib for the plot: pip install "dask-shm[demo]".
"""


class ByteSize(click.ParamType):
    """A byte size such as ``256MiB`` or ``1e9``, > 0."""

    name = "bytes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            parsed = value
        else:
            try:
                parsed = int(parse_bytes(value))
            except (ValueError, TypeError):
                self.fail(f"not a byte size: {value!r} (try e.g. 256MiB)", param, ctx)
        if parsed <= 0:
            self.fail(f"must be positive: {value!r}", param, ctx)
        return parsed


BYTES = ByteSize()
POSITIVE = click.IntRange(min=1)


@click.command(
    name="demo",
    help=HELP,
    short_help="All-to-all array workload: stock distributed vs dask-shm shared memory.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option("--size", type=BYTES, help="bytes of x [default: min(2GiB, RAM/12); --quick 256MiB]")
@click.option(
    "--chunk", type=BYTES, help="bytes per row block of x [default: 64MiB; --quick 16MiB]"
)
@click.option("--workers", type=POSITIVE, help="worker processes [default: max(2, min(4, cores))]")
@click.option("--threads", type=POSITIVE, help="threads per worker [default: 1]")
@click.option(
    "--memory-limit",
    type=BYTES,
    help="memory limit per worker [default: the cluster holds x about twice, >= 512MiB]",
)
@click.option(
    "--output",
    default="dask-shm-demo.png",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="PNG file for the plot",
)
@click.option("--quick", is_flag=True, help="small sizes: both runs in under a minute")
@click.option(
    "--force", is_flag=True, help="run even if the sizes do not fit in this host's memory"
)
def demo(
    size: int | None,
    chunk: int | None,
    workers: int | None,
    threads: int | None,
    memory_limit: int | None,
    output: str,
    quick: bool,
    force: bool,
) -> None:
    """Exit code 0 when both runs give the same result, 1 otherwise, 2 for a
    usage error (bad option, sizes that do not fit without ``--force``)."""
    import psutil

    from dask_shm.demo.options import (
        check_memory_limit,
        default_config,
        estimated_seconds,
        unfit_reasons,
    )

    try:
        config = default_config(
            quick=quick,
            size=size,
            chunk=chunk,
            workers=workers,
            threads=threads,
            memory_limit=memory_limit,
            output=output,
        )
        check_memory_limit(config)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    directory = os.path.dirname(os.path.abspath(config.output))
    if not os.path.isdir(directory):
        raise click.BadParameter(f"directory {directory!r} does not exist", param_hint="--output")
    if not os.access(directory, os.W_OK):
        raise click.BadParameter(f"directory {directory!r} is not writable", param_hint="--output")
    memory = psutil.virtual_memory()
    reasons = unfit_reasons(config, total_memory=memory.total, available_memory=memory.available)
    if reasons and not force:
        raise click.UsageError(
            "these sizes do not fit on this host:\n  - "
            + "\n  - ".join(reasons)
            + "\nchoose smaller sizes, or pass --force to run anyway"
        )
    for reason in reasons:
        click.echo(f"dask-shm demo: warning (--force): {reason}", err=True)
    try:
        from dask_shm.demo.plot import require_matplotlib

        require_matplotlib()
    except ImportError as e:
        raise click.ClickException(str(e)) from None

    from dask_shm.demo import calibration
    from dask_shm.demo.busy import busy_warning, read_cpu_load
    from dask_shm.demo.runner import run_demo
    from dask_shm.demo.table import results_match

    warning = busy_warning([read_cpu_load(interval=1.0)], psutil.cpu_count() or 1)
    if warning:
        click.echo(
            f"dask-shm demo: warning: {warning.replace('while the demo ran', 'now')}", err=True
        )
    try:
        estimate = calibration.estimated_seconds(config, calibration.measure(config))
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError):
        estimate = estimated_seconds(config)  # the dev machine's figures
    click.echo(
        f"Both runs take roughly {format_time(estimate)} "
        f"(x is {format_bytes(config.nbytes)}; --quick for a short run).",
    )
    stock, ours = run_demo(config)
    if not results_match(stock.result, ours.result):
        raise SystemExit(1)
