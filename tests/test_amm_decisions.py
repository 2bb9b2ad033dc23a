"""Differential tests: our AMM against stock on randomized fake scheduler states.

Both managers run on the *same* state objects (an AMM run only reads the state and
asks the scheduler to enact, which the fake records), with memory values chosen so
that every choice stock makes is unique. Decisions must be identical.
"""

from __future__ import annotations

import io
import logging
import random
from collections.abc import Callable, Iterator, MutableSet
from typing import Any

import distributed.active_memory_manager as stock
import pytest
from amm_state import STATUSES, FakeScheduler, random_state
from distributed.active_memory_manager import ActiveMemoryManagerPolicy, Suggestion
from distributed.core import Status
from distributed.scheduler import WorkerState

import dask_shm.amm as ours
from dask_shm._core import AmmRun
from dask_shm.amm.extension import MEASURES, memory_formula_matches


class OrderedPolicies(MutableSet):
    """Insertion-ordered policy set, so both managers run policies in the same order."""

    def __init__(self) -> None:
        self._d: dict[Any, None] = {}

    def __contains__(self, x: object) -> bool:
        return x in self._d

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._d))

    def __len__(self) -> int:
        return len(self._d)

    def add(self, x: Any) -> None:
        self._d[x] = None

    def discard(self, x: Any) -> None:
        self._d.pop(x, None)


def make(cls: type, s: FakeScheduler, policies: list) -> Any:
    amm = cls(s, policies=set(), register=False, start=False, measure="optimistic")
    amm.policies = OrderedPolicies()
    for p in policies:
        amm.add_policy(p)
    return amm


def run_both(s: FakeScheduler, make_policies) -> tuple[set, set, list, list]:
    """Run stock then ours once each on ``s``; return both decision sets and policies."""
    sp = make_policies()
    make(stock.ActiveMemoryManagerExtension, s, sp).run_once()
    stock_dec = s.take()
    op = make_policies()
    make(ours.ActiveMemoryManagerExtension, s, op).run_once()
    our_dec = s.take()
    return stock_dec, our_dec, sp, op


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_reduce_replicas_same_decisions(seed: int) -> None:
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(2, 30), ntasks=rng.randint(1, 150))
    for cls in (stock.ReduceReplicas, ours.ReduceReplicas):
        stock_dec, our_dec, _, _ = run_both(s, lambda cls=cls: [cls()])
        assert our_dec == stock_dec


def test_reduce_replicas_decides_something() -> None:
    rng = random.Random(1234)
    s = random_state(rng, nworkers=10, ntasks=200, max_replicas=6, p_waiters=0)
    stock_dec, our_dec, _, _ = run_both(s, lambda: [stock.ReduceReplicas()])
    assert len(stock_dec) > 100
    assert our_dec == stock_dec


@pytest.mark.parametrize("seed", SEEDS)
def test_retire_worker_same_decisions(seed: int) -> None:
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(1, 25), ntasks=rng.randint(1, 150))
    retiring = rng.sample(list(s.workers.values()), rng.randint(1, min(3, len(s.workers))))
    for ws in retiring:
        if ws.status == Status.running:
            ws.status = Status.closing_gracefully
            s.running.discard(ws)

    def policies() -> list:
        return [stock.RetireWorker(ws.address) for ws in retiring]

    stock_dec, our_dec, sp, op = run_both(s, policies)
    assert our_dec == stock_dec
    assert [p.no_recipients for p in op] == [p.no_recipients for p in sp]
    assert [p.manager.policies.__contains__(p) for p in op] == [
        p.manager.policies.__contains__(p) for p in sp
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_mixed_policies_same_decisions(seed: int) -> None:
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(2, 20), ntasks=rng.randint(1, 120))
    retiring = rng.choice(list(s.workers.values())).address

    def policies() -> list:
        return [stock.ReduceReplicas(), stock.RetireWorker(retiring), ours.ReduceReplicas()]

    stock_dec, our_dec, sp, op = run_both(s, policies)
    assert our_dec == stock_dec
    assert op[1].no_recipients == sp[1].no_recipients


