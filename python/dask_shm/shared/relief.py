"""Tier 2 gives way to a worker's memory pressure, as stock's spilling does.

In shared mode a worker's memory, for its memory manager and its nanny, is
its private memory plus its share of its tier-2 (tmpfs) files
(:mod:`~dask_shm.shared.monitor`). Above the ``spill`` threshold, stock
moves values from memory to disk until the process is below ``target``, and
files on disk count nothing. distributed's spilling evicts only values held
in memory (``data.fast``) and stops when there are none, so a full tier 2
would stay counted while, say, a shuffle's transient private memory grows,
and the nanny would restart at ``terminate`` a worker that stock keeps.

:class:`Tier2Relief` is the missing half: a thread that every
``interval`` seconds compares the worker's memory with its thresholds and

- above ``spill``: caps tier 2 at what ``target`` leaves beside the rest of
  the worker's memory and moves tier 2's least recently used files over that
  cap to the next tier (disk), in steps of at most
  :data:`~dask_shm.shared.tiers.MOVE_STEP` bytes, each
  under the buffer's operation lock and with a pause between them in which
  a waiting thread takes it, so the event loop waits one step at most;
- below ``target``: raises the cap as the rest of the memory shrinks, back
  to the configured budget.

Files mapped by values in memory (pinned) stay: distributed's eviction of
those values unpins them, and the next check moves them. Between ``target``
and ``spill`` the cap stays as it is (stock's hysteresis).

The cap is also set right before the buffer writes a value out to make room
(:meth:`Tier2Relief.before_spill`, at most every :data:`SPILL_RECHECK`
seconds): a value spilled while the worker is over ``spill`` then goes to
disk at once, as stock's does. Left to the thread, it could be written to
tmpfs and moved to disk a moment later: written twice, and for the time of
the first write held twice in RAM (its private copy and its tmpfs file),
which is above stock's peak, since stock's copy goes to the page cache.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from dask.utils import format_bytes

from dask_shm.shared.monitor import worker_alive
from dask_shm.shared.tiers import MOVE_STEP
from dask_shm.stop_signal import StopSignal

if TYPE_CHECKING:
    from distributed import Worker

    from dask_shm.shared.buffer import SharedSpillBuffer

logger = logging.getLogger(__name__)

#: seconds between two steps, for threads waiting on the lock to take it
STEP_PAUSE = 0.0005
#: seconds a cap set by :meth:`Tier2Relief.before_spill` stands for the next
#: spills (each check reads the process's memory: about 25 us)
SPILL_RECHECK = 0.01


class Tier2Relief:
    """Keeps ``buffer``'s tier 2 within what the worker's memory allows.

    ``memory()``: the worker's memory as its memory manager counts it (tier
    2's share included); ``limit``: its memory limit in bytes; ``spill``,
    ``target``: distributed's fractions of it (``target`` <= ``spill``).
    The thread (``start``) ends on :meth:`stop` or once ``alive()`` is false.
    """

    def __init__(
        self,
        buffer: SharedSpillBuffer,
        memory: Callable[[], int],
        *,
        limit: int,
        spill: float,
        target: float,
        interval: float = 0.1,
        alive: Callable[[], bool] = lambda: True,
    ):
        if not 0 < target <= spill:
            raise ValueError(f"need 0 < target ({target}) <= spill ({spill})")
        self._buffer = buffer
        self._memory = memory
        self.spill_bytes = int(limit * spill)
        self.target_bytes = int(limit * target)
        self.interval = interval
        self._alive = alive
        self._stop = StopSignal()
        self._thread = threading.Thread(
            target=self._run, name="dask-shm tier-2 relief", daemon=True
        )
        #: whether tier 2's budget is below its configured one now
        self.capped = False
        #: times tier 2 was capped, and bytes moved to the next tier by relief
        self.episodes = 0
        self.moved_bytes = 0
        # Guards capped, episodes and _cap_checked, which the thread and a
        # spilling thread both update (moved_bytes is the thread's alone).
        # Never held around a call into the buffer: the buffer calls
        # before_spill with its own locks held.
        self._state_lock = threading.Lock()
        self._cap_checked = -SPILL_RECHECK

    def start(self) -> Tier2Relief:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and give tier 2 its configured budget back."""
        if self._buffer.before_spill == self.before_spill:
            self._buffer.before_spill = None
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.capped:
            self._buffer.cap_tier2(None)
            self.capped = False

    def check(self) -> int:
        """One check: set tier 2's cap from the worker's memory now and move
        what is over it. Returns the bytes moved."""
        if not self.update_cap():
            return 0
        moved = 0
        while not self._stop.is_set() and (step := self._buffer.relieve_tier2(MOVE_STEP)):
            moved += step
            # A thread waiting for the buffer's lock gets it now: Python's
            # locks are not fair, and taking it again at once would make it
            # wait for the whole move rather than one step.
            if self._stop.wait(STEP_PAUSE):
                break
        self.moved_bytes += moved
        return moved

    def update_cap(self) -> bool:
        """Set tier 2's cap from the worker's memory now (moves nothing);
        False when the cap stays as it is (between ``target`` and ``spill``,
        or below ``target`` with no cap)."""
        memory = self._memory()
        rest = memory - self._buffer.tier2_bytes()
        room = self.target_bytes - rest
        if memory > self.spill_bytes:
            cap: int | None = max(0, room)
        elif self.capped and memory < self.target_bytes:
            cap = room
        else:
            return False
        ceiling = self._buffer.store.tiers.first_ceiling
        if cap is not None and cap >= ceiling:
            cap = None
        budget = self._buffer.cap_tier2(cap)
        with self._state_lock:
            was_capped, self.capped = self.capped, cap is not None
            if self.capped and not was_capped:
                self.episodes += 1
        if self.capped and not was_capped:
            logger.info(
                "dask-shm: worker memory %s is over %s (spill): tier 2 capped at %s of %s, "
                "its least recently used files move to disk",
                format_bytes(memory),
                format_bytes(self.spill_bytes),
                format_bytes(budget),
                format_bytes(ceiling),
            )
        elif was_capped and not self.capped:
            logger.info("dask-shm: tier 2 back to its budget of %s", format_bytes(budget))
        return True

    def before_spill(self) -> None:
        """Called by the buffer right before it writes a value out to make
        room: sets the cap from the memory now, unless it was set less than
        :data:`SPILL_RECHECK` seconds ago by this call, so that the value
        goes where the thread's next check would have left it. Never raises:
        a failed check leaves the cap to the thread, and the spill goes on."""
        now = time.monotonic()
        with self._state_lock:
            if now - self._cap_checked < SPILL_RECHECK:
                return
            self._cap_checked = now
        try:
            self.update_cap()
        except Exception:  # a closed buffer, a vanished directory
            logger.debug("dask-shm: tier-2 cap before a spill", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self._alive():
            try:
                self.check()
            except Exception:  # a closed buffer, a vanished directory
                logger.debug("dask-shm: tier-2 relief", exc_info=True)


def start_for_worker(worker: Worker, buffer: SharedSpillBuffer) -> Tier2Relief | None:
    """Start a :class:`Tier2Relief` for ``buffer`` with ``worker``'s memory
    limit, thresholds and monitor interval, counting memory as the worker's
    monitor does; None when the worker spills by neither process memory
    (``spill``) nor managed memory (``target``), or has no limit: stock then
    keeps everything in memory too. With ``spill`` off, ``target`` is both
    thresholds (stock's own spilling then keeps what is in memory below it)."""
    manager = worker.memory_manager
    limit = manager.memory_limit
    spill = manager.memory_spill_fraction or manager.memory_target_fraction
    if not limit or not spill:
        return None
    worker_ref = weakref.ref(worker)

    def memory() -> int:
        w = worker_ref()
        return 0 if w is None else int(w.monitor.get_process_memory())

    tier2_relief = Tier2Relief(
        buffer,
        memory,
        limit=limit,
        spill=spill,
        target=min(manager.memory_target_fraction or spill, spill),
        interval=manager.memory_monitor_interval or 0.1,
        alive=worker_alive(worker),
    )
    buffer.before_spill = tier2_relief.before_spill
    return tier2_relief.start()
