"""Whose code holds a worker's event loop during its long callbacks (for benches).

distributed's ``tick-duration`` metric says how long a worker's event loop
went without ticking, not what ran meanwhile. :class:`LoopAttribution`, a
worker plugin, answers that: it times every callback the worker's asyncio
loop runs (``asyncio.Handle._run``, process-wide while installed) and, from a
thread, samples the loop thread's Python stack every ``interval`` seconds.
Each sample is charged to the package of the innermost frame that belongs to
dask-shm or to distributed (numpy, pickle, the standard library are charged
to whichever of the two called them): work our code does on the loop, Rust
calls included, is ``"dask_shm"``; work distributed does for itself is
``"distributed"``; a sample with neither (tornado, asyncio itself) is
``"other"``. A garbage collection holds the GIL throughout, so no sample
can be taken while it runs: its time is measured (``gc.callbacks``) and
charged to ``"gc"``, and the samples share the rest.

For every callback that ran ``threshold`` seconds or more, :meth:`report`
gives its duration, the loop thread's CPU time in it, the seconds estimated
for each owner (the owner's share of the callback's samples times its
duration; ``owner_cpu_seconds``: times its CPU time) and the functions most
often innermost, so a bench can say whether dask-shm's part of any long
callback stayed under the threshold. Few samples in a long callback mean the
sampler could not get the GIL: another thread held it (a task, an
offloaded (de)serialization), and the loop thread mostly waited for it too,
which its CPU time then shows.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

from distributed import WorkerPlugin

_OWNERS = (
    ("dask_shm", f"{os.sep}dask_shm{os.sep}"),
    ("distributed", f"{os.sep}distributed{os.sep}"),
)


def owner_of(frame: FrameType | None) -> tuple[str, str]:
    """``(owner, function)`` of the innermost frame of ``frame``'s stack
    (``frame`` being the innermost) that is dask-shm's or distributed's;
    ``("other", innermost function)`` when none is."""
    innermost = frame
    while frame is not None:
        filename = frame.f_code.co_filename
        for owner, marker in _OWNERS:
            if marker in filename:
                return owner, f"{os.path.basename(filename)}:{frame.f_code.co_name}"
        frame = frame.f_back
    name = innermost.f_code.co_name if innermost is not None else "?"
    return "other", name


@dataclass
class SlowCallback:
    """One callback that held the loop ``seconds`` or more than the threshold."""

    #: ``time.perf_counter()`` in the worker when the callback began
    started: float
    seconds: float
    #: CPU time of the loop thread during the callback
    cpu_seconds: float
    callback: str
    samples: int
    #: estimated seconds by owner ("dask_shm", "distributed", "other", "gc",
    #: "unsampled" when no sample was taken outside garbage collection)
    owner_seconds: dict[str, float]
    #: the same shares of ``cpu_seconds`` (garbage collection: its wall time)
    owner_cpu_seconds: dict[str, float]
    #: the most frequent innermost owned functions, with their sample counts
    top: list[tuple[str, int]] = field(default_factory=list)


class _Sampler:
    """State shared by the patched ``Handle._run`` and the sampling thread."""

    def __init__(self, loop_thread: int, threshold: float, interval: float | None):
        self.loop_thread = loop_thread
        self.threshold = threshold
        self.interval = interval
        self.started: float | None = None
        self.cpu_started = 0.0
        self.samples: collections.Counter[tuple[str, str]] = collections.Counter()
        self.slow: list[SlowCallback] = []
        self.callbacks = 0
        self.stop = threading.Event()
        #: seconds of garbage collection since the running callback began
        self.gc_seconds = 0.0
        self._gc_started: float | None = None

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` hook: any collection (whichever thread runs it)
        holds the GIL, so it blocks the loop."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            if self.started is not None:
                self.gc_seconds += time.perf_counter() - max(self._gc_started, self.started)
            self._gc_started = None

    def sample_forever(self) -> None:
        while not self.stop.wait(self.interval):
            if self.started is None:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            if self.started is not None and frame is not None:
                self.samples[owner_of(frame)] += 1
            del frame

    def begin(self) -> None:
        self.samples.clear()
        self.gc_seconds = 0.0
        self.cpu_started = time.thread_time()
        self.started = time.perf_counter()

    def end(self, handle: asyncio.Handle) -> None:
        started, self.started = self.started, None
        if started is None:
            return
        self.callbacks += 1
        seconds = time.perf_counter() - started
        if seconds < self.threshold:
            return
        cpu_seconds = time.thread_time() - self.cpu_started
        samples = dict(self.samples)
        total = sum(samples.values())
        gc_seconds = min(self.gc_seconds, seconds)
        by_owner: dict[str, float] = collections.defaultdict(float)
        by_owner_cpu: dict[str, float] = collections.defaultdict(float)
        if gc_seconds:
            by_owner["gc"] = by_owner_cpu["gc"] = gc_seconds
        cpu_left = max(0.0, cpu_seconds - gc_seconds)
        functions: collections.Counter[str] = collections.Counter()
        for (owner, function), n in samples.items():
            by_owner[owner] += (seconds - gc_seconds) * n / total
            by_owner_cpu[owner] += cpu_left * n / total
            functions[f"{owner} {function}"] += n
        if not total and seconds > gc_seconds:
            by_owner["unsampled"] = seconds - gc_seconds
            by_owner_cpu["unsampled"] = cpu_left
        self.slow.append(
            SlowCallback(
                started=started,
                seconds=seconds,
                cpu_seconds=cpu_seconds,
                callback=repr(handle)[:300],
                samples=total,
                owner_seconds=dict(by_owner),
                owner_cpu_seconds=dict(by_owner_cpu),
                top=functions.most_common(5),
            )
        )


class LoopAttribution(WorkerPlugin):
    """Register on a cluster's workers (``client.register_plugin``); read
    each worker's :meth:`report` with ``client.run``."""

    name = "dask-shm-bench-loop-attribution"

    def __init__(self, threshold: float = 0.1, interval: float | None = 0.002):
        #: None: callbacks are timed, not sampled (their time is "unsampled"),
        #: for runs whose wall time should not include a thread taking the
        #: GIL every ``interval`` seconds.
        self.threshold = threshold
        self.interval = interval
        self._sampler: _Sampler | None = None
        self._original: Any = None

    def setup(self, worker: Any) -> None:
        sampler = _Sampler(threading.get_ident(), self.threshold, self.interval)
        original = asyncio.Handle._run
        loop_thread = sampler.loop_thread

        def _run(handle: asyncio.Handle) -> None:
            if threading.get_ident() != loop_thread:
                return original(handle)
            sampler.begin()
            try:
                return original(handle)
            finally:
                sampler.end(handle)

        asyncio.Handle._run = _run  # type: ignore[method-assign,assignment]
        gc.callbacks.append(sampler.on_gc)
        self._sampler, self._original = sampler, original
        if self.interval is not None:
            threading.Thread(target=sampler.sample_forever, daemon=True, name=self.name).start()

    def teardown(self, worker: Any) -> None:
        if self._sampler is not None:
            self._sampler.stop.set()
            asyncio.Handle._run = self._original  # type: ignore[method-assign,assignment]
            gc.callbacks.remove(self._sampler.on_gc)
            self._sampler = None

    def samples_in_running_callback(self) -> int:
        """Stack samples taken so far in the callback that is running."""
        return 0 if self._sampler is None else sum(self._sampler.samples.values())

    def reset(self) -> None:
        """Forget the slow callbacks seen so far (e.g. the cluster's start)."""
        if self._sampler is not None:
            self._sampler.slow.clear()
            self._sampler.callbacks = 0

    def report(self) -> dict[str, Any]:
        """``callbacks`` timed, and every slow one (:class:`SlowCallback` as
        a dict), longest first."""
        sampler = self._sampler
        if sampler is None:
            return {"callbacks": 0, "slow": []}
        slow = sorted(sampler.slow, key=lambda s: s.seconds, reverse=True)
        return {"callbacks": sampler.callbacks, "slow": [asdict(s) for s in slow]}