class RandomPolicy(ActiveMemoryManagerPolicy):
    """A third-party policy on the generator protocol: random suggestions with
    random candidate sets, which records every choice and what it could inspect."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.log: list[Any] = []

    def run(self):
        rng = random.Random(self.seed)
        sched = self.manager.scheduler
        workers = list(sched.workers.values())
        tasks = list(sched.tasks.values())
        for _ in range(rng.randint(0, 300)):
            ts = rng.choice(tasks)
            op = rng.choice(["replicate", "drop"])
            if rng.random() < 0.5:
                candidates = None
            else:
                candidates = set(rng.sample(workers, rng.randint(0, len(workers))))
            if rng.random() < 0.1:
                choice = yield (op, ts, candidates)  # legacy tuple form
            else:
                choice = yield Suggestion(op, ts, candidates)
            probe = rng.choice(workers)
            repl, drop = self.manager.pending[ts]
            self.log.append(
                (
                    op,
                    ts.key,
                    choice and choice.address,
                    self.manager.workers_memory[probe],
                    sorted(w.address for w in repl),
                    sorted(w.address for w in drop),
                )
            )


@pytest.mark.parametrize("seed", SEEDS)
def test_generator_protocol_same_decisions(seed: int) -> None:
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(1, 20), ntasks=rng.randint(1, 60))
    stock_dec, our_dec, sp, op = run_both(s, lambda: [RandomPolicy(seed)])
    assert op[0].log == sp[0].log
    assert our_dec == stock_dec


def test_ties_pick_first_worker() -> None:
    s = FakeScheduler()
    a = s.add_worker("a", 100)
    b = s.add_worker("b", 100)
    c = s.add_worker("c", 100)
    s.add_task("x", 10, [a, b, c])
    s.add_task("y", 10, [c])
    amm = make(ours.ActiveMemoryManagerExtension, s, [stock.ReduceReplicas()])
    amm.run_once()
    # Dropper ties (a, b, c all at 100): first in scheduler.workers wins, then the
    # next one (a is now lighter).
    assert s.take() == {("drop", a.address, "x"), ("drop", b.address, "x")}


def test_workers_memory_and_pending_visible_to_policies() -> None:
    s = FakeScheduler()
    a = s.add_worker("a", 1000)
    b = s.add_worker("b", 10)
    ts = s.add_task("x", 7, [a])
    seen: list[Any] = []

    class Probe(ActiveMemoryManagerPolicy):
        def run(self):
            mem = self.manager.workers_memory
            seen.append((mem[a], mem[b], len(mem), b in mem))
            # a plain dict, as stock's is (a policy planning ahead copies it)
            plan = mem.copy()
            plan[a] += 1
            seen.append((type(plan), plan, mem[a]))
            choice = yield Suggestion("replicate", ts)
            seen.append((choice, mem[b], self.manager.pending[ts]))
            mem[b] = 5000  # writes go through to the table
            choice = yield Suggestion("replicate", ts, {a, b})
            seen.append(choice)

    make(ours.ActiveMemoryManagerExtension, s, [Probe()]).run_once()
    assert seen == [
        (1000, 10, 2, True),
        (dict, {a: 1001, b: 10}, 1000),
        (b, 17, ({b}, set())),
        None,
    ]
    assert s.take() == {("replicate", b.address, "x")}


def test_bad_suggestion_op_raises() -> None:
    s = FakeScheduler()
    a = s.add_worker("a", 1)
    ts = s.add_task("x", 1, [a])

    class Bad(ActiveMemoryManagerPolicy):
        def run(self):
            yield Suggestion("move", ts)  # type: ignore[arg-type]

    amm = make(ours.ActiveMemoryManagerExtension, s, [Bad()])
    with pytest.raises(ValueError, match="Unknown op"):
        amm.run_once()


def test_bad_measure_names_key() -> None:
    with pytest.raises(ValueError, match="active-memory-manager.measure"):
        ours.ActiveMemoryManagerExtension(
            FakeScheduler(), policies=set(), register=False, start=False, measure="nope"
        )


class _Int(int):
    pass


class _Dict(dict):
    pass


@pytest.mark.parametrize("measure", MEASURES)
def test_worker_memory_read_in_rust_is_stocks(measure: str) -> None:
    """``AmmRun.read_workers`` computes ``getattr(ws.memory, measure)`` in Rust: the
    same figure as stock for every clamp of ``MemoryState``, and for inputs it leaves
    to Python (an int subclass, a bool, a dict subclass, a huge int)."""
    assert memory_formula_matches()
    rng = random.Random(measure)
    s = FakeScheduler()
    for i in range(300):
        ws = s.add_worker(f"w{i}", 0, rng.choice(STATUSES))
        big = rng.choice([10, 1 << 20, 1 << 40])
        ws.metrics = {
            "memory": rng.randrange(big),
            "spilled_bytes": {"memory": rng.randrange(big), "disk": rng.randrange(big)},
        }
        ws.nbytes = rng.randrange(big)
        ws._memory_unmanaged_old = rng.randrange(big)
    odd = list(s.workers.values())[:5]
    odd[0].metrics["memory"] = _Int(7)
    odd[1].metrics["spilled_bytes"]["disk"] = True
    odd[2].metrics = _Dict(odd[2].metrics)
    odd[3].metrics["spilled_bytes"] = _Dict(memory=1, disk=2)
    odd[4].nbytes = 1 << 62
    odd[4].metrics["spilled_bytes"]["memory"] = -(1 << 62)
    run = AmmRun.read_workers(s.workers.values(), s.running, Status.running, measure, WorkerState)
    for ws in s.workers.values():
        assert run.memory(ws) == getattr(ws.memory, measure), ws
        assert (ws in run) and (ws in s.running) == (ws.status == Status.running)


def test_worker_without_metrics_raises_as_stock() -> None:
    """A worker whose memory stock cannot read (no heartbeat metrics) fails the run in
    both managers with the same KeyError."""
    s = FakeScheduler()
    s.add_worker("a", 1).metrics = {}
    for cls in (stock.ActiveMemoryManagerExtension, ours.ActiveMemoryManagerExtension):
        with pytest.raises(KeyError, match="memory"):
            make(cls, s, [stock.ReduceReplicas()]).run_once()


@pytest.mark.parametrize("seed", range(20))
def test_keep_replicas_same_under_stock_manager(seed: int) -> None:
    """KeepReplicas plus our ReduceReplicas decide the same under the stock manager
    (generators) and ours (ReduceReplicas in bulk, honouring the targets)."""
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(2, 15), ntasks=rng.randint(5, 80))
    keys = rng.sample(sorted(s.tasks), rng.randint(1, 5))
    n = rng.choice([None, 1, 2, 3])

    def policies() -> list:
        return [ours.KeepReplicas(keys, n=n), ours.ReduceReplicas()]

    stock_dec, our_dec, _, _ = run_both(s, policies)
    assert our_dec == stock_dec


def test_keep_replicas_contract() -> None:
    s = FakeScheduler()
    a = s.add_worker("a", 50)
    b = s.add_worker("b", 10)
    c = s.add_worker("c", 30)
    d = s.add_worker("d", 0, Status.paused)
    s.add_task("x", 5, [a, d])
    s.add_task("y", 5, [a, b])
    s.add_task("z", 5, [c])
    keep = ours.KeepReplicas(["x", "y", "missing"], n=2)
    make(ours.ActiveMemoryManagerExtension, s, [keep, ours.ReduceReplicas()]).run_once()
    # x has one replica on a running worker: one more, on the least loaded (b);
    # ReduceReplicas then keeps 2 in total, releasing the paused worker's copy.
    # y already has 2 and is kept; z is not covered and has a single replica.
    assert s.take() == {("replicate", b.address, "x"), ("drop", d.address, "x")}

    everywhere = ours.KeepReplicas(["z"])
    make(ours.ActiveMemoryManagerExtension, s, [everywhere, ours.ReduceReplicas()]).run_once()
    # Every running worker (a, b, c), never the paused one; ReduceReplicas drops
    # the replicas of x and y beyond 1 since they are not covered any more.
    assert {act for act in s.take() if act[2] == "z"} == {
        ("replicate", a.address, "z"),
        ("replicate", b.address, "z"),
    }


class PendingProbe(ActiveMemoryManagerPolicy):
    """Records the whole ``pending`` dict and ``workers_memory`` as it sees them."""

    def __init__(self) -> None:
        self.seen: Any = None

    def run(self):
        self.seen = (
            {
                ts.key: (sorted(w.address for w in r), sorted(w.address for w in d))
                for ts, (r, d) in self.manager.pending.items()
            },
            {ws.address: m for ws, m in self.manager.workers_memory.items()},
        )
        return
        yield


@pytest.mark.parametrize("seed", range(20))
def test_bulk_policies_leave_stock_pending_for_later_policies(seed: int) -> None:
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(2, 20), ntasks=rng.randint(1, 120))
    retiring = rng.choice(list(s.workers.values())).address

    def policies() -> list:
        return [stock.ReduceReplicas(), stock.RetireWorker(retiring), PendingProbe()]

    stock_dec, our_dec, sp, op = run_both(s, policies)
    assert op[2].seen == sp[2].seen
    assert our_dec == stock_dec


def test_subclass_overriding_run_is_not_run_in_bulk() -> None:
    s = FakeScheduler()
    a = s.add_worker("a", 1)
    b = s.add_worker("b", 2)
    s.add_task("x", 1, [a, b])

    class Quiet(stock.ReduceReplicas):
        def run(self):
            return
            yield

    make(ours.ActiveMemoryManagerExtension, s, [Quiet()]).run_once()
    assert s.take() == set()
    make(ours.ActiveMemoryManagerExtension, s, [ours.ReduceReplicas()]).run_once()
    assert s.take() == {("drop", b.address, "x")}


def amm_log(cls: type, s: FakeScheduler, make_policies, per_task: bool) -> list[str]:
    """The lines one run logs on ``distributed.active_memory_manager`` (DEBUG), with
    the per-task child logger at DEBUG or INFO; the per-worker enactment lines (whose
    order follows set iteration in stock) sorted."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    main, tasks = stock.logger, stock.task_logger
    saved = main.level, tasks.level, main.propagate
    main.addHandler(handler)
    main.setLevel(logging.DEBUG)
    main.propagate = False
    tasks.setLevel(logging.DEBUG if per_task else logging.INFO)
    try:
        make(cls, s, make_policies()).run_once()
    finally:
        main.removeHandler(handler)
        main.setLevel(saved[0])
        tasks.setLevel(saved[1])
        main.propagate = saved[2]
    s.take()
    lines = [ln for ln in stream.getvalue().splitlines() if "run in" not in ln]
    head = [ln for ln in lines if not ln.startswith("- ")]
    return head + sorted(ln for ln in lines if ln.startswith("- "))


