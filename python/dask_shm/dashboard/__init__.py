"""A shared-memory page on the scheduler's dashboard (``/shared-memory``),
listed in the nav bar next to distributed's own pages.

:class:`DashboardPage` adds it to a running scheduler (the preload does, see
:mod:`dask_shm.preload`): a Bokeh application built by distributed's own
``BokehApplication``, with the same prefix and template variables as the
stock dashboard, served by the scheduler's HTTP server next to it; its name
joins the ``pages`` list those template variables share, so every page's nav
bar links to it. A scheduler without a dashboard (``dashboard=False``, bokeh
not installed) gets nothing. What it shows: :mod:`dask_shm.dashboard.page`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Scheduler

    from dask_shm.dashboard.history import ShmHistory

logger = logging.getLogger(__name__)

#: The page's path under the dashboard's prefix, and its nav-bar entry.
PAGE = "shared-memory"

_CALLBACK = "shm-dashboard-history"


def stock_dashboard(scheduler: Scheduler) -> Any | None:
    """The Bokeh application of distributed's dashboard on ``scheduler``,
    or None when it runs none."""
    try:
        from bokeh.server.server import BokehTornado
    except ImportError:
        return None
    application = getattr(scheduler, "http_application", None)
    for app in getattr(application, "applications", ()):
        if isinstance(app, BokehTornado):
            return app
    return None


class DashboardPage:
    """Scheduler plugin-like object (``setup``/``teardown``) that serves the
    page; ``history`` (the figures it plots) is sampled every ``interval``
    seconds, the last ``length`` samples kept."""

    name = "shm-dashboard"

    def __init__(self, *, interval: float = 1.0, length: int = 600):
        self.interval = interval
        self.length = length
        self.history: ShmHistory | None = None
        self._app: Any = None

    def setup(self, scheduler: Scheduler) -> None:
        """Serve the page on ``scheduler``'s dashboard, if it has one. Logs a
        warning and serves nothing when distributed lacks what this hooks
        (:data:`dask_shm.compat.HOOKS`)."""
        stock = stock_dashboard(scheduler)
        if stock is None:
            logger.debug("dask-shm: no dashboard on %s, no shared-memory page", scheduler.address)
            return
        from dask_shm.compat import dashboard_hooks_present

        if not dashboard_hooks_present():
            logger.warning(
                "dask-shm: this distributed's dashboard cannot take the shared-memory page "
                "(see `dask shm info`); it is not served"
            )
            return
        from functools import partial

        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop, PeriodicCallback

        from dask_shm.dashboard.history import ShmHistory
        from dask_shm.dashboard.page import shm_doc

        self.history = history = ShmHistory(scheduler, interval=self.interval, length=self.length)
        # Started with the scheduler's other callbacks (or now, if it runs
        # already); stopped when it closes.
        callback = PeriodicCallback(history.sample, self.interval * 1000)
        scheduler.periodic_callbacks[_CALLBACK] = callback
        if scheduler.status.name == "running":
            callback.start()
        variables = template_variables(scheduler)  # memoized: the dict every page uses
        app = BokehApplication(
            {f"/{PAGE}": partial(shm_doc, history)},
            scheduler,
            prefix=stock.prefix,
            template_variables=variables,
        )
        scheduler.http_application.add_application(app)
        app.initialize(IOLoop.current())
        app.start()
        self._app = app
        if PAGE not in variables["pages"]:
            pages = variables["pages"]
            # Before "info" (distributed's last page), as its own pages are.
            pages.insert(pages.index("info") if "info" in pages else len(pages), PAGE)

    def teardown(self, scheduler: Scheduler) -> None:
        """Stop sampling; the application stops with the scheduler's HTTP
        services (distributed stops every application it serves)."""
        callback = scheduler.periodic_callbacks.pop(_CALLBACK, None)
        if callback is not None:
            callback.stop()
