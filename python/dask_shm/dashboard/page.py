"""The Bokeh document of the dashboard's shared-memory page.

One row per worker in a table of its current figures, and one line per worker
in each plot over time: private memory; bytes in tier 1 (values in private
memory), tier 2 (shared-memory files; dashed: the budget) and tier 3 (disk);
bytes sent to peers by hard link and as bytes over TCP. Data come from a
:class:`~dask_shm.dashboard.history.ShmHistory`; the page redraws every
``update_ms``. Models the page's data live in carry a ``name`` (``shm-history``,
``shm-current``, ``shm-<plot>``) so tools and tests can find them in the
browser's ``Bokeh.documents``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bokeh.layouts import column, gridplot
from bokeh.models import (
    AdaptiveTicker,
    ColumnDataSource,
    DataRange1d,
    HoverTool,
    NumeralTickFormatter,
)
from bokeh.models.widgets import DataTable, Div, HTMLTemplateFormatter, TableColumn
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from dask.utils import format_bytes

if TYPE_CHECKING:
    from bokeh.document import Document
    from distributed import Scheduler

    from dask_shm.dashboard.history import ShmHistory

#: Plot name -> (title, sample fields drawn: solid, then dashed).
PLOTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "private": ("Private memory (process memory without shared pages)", ("private",)),
    "tier1": ("Tier 1: values in private memory", ("tier1",)),
    "tier2": ("Tier 2: shared-memory files (dashed: budget)", ("tier2", "budget")),
    "tier3": ("Tier 3: files on disk", ("tier3",)),
    "link": ("Sent to peers by hard link (since start)", ("link",)),
    "tcp": ("Sent to peers as bytes over TCP (since start)", ("tcp",)),
}

#: Table column -> header.
COLUMNS = {
    "worker": "Worker",
    "private": "Private memory",
    "tier1": "Tier 1 (memory)",
    "tier2": "Tier 2 (shared)",
    "budget": "Tier 2 budget",
    "tier3": "Tier 3 (disk)",
    "link": "Sent by link",
    "tcp": "Sent over TCP",
}

_FIELDS = ("private", "tier1", "tier2", "budget", "tier3", "link", "tcp")


#: The worker cell: a square of the worker's colour in the plots, then its address.
_WORKER_CELL = '<span style="color: <%= color %>">&#9632;</span> <%= value %>'


class ShmPage:
    """The page's models and their update from ``history``. Each page load
    builds its own (a Bokeh model belongs to one document)."""

    def __init__(self, history: ShmHistory, **figure_kwargs: Any):
        self.history = history
        self.history_source = ColumnDataSource(
            {"worker": [], "color": [], "time": [], **{f: [] for f in _FIELDS}},
            name="shm-history",
        )
        self.current_source = ColumnDataSource(
            {"color": [], **{c: [] for c in COLUMNS}}, name="shm-current"
        )
        x_range = DataRange1d(range_padding=0)
        self.figures = {}
        for name, (title, fields) in PLOTS.items():
            fig = figure(
                title=title,
                name=f"shm-{name}",
                x_axis_type="datetime",
                x_range=x_range,
                height=260,
                tools="reset,xpan,xwheel_zoom,save",
                **figure_kwargs,
            )
            for field, dash in zip(fields, ("solid", "dashed"), strict=False):
                fig.multi_line(
                    xs="time",
                    ys=field,
                    line_color="color",
                    line_dash=dash,
                    line_width=2,
                    source=self.history_source,
                )
            fig.add_tools(HoverTool(tooltips=[("worker", "@worker")], line_policy="nearest"))
            fig.yaxis[0].ticker = AdaptiveTicker(  # powers of two, as distributed's memory plots
                base=1024, mantissas=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
            )
            fig.yaxis[0].formatter = NumeralTickFormatter(format="0.0 b")
            fig.y_range.start = 0  # type: ignore[attr-defined]
            fig.xgrid.visible = False
            self.figures[name] = fig
        self.table = DataTable(
            source=self.current_source,
            # The worker's colour in the plots (no legend: the table is one).
            columns=[
                TableColumn(
                    field=c, title=t, formatter=HTMLTemplateFormatter(template=_WORKER_CELL)
                )
                if c == "worker"
                else TableColumn(field=c, title=t)
                for c, t in COLUMNS.items()
            ],
            index_position=None,
            height=120,
            sizing_mode="stretch_width",
            name="shm-table",
        )
        header = Div(
            text="<h3>Shared memory by worker</h3>"
            "<p>Bytes each worker holds in each tier and sends to its peers, from its "
            "heartbeats (dask-shm).</p>",
            sizing_mode="stretch_width",
        )
        grid = gridplot(list(self.figures.values()), ncols=2, sizing_mode="stretch_width")
        self.root = column(header, self.table, grid, sizing_mode="stretch_width")

    def update(self) -> None:
        """Redraw from the history as it is now."""
        samples = self.history.samples()
        workers = list(samples)
        colors = [Category10_10[i % len(Category10_10)] for i in range(len(workers))]
        history: dict[str, list[Any]] = {"worker": workers, "color": colors}
        history["time"] = [[s.time * 1000 for s in samples[w]] for w in workers]
        for field in _FIELDS:
            history[field] = [[getattr(s, field) for s in samples[w]] for w in workers]
        self.history_source.data = history
        current: dict[str, list[str]] = {"color": colors, **{c: [] for c in COLUMNS}}
        for w in workers:
            last = samples[w][-1]
            current["worker"].append(w)
            for field in _FIELDS:
                current[field].append(format_bytes(int(getattr(last, field))))
        self.current_source.data = current


def shm_doc(
    history: ShmHistory,
    scheduler: Scheduler,
    extra: dict[str, Any],
    doc: Document,
    *,
    update_ms: int = 1000,
) -> None:
    """Build the page in ``doc``: distributed's page template (nav bar from
    ``extra``) around an :class:`ShmPage` updated every ``update_ms``."""
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = ShmPage(history)
    page.update()
    add_periodic_callback(doc, page, update_ms)
    doc.title = "Dask: Shared Memory"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