@pytest.mark.parametrize("per_task", [True, False])
@pytest.mark.parametrize("seed", range(15))
def test_log_records_are_stocks(seed: int, per_task: bool) -> None:
    """Same records, same messages, on stock's loggers, as the stock manager logs."""
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(2, 12), ntasks=rng.randint(1, 40))
    retiring = rng.choice(list(s.workers.values())).address

    def policies() -> list:
        out = [stock.ReduceReplicas(), RandomPolicy(seed), stock.RetireWorker(retiring)]
        return out[::-1] if seed % 2 else out  # each bulk policy runs last sometimes

    want = amm_log(stock.ActiveMemoryManagerExtension, s, policies, per_task)
    got = amm_log(ours.ActiveMemoryManagerExtension, s, policies, per_task)
    assert got == want
    assert any(ln.startswith("Running policy: ReduceReplicas()") for ln in got)


def random_change(rng: random.Random, s: FakeScheduler, big: int = 1 << 20) -> None:
    """One change a real cluster makes between two AMM runs, through the paths the
    real scheduler uses (replica bookkeeping, transitions, work stealing)."""
    workers = list(s.workers.values())
    in_memory = [ts for ts in s.tasks.values() if ts.state == "memory" and ts.who_has]
    waiting = [ts for ts in s.tasks.values() if ts.state in ("processing", "waiting")]
    kind = rng.randrange(8)
    if kind <= 1 and in_memory:
        s.add_replica(rng.choice(in_memory), rng.choice(workers))
    elif kind == 2 and in_memory:
        ts = rng.choice(in_memory)
        s.remove_replica(ts, rng.choice(sorted(ts.who_has, key=lambda w: w.address)))
    elif kind == 3 and in_memory:
        s.add_waiter(rng.choice(in_memory), f"w{rng.random()}", rng.choice([*workers, None]))
    elif kind == 4 and waiting:
        s.finish_waiter(rng.choice(waiting))
    elif kind == 5 and waiting:
        s.steal(rng.choice(waiting), rng.choice(workers))
    elif kind == 6:
        ws = rng.choice(workers)  # a heartbeat: new memory, still distinct
        mem = (len(s.tasks) * 4000 + 1 + rng.randrange(1000 * len(workers))) * big
        mem += workers.index(ws)
        ws.metrics["memory"] = ws._memory_unmanaged_old = mem
    elif kind == 7:
        ws = rng.choice(workers)
        ws.status = rng.choice([Status.running, Status.paused, Status.closing_gracefully])
        if ws.status == Status.running:
            s.running.add(ws)
        else:
            s.running.discard(ws)


