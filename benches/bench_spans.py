"""Span extension scale: stock ``distributed.spans`` vs ``dask_shm.spans``, same run.

World: a scheduler-side span tree with 10,000 TaskGroups (one task each):

- a default span with 5,000 groups, all finished except one long-running task
  (e.g. an actor or a service loop), so the default span stays open;
- a named workflow ``etl`` with 10 sub-spans of 500 finished groups each.

Scenarios (each run for stock and ours; benches/conftest.py prints the ratios):

- ``observe``: submit one un-annotated task in a new group (``observe_tasks`` asks
  whether the default span is done), then let it finish;
- ``query``: ``done``, ``states`` and ``nbytes_total`` of every root span and of
  ``merge_all()`` (what the dashboard polls);
- ``mixed``: one ``observe`` followed by one ``query``;
- ``transition``: 1,000 task state changes in groups attached to spans. This is the
  price of the incremental counters: every change is forwarded to the span tree, so
  ours is *slower* here; it is paid on the scheduler's transition path, where a
  transition costs tens of microseconds anyway.

Run: ``pytest benches/bench_spans.py``
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from distributed.metrics import time
from distributed.scheduler import TaskGroup, TaskPrefix, TaskState
from distributed.spans import SpansSchedulerExtension as StockExtension

from dask_shm.spans import SpansSchedulerExtension as OurExtension

IMPLS = {"stock": StockExtension, "ours": OurExtension}
N_DEFAULT_GROUPS = 5_000
N_CHILDREN = 10
GROUPS_PER_CHILD = 500
META: dict[str, Any] = {"collections": []}


class World:
    def __init__(self, ext_cls: type) -> None:
        self.scheduler = SimpleNamespace(
            total_nthreads_history=[(time(), 8)],
            handlers={},
            tasks={},
            add_plugin=lambda *args, **kwargs: None,
        )
        self.ext = ext_cls(self.scheduler)
        self.prefix = TaskPrefix("bench")
        self.counter = itertools.count()

    def new_task(self, annotation: dict | None = None) -> TaskState:
        i = next(self.counter)
        tg = TaskGroup(f"bench-{i}", self.prefix)
        ts = TaskState(f"bench-{i}", None, "released", tg, False)
        ts.annotations = {"span": annotation} if annotation else None
        ts.state = "waiting"
        return ts

    def observe(self, tss: list[TaskState]) -> None:
        self.ext.observe_tasks(tss, code=(), span_metadata=META)

    def build(self) -> World:
        long_running = self.new_task()
        self.observe([long_running])
        long_running.state = "processing"
        for _ in range(N_DEFAULT_GROUPS - 1):
            ts = self.new_task()
            self.observe([ts])
            ts.state = "memory"
        for child in range(N_CHILDREN):
            ann = {"name": ("etl", f"step-{child}"), "ids": ("etl-id", f"step-{child}-id")}
            tss = [self.new_task(ann) for _ in range(GROUPS_PER_CHILD)]
            self.observe(tss)
            for ts in tss:
                ts.set_nbytes(1000)
                ts.state = "memory"
        assert sum(len(sp.groups) for sp in self.ext.spans.values()) == 10_000
        return self

    def submit_one(self) -> None:
        ts = self.new_task()
        self.observe([ts])
        ts.state = "memory"

    def query(self) -> list[tuple[bool, dict, int]]:
        spans = [*self.ext.root_spans, self.ext.merge_all()]
        return [(sp.done, sp.states, sp.nbytes_total) for sp in spans]


@pytest.fixture(scope="module")
def worlds() -> dict[str, World]:
    return {name: World(cls).build() for name, cls in IMPLS.items()}


def _run(benchmark: Any, scenario: str, impl: str, fn: Callable[[], object]) -> None:
    benchmark.group = f"spans-{scenario}"
    benchmark.pedantic(fn, rounds=60, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_observe_tasks(benchmark: Any, worlds: dict[str, World], impl: str) -> None:
    world = worlds[impl]
    _run(benchmark, "observe", impl, world.submit_one)
    # The long-running task keeps a single default span open in both
    assert len(world.ext.spans_search_by_name["default",]) == 1


@pytest.mark.parametrize("impl", list(IMPLS))
def test_done_states_queries(benchmark: Any, worlds: dict[str, World], impl: str) -> None:
    _run(benchmark, "query", impl, worlds[impl].query)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_observe_and_query(benchmark: Any, worlds: dict[str, World], impl: str) -> None:
    world = worlds[impl]

    def mixed() -> None:
        world.submit_one()
        world.query()

    _run(benchmark, "mixed", impl, mixed)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_state_transitions(benchmark: Any, worlds: dict[str, World], impl: str) -> None:
    world = worlds[impl]
    tasks = [world.new_task({"name": ("flip",), "ids": ("flip-id",)}) for _ in range(100)]
    world.observe(tasks)
    cycle = ("processing", "memory", "released", "waiting") * 2 + ("processing", "memory")

    def flips() -> None:
        for ts in tasks:
            for state in cycle:
                ts.state = state  # type: ignore[assignment]

    benchmark.group = "spans-transition"
    benchmark.pedantic(flips, rounds=60, iterations=1, warmup_rounds=2)


def test_same_answers(worlds: dict[str, World]) -> None:
    """The benchmarked worlds agree (the benchmark measures equal work)."""
    stock, ours = worlds["stock"].ext, worlds["ours"].ext
    assert len(stock.spans) == len(ours.spans)
    for a, b in zip(stock.spans.values(), ours.spans.values(), strict=True):
        assert (a.name, a.done, a.states, a.nbytes_total) == (
            b.name,
            b.done,
            b.states,
            b.nbytes_total,
        )
