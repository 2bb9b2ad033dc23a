"""The dashboard's shared-memory page, on a LocalCluster of worker processes
in shared-memory mode switched on by config, as a user does; looked at in a
real browser (headless Chromium)."""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser import chromium_path, open_page
from clusters import process_cluster, worker_addresses
from dask.sizeof import sizeof
from distributed import Client, Scheduler

from dask_shm.dashboard import PAGE
from dask_shm.preload import preloaded_plugins

MiB = 2**20

CONFIG = {
    "distributed.scheduler.preload": ["dask_shm"],
    "distributed.nanny.preload": ["dask_shm"],
    "distributed.worker.preload": ["dask_shm"],
    "shm.shared-memory.enabled": True,
    "shm.shared-memory.max-bytes": "40 MiB",  # small: the spills reach tier 3
    # Spills by the buffer's target (0.3 x 1 GiB), while the process stays
    # below the spill threshold: above it tier 2 would give way to disk
    # (shared/relief.py) and not show in the figures.
    "distributed.worker.memory.target": 0.3,
    "distributed.worker.memory.spill": 0.9,
    "distributed.worker.memory.pause": 0.95,
    "distributed.worker.memory.terminate": 0.98,
}

#: Sample fields that worker ``a`` (the one holding the arrays) has non-zero
#: after the workload; ``b`` sends small values as bytes (``tcp``).
A_FIELDS = ("private", "tier1", "tier2", "tier2_budget", "tier3", "link")


def history(dask_scheduler: Scheduler) -> dict[str, dict[str, float]]:
    """The last sample of each worker in the page's history, as dicts."""
    samples = preloaded_plugins(dask_scheduler)["shm-dashboard"].history.samples()
    return {w: s[-1].figures() for w, s in samples.items() if s}