@pytest.mark.parametrize("seed", range(40))
def test_tracked_runs_same_decisions_over_random_changes(seed: int) -> None:
    """Ours keeps its ReplicaTracker across runs; between runs the cluster changes at
    random and the drops of the previous run are applied (as the real scheduler
    does). Every run decides as stock on the same state; ``validate`` makes every
    tracked run also check the tracker against a full scan."""
    rng = random.Random(seed)
    s = random_state(rng, nworkers=rng.randint(2, 15), ntasks=rng.randint(5, 80))
    keep = sorted(s.tasks)[: rng.randint(0, 2)]
    twice = rng.random() < 0.3

    def policies() -> list:
        out: list = [ours.ReduceReplicas()]
        if keep:
            out.insert(0, ours.KeepReplicas(keep, n=2))
        if twice:  # the stock class: under ours it honours KeepReplicas, not under stock
            out.append(ours.ReduceReplicas() if keep else stock.ReduceReplicas())
        return out

    our_policies = policies()
    our_amm = make(ours.ActiveMemoryManagerExtension, s, our_policies)
    stats: list = []
    for step in range(12):
        for _ in range(rng.randint(0, 6)):
            random_change(rng, s)
        make(stock.ActiveMemoryManagerExtension, s, policies()).run_once()
        stock_dec = s.take()
        s.apply_drops = True
        our_amm.run_once()
        s.apply_drops = False
        assert s.take() == stock_dec, (step, stats)
        stats.append(our_amm._tracker.last_run)
    assert not any(full for full, _, _ in stats[1:])  # only the first run scans all


