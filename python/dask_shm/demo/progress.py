"""Progress of a computation on a LocalCluster, as a one-line text bar.

Counts every task the given futures depend on with distributed's own
``Progress`` scheduler plugin, installed directly on the in-process scheduler
of a LocalCluster (no comm to open or to leave behind), and draws the bar from
the calling thread: on a terminal it redraws one line in place; on a pipe or a
file it writes a line only at each quarter, so logs and CI output stay short.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from dask.utils import format_time
from distributed import Future
from distributed.diagnostics.progress import Progress
from distributed.utils import sync
from tornado.ioloop import IOLoop

if TYPE_CHECKING:
    from distributed import Scheduler


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class TextBar:
    """Draws ``label: [#####     ]  50% of 614 tasks | 3.1 s`` on ``stream``."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.tty = _isatty(self.stream)
        self.start = time.monotonic()
        self._last_quarter = -1
        self._last_len = 0

    def text(self, done: int, total: int) -> str:
        frac = done / total if total else 1.0
        bar = "#" * int(self.width * frac)
        return (
            f"{self.label}: [{bar:<{self.width}}] {int(100 * frac):3d}% of {total} tasks"
            f" | {format_time(time.monotonic() - self.start)}"
        )

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except ValueError:  # stream closed meanwhile
            pass

    def update(self, done: int, total: int) -> None:
        """Redraw in place on a terminal; elsewhere, one line per quarter."""
        text = self.text(done, total)
        if self.tty:
            self._write("\r" + text + " " * max(0, self._last_len - len(text)))
            self._last_len = len(text)
            return
        quarter = int(4 * done / total) if total else 4
        if quarter > self._last_quarter:
            self._last_quarter = quarter
            self._write(text + "\n")

    def finish(self, done: int, total: int, status: str = "finished") -> None:
        """Last state of the bar, with ``status`` if it is not "finished"."""
        suffix = "" if status == "finished" else f" ({status})"
        if self.tty:
            self._write("\r" + self.text(done, total) + suffix + "\n")
            return
        if suffix or self._last_quarter < 4:
            self._write(self.text(done, total) + suffix + "\n")


def show_progress(
    futures: Sequence[Future],
    scheduler: Scheduler,
    loop: IOLoop,
    label: str,
    stream: TextIO | None = None,
) -> None:
    """Block until every future is done (finished, erred or cancelled),
    drawing a :class:`TextBar` of the tasks they depend on.

    ``scheduler`` must be in this process and run on ``loop`` (a LocalCluster's
    ``cluster.scheduler`` and ``cluster.loop``). A failure is not raised here:
    the futures' ``result()`` raises it.
    """
    bar = TextBar(label, stream)
    interval = 0.1 if bar.tty else 0.5
    plugin = Progress([f.key for f in futures], scheduler, complete=True)

    async def setup() -> None:
        await plugin.setup()

    async def teardown() -> None:
        if plugin.name in scheduler.plugins:
            scheduler.remove_plugin(name=plugin.name)

    sync(loop, setup)
    try:
        while not all(f.done() for f in futures):
            # Sizes of sets read from another thread: atomic under the GIL.
            total = len(plugin.all_keys)
            bar.update(total - len(plugin.keys), total)
            time.sleep(interval)
        total = len(plugin.all_keys)
        done = total - len(plugin.keys)
        status: str = plugin.status or next(
            (str(f.status) for f in futures if f.status != "finished"), "finished"
        )
        bar.finish(done, total, status)
    finally:
        sync(loop, teardown)
