"""Our spans extension against stock on identical sequences of scheduler events.

Each test drives two scheduler-side worlds, one with
``distributed.spans.SpansSchedulerExtension`` and one with ours, through the same
operations on real ``TaskGroup`` / ``TaskState`` objects (submissions with and
without span annotations, TaskGroup collisions, state transitions, nbytes and
duration updates, worker heartbeats) and compares everything the stock API exposes
after every step.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from distributed.metrics import time
from distributed.scheduler import ALL_TASK_STATES, TaskGroup, TaskPrefix, TaskState
from distributed.spans import Span as StockSpan
from distributed.spans import SpansSchedulerExtension as StockExtension

from dask_shm.spans import Span, SpansSchedulerExtension

STATES = sorted(ALL_TASK_STATES)
#: (tags of the span, variant): variant 1 is the same tags closed and reopened
PATHS: list[tuple[tuple[str, ...], int] | None] = [
    None,
    (("a",), 0),
    (("a", "b"), 0),
    (("a", "c"), 0),
    (("d",), 0),
    (("a", "b", "e"), 0),
    (("a",), 1),
    (("a", "b"), 1),
]
T0 = 1e10  # task timestamps, later than any span's enqueued time


@pytest.fixture(autouse=True)
def fresh_metadata_ids() -> None:
    """distributed < 2026.8.0 keeps the id() of every span metadata it has seen in
    one class-level set for the life of the process (ours inherits it), so ids of
    dicts freed by earlier tests would drop metadata at random: start each test
    as a fresh scheduler process would."""
    seen = getattr(StockSpan, "_metadata_seen", None)
    if seen is not None:
        seen.clear()


def annotation(path: tuple[tuple[str, ...], int]) -> dict[str, tuple[str, ...]]:
    tags, variant = path
    ids = tuple(f"id-{'.'.join(tags[: i + 1])}-{variant}" for i in range(len(tags)))
    return {"name": tags, "ids": ids}


class World:
    """A scheduler stand-in: what the spans extension reads from its scheduler."""

    def __init__(self, ext_cls: type) -> None:
        self.scheduler = SimpleNamespace(
            total_nthreads_history=[(time(), 4)],
            handlers={},
            tasks={},
            add_plugin=lambda *args, **kwargs: None,
        )
        self.ext = ext_cls(self.scheduler)
        self.prefixes: dict[str, TaskPrefix] = {}
        self.groups: list[TaskGroup] = []
        self.tasks: list[TaskState] = []
        self.observed: list[dict] = []
        # Every submission's metadata stays alive: distributed < 2026.8.0
        # deduplicates span metadata by id() in a class-level set (ours inherits
        # Span.add_metadata), so a freed dict whose id() is reused would be dropped
        # at random in either world.
        self.metadata: list[dict] = []

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "submit":
            _, group_idx, prefix, n, path, with_code = op
            if group_idx is None:
                tp = self.prefixes.setdefault(prefix, TaskPrefix(prefix))
                tg = TaskGroup(f"{prefix}-{len(self.groups)}", tp)
                self.groups.append(tg)
            else:
                tg = self.groups[group_idx]
            new = []
            for _ in range(n):
                ts = TaskState(f"{tg.name}-{len(self.tasks)}", None, "released", tg, False)
                if path is not None:
                    ts.annotations = {"span": annotation(path), "other": 1}
                elif len(self.tasks) % 2:
                    ts.annotations = {"other": 2}
                self.tasks.append(ts)
                self.scheduler.tasks[ts.key] = ts
                new.append(ts)
                ts.state = "waiting"
            code = (("code", len(self.tasks)),) if with_code else ()
            meta = {"collections": [{"n": len(self.tasks)}]}
            self.metadata.append(meta)
            self.observed.append(self.ext.observe_tasks(new, code=code, span_metadata=meta))
        elif kind == "transition":
            _, idx, state = op
            self.tasks[idx].state = state
        elif kind == "nbytes":
            _, idx, n = op
            self.tasks[idx].set_nbytes(n)
        elif kind == "duration":
            _, idx, action, start, stop = op
            self.groups[idx].add_duration(action, start, stop)
        elif kind == "heartbeat":
            _, span_idx, label, value = op
            spans = list(self.ext.spans.values())
            span_id = spans[span_idx % len(spans)].id
            ws = SimpleNamespace(address="tcp://w", metrics={})
            self.ext.heartbeat(ws, {("execute", span_id, "pfx", label, "seconds"): value})
        else:  # pragma: no cover
            raise AssertionError(op)


def random_ops(seed: int, n: int) -> list[tuple]:
    rng = random.Random(seed)
    ops: list[tuple] = []
    n_groups = n_tasks = 0
    for _ in range(n):
        r = rng.random()
        if r < 0.2 or not n_tasks:
            reuse = n_groups and rng.random() < 0.2
            k = rng.randint(1, 4)
            ops.append(
                (
                    "submit",
                    rng.randrange(n_groups) if reuse else None,
                    rng.choice(["x", "y", "z"]),
                    k,
                    rng.choice(PATHS),
                    rng.random() < 0.5,
                )
            )
            n_groups += not reuse
            n_tasks += k
        elif r < 0.7:
            # Biased towards memory so that spans keep finishing and reopening
            state = "memory" if rng.random() < 0.4 else rng.choice(STATES)
            ops.append(("transition", rng.randrange(n_tasks), state))
        elif r < 0.8:
            ops.append(("nbytes", rng.randrange(n_tasks), rng.randint(0, 10_000)))
        elif r < 0.92:
            start = T0 + rng.random() * 100
            ops.append(
                (
                    "duration",
                    rng.randrange(n_groups),
                    rng.choice(["compute", "transfer", "deserialize"]),
                    start,
                    start + rng.random() * 10,
                )
            )
        else:
            ops.append(("heartbeat", rng.randrange(100), rng.choice(["a", "b"]), rng.random()))
    return ops


def describe_span(sp: Any) -> dict[str, Any]:
    done = sp.done
    stop = sp.stop
    return {
        "name": sp.name,
        "parent": sp.parent.name if sp.parent else None,
        "children": [c.name for c in sp.children],
        "groups": sorted(tg.name for tg in sp.groups),
        "states": sp.states,
        "done": done,
        "nbytes_total": sp.nbytes_total,
        "duration": round(sp.duration, 6),
        "all_durations": {k: round(v, 6) for k, v in sp.all_durations.items()},
        "start": sp.start,
        "stop": stop if done and stop >= T0 else None,
        "code": sp.code,
        "metadata": sp.metadata,
        "annotation": None if sp.annotation is None else sp.annotation["name"],
        "metrics": {
            k: round(v, 9)
            for k, v in sp.cumulative_worker_metrics.items()
            if k[2] != "idle or other spans"
        },
        "traverse_groups": sorted(tg.name for tg in sp.traverse_groups()),
    }


def describe(world: World) -> dict[str, Any]:
    ext = world.ext
    out: dict[str, Any] = {"spans": [describe_span(sp) for sp in ext.spans.values()]}
    out["roots"] = [sp.name for sp in ext.root_spans]
    out["by_name"] = {k: len(v) for k, v in ext.spans_search_by_name.items()}
    out["by_tag"] = {k: [sp.name for sp in v] for k, v in ext.spans_search_by_tag.items()}
    for tags in (("a",), ("b",), ("b", "d"), ("e", "a"), ("default",)):
        found = list(ext.find_by_tags(*tags))
        out["find", tags] = [sp.name for sp in found]
        if found:
            out["merge", tags] = describe_span(ext.merge_by_tags(*tags))
    if ext.root_spans:
        out["merge_all"] = describe_span(ext.merge_all())
    # Default-span ids are random; everything else must match exactly
    # The instrumented TaskGroups still look and behave like stock ones
    out["task_groups"] = [
        (
            isinstance(tg, TaskGroup),
            type(tg.states).__mro__[-2],
            dict(tg.states),
            tg.done,
            tg.nbytes_total,
            tg.duration,
            dict(tg.all_durations),
            tg.start,
            tg.stop,
            tg.prefix.nbytes_total,
            dict(tg.prefix.states),
        )
        for tg in world.groups
    ]
    out["observed"] = world.observed
    out["annotations"] = [ts.annotations for ts in world.tasks]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_random_event_sequences_match_stock(seed: int) -> None:
    stock, ours = World(StockExtension), World(SpansSchedulerExtension)
    for i, op in enumerate(random_ops(seed, 150)):
        stock.apply(op)
        ours.apply(op)
        if i % 5 == 0:
            assert describe(ours) == describe(stock), (seed, i, op)
    assert describe(ours) == describe(stock)
    assert all(isinstance(sp, Span) for sp in ours.ext.spans.values())


def test_default_span_closes_and_reopens_like_stock() -> None:
    worlds = World(StockExtension), World(SpansSchedulerExtension)
    for w in worlds:
        w.apply(("submit", None, "x", 2, None, False))
        w.apply(("submit", None, "y", 1, None, False))  # same default span: not done
        for idx in range(3):
            w.apply(("transition", idx, "memory"))
        w.apply(("submit", None, "z", 1, None, False))  # previous default is done
        w.apply(("transition", 3, "processing"))
        w.apply(("submit", None, "x", 1, (("a",), 0), False))
        w.apply(("submit", None, "w", 1, None, False))  # joins the open default span
    stock, ours = (describe(w) for w in worlds)
    assert ours == stock
    defaults = [s for s in ours["spans"] if s["name"] == ("default",)]
    assert [len(s["groups"]) for s in defaults] == [2, 2]


def test_done_flips_back_when_a_child_span_gets_work() -> None:
    worlds = World(StockExtension), World(SpansSchedulerExtension)
    for w in worlds:
        w.apply(("submit", None, "x", 1, (("a",), 0), False))
        w.apply(("transition", 0, "memory"))
    assert [w.ext.spans["id-a-0"].done for w in worlds] == [True, True]
    for w in worlds:
        w.apply(("submit", None, "y", 1, (("a", "b"), 0), False))
    assert [w.ext.spans["id-a-0"].done for w in worlds] == [False, False]
    assert describe(worlds[1]) == describe(worlds[0])


def test_malformed_annotation_is_a_clear_error() -> None:
    world = World(SpansSchedulerExtension)
    tp = TaskPrefix("x")
    ts = TaskState("x-1", None, "released", TaskGroup("x", tp), False)
    ts.annotations = {"span": {"name": ("a", "b"), "ids": ("only-one",)}}
    with pytest.raises(ValueError, match="as many ids as tags"):
        world.ext.observe_tasks([ts], code=(), span_metadata={"collections": []})


def test_merge_of_nothing_raises_like_stock() -> None:
    for ext in (World(StockExtension).ext, World(SpansSchedulerExtension).ext):
        with pytest.raises(ValueError, match="Nothing to merge"):
            ext.merge_by_tags("nope")