def _orderings_seen(s: FakeScheduler, rounds: int, change: Callable[[], None]) -> set[bool]:
    """Run a tracked ReduceReplicas ``rounds`` times, calling ``change``
    before each; which orderings (by scan or not) its tracked runs needed."""
    seen = set()
    amm = make(ours.ActiveMemoryManagerExtension, s, [ours.ReduceReplicas()])
    for _ in range(rounds):
        change()
        s.apply_drops = True
        amm.run_once()
        s.apply_drops = False
        s.take()
        full, looked_at, ordered = amm._tracker.last_run
        if not full and looked_at:
            seen.add(ordered)
    return seen


def test_tracked_runs_exercise_both_orderings() -> None:
    """Across random sequences and bursts of new replicas (see the next test),
    tracked runs both skip and need the pass that recovers stock's order (the
    tests above and below then prove both right)."""
    seen: set[bool] = set()
    for seed in range(40):
        rng = random.Random(seed)
        s = random_state(rng, nworkers=rng.randint(2, 15), ntasks=rng.randint(5, 80))

        def some_changes(rng: random.Random = rng, s: FakeScheduler = s) -> None:
            for _ in range(rng.randint(1, 6)):
                random_change(rng, s)

        seen |= _orderings_seen(s, 8, some_changes)
    for seed in range(5):
        rng = random.Random(seed)
        s = burst_state(rng)
        seen |= _orderings_seen(s, 6, lambda rng=rng, s=s: burst(rng, s))
    assert seen == {True, False}


def burst_state(rng: random.Random) -> FakeScheduler:
    """A few workers, tens of tasks: room for bursts of order-dependent drops."""
    return random_state(rng, nworkers=rng.randint(3, 5), ntasks=rng.randint(30, 60), p_waiters=0.1)


def burst(rng: random.Random, s: FakeScheduler) -> None:
    """New replicas of 10-30 random in-memory tasks on random workers, with sizes
    close to the memory gaps between workers."""
    workers = list(s.workers.values())
    in_memory = [ts for ts in s.tasks.values() if ts.state == "memory" and ts.who_has]
    for ts in rng.sample(in_memory, min(len(in_memory), rng.randint(10, 30))):
        s.add_replica(ts, rng.choice(workers))


def test_scheduler_without_hooks_scans_every_run() -> None:
    class Plain(FakeScheduler):
        send_task_to_worker = None  # type: ignore[assignment]

    s = Plain()
    a, b = s.add_worker("a", 1), s.add_worker("b", 2)
    s.add_task("x", 1, [a, b])
    amm = make(ours.ActiveMemoryManagerExtension, s, [ours.ReduceReplicas()])
    amm.run_once()
    assert amm._replica_tracker() is None
    assert s.take() == {("drop", b.address, "x")}


