"""The Bokeh document of the dashboard's shared-memory page.

One row per worker in a table of its current figures, and one line per worker
in each plot over time: private memory; bytes in tier 1 (values in private
memory) and in each file tier the workers report (by default tier 2, the
shared-memory files, and tier 3, the disk; dashed: a tier's budget); bytes
sent to peers by hard link and as bytes over TCP. Data come from a
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

from dask_shm.shared.tiers import titles

if TYPE_CHECKING:
    from bokeh.document import Document
    from distributed import Scheduler

    from dask_shm.dashboard.history import ShmHistory

#: Tier number -> (its name, whether it has a budget): the file tiers the
#: page shows.
Tiers = dict[int, tuple[str, bool]]


def plots(tiers: Tiers) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Plot name -> (title, sample fields drawn: solid, then dashed), one
    plot per file tier in ``tiers`` between tier 1's and the transfers'."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {
        "private": ("Private memory (process memory without shared pages)", ("private",)),
        "tier1": ("Tier 1: values in private memory", ("tier1",)),
    }
    for number, (name, budgeted) in sorted(tiers.items()):
        title = f"Tier {number}: {titles(name)[1]}"
        fields: tuple[str, ...] = (f"tier{number}",)
        if budgeted:
            title += " (dashed: budget)"
            fields += (f"tier{number}_budget",)
        out[f"tier{number}"] = (title, fields)
    out["link"] = ("Sent to peers by hard link (since start)", ("link",))
    out["tcp"] = ("Sent to peers as bytes over TCP (since start)", ("tcp",))
    return out


def columns(tiers: Tiers) -> dict[str, str]:
    """Table column -> header (the columns are the sample fields, see
    :meth:`~dask_shm.dashboard.history.Sample.figures`, after ``worker``)."""
    out = {"worker": "Worker", "private": "Private memory", "tier1": "Tier 1 (memory)"}
    for number, (name, budgeted) in sorted(tiers.items()):
        out[f"tier{number}"] = f"Tier {number} ({name})"
        if budgeted:
            out[f"tier{number}_budget"] = f"Tier {number} budget"
    out["link"] = "Sent by link"
    out["tcp"] = "Sent over TCP"
    return out


#: The worker cell: a square of the worker's colour in the plots, then its address.
_WORKER_CELL = '<span style="color: <%= color %>">&#9632;</span> <%= value %>'


class ShmPage:
    """The page's models and their update from ``history``. Each page load
    builds its own (a Bokeh model belongs to one document). The file tiers
    shown are those the workers have reported since the page was built: a
    tier first reported later gets its plot and columns then."""

    def __init__(self, history: ShmHistory, **figure_kwargs: Any):
        self.history = history
        self._figure_kwargs = figure_kwargs
        #: the file tiers shown
        self.tiers: Tiers = {}
        self.history_source = ColumnDataSource(
            {"worker": [], "color": [], "time": []}, name="shm-history"
        )
        self.current_source = ColumnDataSource({"color": []}, name="shm-current")
        self._x_range = DataRange1d(range_padding=0)
        self.figures: dict[str, Any] = {}
        self.table = DataTable(
            source=self.current_source,
            columns=[],
            index_position=None,
            height=120,
            sizing_mode="stretch_width",
            name="shm-table",
        )
        self._header = Div(
            text="<h3>Shared memory by worker</h3>"
            "<p>Bytes each worker holds in each tier and sends to its peers, from its "
            "heartbeats (dask-shm).</p>",
            sizing_mode="stretch_width",
        )
        self.root = column(self._header, self.table, sizing_mode="stretch_width")
        self.update()

    def _figure(self, name: str, title: str, fields: tuple[str, ...]) -> Any:
        fig = figure(
            title=title,
            name=f"shm-{name}",
            x_axis_type="datetime",
            x_range=self._x_range,
            height=260,
            tools="reset,xpan,xwheel_zoom,save",
            **self._figure_kwargs,
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
        return fig

    def _lay_out(self) -> None:
        """(Re)build the plots and the table's columns for :attr:`tiers`."""
        self.figures = {
            name: self._figure(name, title, fields)
            for name, (title, fields) in plots(self.tiers).items()
        }
        # The worker's colour in the plots (no legend: the table is one).
        self.table.columns = [
            TableColumn(field=c, title=t, formatter=HTMLTemplateFormatter(template=_WORKER_CELL))
            if c == "worker"
            else TableColumn(field=c, title=t)
            for c, t in columns(self.tiers).items()
        ]
        grid = gridplot(list(self.figures.values()), ncols=2, sizing_mode="stretch_width")
        self.root.children = [self._header, self.table, grid]

    def update(self) -> None:
        """Redraw from the history as it is now."""
        samples = self.history.samples()
        tiers = dict(self.tiers)
        for series in samples.values():
            for tier in series[-1].files if series else ():
                # as last reported (a budget once seen stays drawn)
                name, budgeted = tiers.get(tier.number, (tier.name, False))
                budgeted = budgeted and name == tier.name
                tiers[tier.number] = (tier.name, budgeted or tier.budget is not None)
        fields = [c for c in columns(tiers) if c != "worker"]
        workers = list(samples)
        colors = [Category10_10[i % len(Category10_10)] for i in range(len(workers))]
        history: dict[str, list[Any]] = {"worker": workers, "color": colors}
        history["time"] = [[s.time * 1000 for s in samples[w]] for w in workers]
        figures = {w: [s.figures() for s in samples[w]] for w in workers}
        for field in fields:
            history[field] = [[f.get(field, 0.0) for f in figures[w]] for w in workers]
        current: dict[str, list[str]] = {"color": colors, "worker": workers}
        for field in fields:
            current[field] = [format_bytes(int(figures[w][-1].get(field, 0.0))) for w in workers]
        # The data first: the plots of new tiers read their columns.
        self.history_source.data = history
        self.current_source.data = current
        if tiers != self.tiers or not self.figures:
            self.tiers = tiers
            self._lay_out()


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
    add_periodic_callback(doc, page, update_ms)
    doc.title = "Dask: Shared Memory"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