def reset(dask_worker: Any) -> None:
    """``client.run(reset)``: :meth:`LoopAttribution.reset` on each worker."""
    dask_worker.plugins[LoopAttribution.name].reset()


def report(dask_worker: Any) -> dict[str, Any]:
    """``client.run(report)``: :meth:`LoopAttribution.report` of each worker."""
    return dask_worker.plugins[LoopAttribution.name].report()  # type: ignore[no-any-return]


def summary(reports: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Over all workers: callbacks timed, slow ones, the longest, and the
    most seconds any slow callback spent in dask-shm's code, distributed's
    and garbage collection, and in dask-shm's code on the CPU."""
    slow = [s for r in reports.values() for s in r["slow"]]
    return {
        "callbacks": sum(r["callbacks"] for r in reports.values()),
        "slow_callbacks": len(slow),
        "max_callback_ms": 1000 * max((s["seconds"] for s in slow), default=0.0),
        "max_dask_shm_ms": 1000
        * max((s["owner_seconds"].get("dask_shm", 0.0) for s in slow), default=0.0),
        "max_distributed_ms": 1000
        * max((s["owner_seconds"].get("distributed", 0.0) for s in slow), default=0.0),
        "max_gc_ms": 1000 * max((s["owner_seconds"].get("gc", 0.0) for s in slow), default=0.0),
        "max_dask_shm_cpu_ms": 1000
        * max((s["owner_cpu_seconds"].get("dask_shm", 0.0) for s in slow), default=0.0),
    }