def _bursts_decide_as_stock(rng: random.Random, s: FakeScheduler, rounds: int = 6) -> set[bool]:
    """Bursts of new replicas, then stock's and our (tracked) ReduceReplicas on the
    same state: the same drops every round. Returns which orderings (by stock's
    set order or not) our tracked runs needed."""
    our_amm = make(ours.ActiveMemoryManagerExtension, s, [ours.ReduceReplicas()])
    ordered = set()
    for _ in range(rounds):
        burst(rng, s)
        make(stock.ActiveMemoryManagerExtension, s, [stock.ReduceReplicas()]).run_once()
        stock_dec = s.take()
        s.apply_drops = True
        our_amm.run_once()
        s.apply_drops = False
        assert s.take() == stock_dec
        full, _, by_order = our_amm._tracker.last_run
        if not full:
            ordered.add(by_order)
    return ordered


@pytest.mark.parametrize("seed", range(30))
def test_tracked_runs_same_decisions_when_order_matters(seed: int) -> None:
    """Bursts of new replicas on a few workers with sizes close to the memory gaps:
    many tasks get drops in one tracked run and their choices depend on the order
    they are decided in, which must be stock's (read from the set's table)."""
    rng = random.Random(seed)
    _bursts_decide_as_stock(rng, burst_state(rng))


class _SetSubclass(set):
    """Iterates as a set, but is not an exact ``set``: its table is not read."""


def test_tracked_runs_same_decisions_when_order_matters_and_tasks_are_no_set() -> None:
    """Where ``replicated_tasks`` is not an exact set, stock's order comes from
    iterating it; decisions are stock's all the same."""
    ordered: set[bool] = set()
    for seed in range(12):
        rng = random.Random(seed)
        s = burst_state(rng)
        s.replicated_tasks = _SetSubclass(s.replicated_tasks)
        ordered |= _bursts_decide_as_stock(rng, s)
    assert True in ordered  # the order was needed, and recovered by iteration


def test_many_over_replicated_tasks_mean_full_scans_until_few() -> None:
    """A full scan that finds more over-replicated tasks than the tracker keeps
    (16384) leaves the next run a full scan; once the drops are enacted, runs are
    incremental again. Decisions equal stock's throughout."""
    rng = random.Random(5)
    s = FakeScheduler()
    workers = [s.add_worker(f"w{i}", (10_000 + i) << 20) for i in range(8)]
    for k in range(16_500):
        s.add_task(f"k{k}", 1 + rng.randrange(4), rng.sample(workers, 2))
    amm = make(ours.ActiveMemoryManagerExtension, s, [ours.ReduceReplicas()])
    seen = []
    for _ in range(3):
        make(stock.ActiveMemoryManagerExtension, s, [stock.ReduceReplicas()]).run_once()
        stock_dec = s.take()
        s.apply_drops = True
        amm.run_once()
        s.apply_drops = False
        assert s.take() == stock_dec
        seen.append((amm._tracker.last_run[0], len(stock_dec)))
    assert seen == [(True, 16_500), (True, 0), (False, 0)]


def test_tracker_hub_reports_to_every_live_tracker() -> None:
    """The scheduler hooks' hub holds trackers weakly, however many there are (the
    first four without allocating), and reports each change to every live one."""
    from dask_shm._core import ReplicaTracker, TrackerHub

    s = FakeScheduler()
    a = s.add_worker("a", 1)
    ts = s.add_task("x", 1, [a])  # not replicated: only a report makes a run look
    hub = TrackerHub()
    trackers = [ReplicaTracker() for _ in range(6)]
    for tracker in trackers:
        hub.add(tracker)
    assert len(hub) == 6
    del trackers[0]
    assert len(hub) == 5
    run = AmmRun.read_workers(s.workers.values(), s.running, Status.running, "optimistic")
    for tracker in trackers:  # a first, full run each: then changes are tracked
        run.reduce_replicas_tracked(tracker, s.replicated_tasks, {})
    for tracker in trackers:
        run.reduce_replicas_tracked(tracker, s.replicated_tasks, {})
        assert tracker.last_run[:2] == (False, 0)
    hub.touch(ts)
    for tracker in trackers:
        run.reduce_replicas_tracked(tracker, s.replicated_tasks, {})
        assert tracker.last_run[:2] == (False, 1)