def wait_for_figures(client: Client, a: str, b: str, timeout: float = 60) -> None:
    """Until the scheduler's history shows the workload (heartbeats arrive
    about once a second, the history samples once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        last = client.run_on_scheduler(history)
        if a in last and b in last and all(last[a][f] > 0 for f in A_FIELDS) and last[b]["tcp"] > 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the history never showed the workload: {last}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster() -> Any:
    """(client, a, b, dashboard URL) after a workload that fills a's three
    tiers, hands values to b by hard link and sends small ones from b to a
    as bytes."""
    with process_cluster(2, "1 GiB", CONFIG, silence_logs=logging.ERROR) as client:
        a, b = worker_addresses(client)
        arrays = [client.submit(np.full, MiB, i, key=f"dash-x{i}", workers=[a]) for i in range(60)]
        total = client.submit(lambda *v: float(sum(x.sum() for x in v)), *arrays[:8], workers=[b])
        assert total.result() == MiB * sum(range(8))
        small = client.submit(lambda: list(range(50_000)), key="dash-small", workers=[b])
        assert client.submit(len, small, workers=[a]).result() == 50_000
        wait_for_figures(client, a, b)
        port = client.cluster.scheduler.http_server.port  # type: ignore[union-attr]
        yield client, a, b, f"http://127.0.0.1:{port}"


def test_every_dashboard_page_links_the_shared_memory_page(cluster):
    _, _, _, url = cluster
    # The page twice: each load is a document of its own.
    for page in ("status", "workers", PAGE, PAGE):
        html = urllib.request.urlopen(f"{url}/{page}", timeout=30).read().decode()
        assert f'href="{PAGE}"' in html, page


def test_history_has_each_workers_tiers_and_transfers(cluster):
    client, a, b, _ = cluster
    last = client.run_on_scheduler(history)
    assert set(last) == {a, b}
    assert last[a]["tier3"] > 0 and last[a]["link"] >= 8 * 8 * MiB
    # b's list of Python objects went to a as bytes: counted as TCP, not link
    assert last[b]["tcp"] >= sizeof(list(range(50_000))) and last[b]["link"] == 0
    # the budget is the configured one, the tier-2 bytes within it
    assert last[a]["tier2_budget"] == 40 * MiB and 0 < last[a]["tier2"] <= 40 * MiB


#: The page's plots, and the sample fields each draws.
PLOTS = {
    "shm-private": ("private",),
    "shm-tier1": ("tier1",),
    "shm-tier2": ("tier2", "tier2_budget"),
    "shm-tier3": ("tier3",),
    "shm-link": ("link",),
    "shm-tcp": ("tcp",),
}

#: In the browser: the page's data as its Bokeh document has it, and where
#: each plot's frame (the area inside the axes) is on the page.
READ_PAGE = """(() => {
  const doc = Bokeh.documents[0];
  const history = doc.get_model_by_name("shm-history").data;
  const current = doc.get_model_by_name("shm-current").data;
  const frames = {};
  const walk = (view) => {
    const name = view.model.name;
    if (name && name.startsWith("shm-") && view.frame) {
      const el = view.el.getBoundingClientRect();
      const bbox = view.frame.bbox;
      frames[name] = {left: el.left + bbox.left, top: el.top + bbox.top,
                      right: el.left + bbox.right, bottom: el.top + bbox.bottom};
    }
    for (const child of view.child_views ?? []) walk(child);
  };
  for (const root of Object.values(Bokeh.index)) walk(root);
  const last = {};
  history.worker.forEach((w, i) => {
    last[w] = {color: history.color[i], points: history.time[i].length};
    for (const field of ["private", "tier1", "tier2", "tier2_budget", "tier3", "link", "tcp"]) {
      const ys = Array.from(history[field][i]);
      last[w][field] = ys[ys.length - 1];
    }
  });
  return {last, current, frames};
})()"""

#: Until the document is there with two workers' data and six drawn plots.
PAGE_READY = """(() => {
  const doc = window.Bokeh && Bokeh.documents[0];
  if (!doc || doc.get_model_by_name("shm-history").data.worker.length < 2) return false;
  let plots = 0;
  const walk = (view) => {
    if (view.frame && (view.model.name ?? "").startsWith("shm-")) plots += 1;
    for (const child of view.child_views ?? []) walk(child);
  };
  for (const root of Object.values(Bokeh.index)) walk(root);
  return plots === 6;
})()"""


def colored_pixels(image: Any, frame: dict[str, float], color: str) -> int:
    """Pixels of ``color`` (hex, anti-aliasing tolerated) in the right half
    of ``frame`` above its bottom rows: where a line of non-zero values
    runs once the workload is done (a line of zeros lies on the bottom)."""
    target = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)])
    left = int((frame["left"] + frame["right"]) / 2)
    box = (left, int(frame["top"]), int(frame["right"]), int(frame["bottom"]) - 6)
    pixels = np.asarray(image.crop(box), dtype=int)
    return int((np.abs(pixels - target).sum(axis=-1) < 90).sum())


async def look_at_page(url: str, screenshot: Path) -> tuple[dict[str, Any], Any, list[str]]:
    async with open_page(url, width=1400, height=1300) as page:
        await page.wait_for(PAGE_READY, timeout=60)
        await asyncio.sleep(2)  # one more update: every plot drawn with it
        seen = await page.evaluate(READ_PAGE)
        image = await page.screenshot()
        image.save(screenshot)  # for a person to look at
        return seen, image, page.errors


def test_the_page_draws_each_workers_figures_in_a_browser(cluster, tmp_path):
    chromium_path()
    client, a, b, url = cluster
    seen, image, errors = asyncio.run(look_at_page(f"{url}/{PAGE}", tmp_path / "page.png"))
    assert errors == []
    last = seen["last"]
    assert set(last) == {a, b}
    # What the browser received is what the scheduler recorded.
    for field in A_FIELDS:
        assert last[a][field] > 0, field
    assert last[b]["tcp"] > 0
    assert last[a]["points"] >= 2  # a time series, not a single value
    # The table shows each worker's current figures, formatted.
    rows = dict(zip(seen["current"]["worker"], seen["current"]["tier3"], strict=True))
    assert rows.keys() == {a, b} and rows[a].endswith("iB")
    # Each plot drew the line of the worker whose values are non-zero (b's
    # line may cover a's where their values are equal, as in tier 2).
    assert set(seen["frames"]) == set(PLOTS)
    for plot, fields in PLOTS.items():
        frame = seen["frames"][plot]
        assert frame["bottom"] <= image.height, f"{plot} is below the screenshot"
        if fields == ("tcp",):
            drawn = colored_pixels(image, frame, last[b]["color"])
        else:
            drawn = sum(colored_pixels(image, frame, last[w]["color"]) for w in (a, b))
        assert drawn >= 50, f"{plot}: {drawn} pixels of the workers' lines"


# --- when there is no page ---------------------------------------------------------


async def served_pages(**scheduler_kwargs: Any) -> tuple[Any, int, list[str]]:
    """(the page object the preload set up, HTTP status of the page, nav-bar
    pages) of a Scheduler started with the dask_shm preload."""
    from tornado.httpclient import AsyncHTTPClient

    async with Scheduler(port=0, preload=["dask_shm"], **scheduler_kwargs) as s:
        page = preloaded_plugins(s)["shm-dashboard"]
        if "dashboard" not in s.services:
            return page, 0, []
        from distributed.dashboard.scheduler import template_variables

        url = f"http://127.0.0.1:{s.http_server.port}/{PAGE}"
        response = await AsyncHTTPClient().fetch(url, raise_error=False)
        return page, response.code, list(template_variables(s)["pages"])


def test_a_scheduler_without_a_dashboard_gets_no_page():
    page, _, _ = asyncio.run(served_pages(dashboard=False))
    assert page.history is None


def test_a_dashboard_whose_internals_moved_gets_no_page_and_a_warning(monkeypatch, caplog):
    """A distributed whose template variables are no longer one dict per
    scheduler (the nav bar we add to): the hook check fails, `dask shm info`
    names it, and the scheduler serves its dashboard without our page."""
    import inspect

    import distributed.dashboard.scheduler as dashboard

    from dask_shm import compat

    monkeypatch.setattr(
        dashboard, "template_variables", inspect.unwrap(dashboard.template_variables)
    )
    [hook] = compat.missing_hooks()
    assert hook.used_by == "the dashboard's shared-memory page"
    with caplog.at_level(logging.WARNING, logger="dask_shm.dashboard"):
        page, status, pages = asyncio.run(served_pages(dashboard_address=":0"))
    assert page.history is None and status == 404 and PAGE not in pages
    assert "cannot take the shared-memory page" in caplog.text


def test_the_page_is_served_by_a_scheduler_started_with_the_preload_alone():
    """`dask scheduler --preload dask_shm`: the page is there before any
    worker joins (its history empty)."""
    page, status, pages = asyncio.run(served_pages(dashboard_address=":0"))
    assert status == 200 and PAGE in pages and page.history.samples() == {}
