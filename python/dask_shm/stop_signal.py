"""A stop flag for a background thread that wakes every few milliseconds.

A worker's periodic threads (the share publisher, 20 times a second; the
tier-2 relief, 10 times) sleep between rounds in ``wait(interval)``. With
``threading.Event`` each of those waits runs ``Condition.wait`` in Python: a
fresh lock allocated, taken twice, a waiter list updated. On the 2-core dev
box a thread doing nothing but ``Event.wait(0.05)`` used 5.1 ms of CPU a
second, against 2.4-2.5 ms for one waiting on a lock with a timeout (C code
from the call to the wake), which is what :class:`StopSignal` does.
"""

from __future__ import annotations

import threading


class StopSignal:
    """``set()`` once, from any thread; ``wait(timeout)`` returns True as
    soon as it is set (at once if it already is), False after ``timeout``
    seconds otherwise. Meant for one waiting thread (more work, each woken
    in turn)."""

    def __init__(self) -> None:
        self._set = False
        self._guard = threading.Lock()
        #: held until set(): a waiter's acquire times out until then
        self._released = threading.Lock()
        self._released.acquire()

    def set(self) -> None:
        with self._guard:
            if self._set:
                return
            self._set = True
            self._released.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        if self._set:
            return True
        if self._released.acquire(timeout=max(0.0, timeout)):
            self._released.release()  # the next wait returns at once too
            return True
        return self._set
