"""An in-memory LRU charged for bytes held outside its values.

A shared-memory worker's tmpfs files (tier 2) are RAM: the worker's memory
monitor and the nanny count them (see :mod:`dask_shm.shared.monitor`), and
so does the memory cgroup. Stock's spill buffer keeps its in-memory values
below ``target``; if ours kept its values below ``target`` *and* held a full
tier 2 besides, the worker would sit above its target with every spill, and
near its pause and terminate thresholds with a little unmanaged memory on top.

So the LRU counts those bytes (the *charge*) as already used (zict's
``offset``): values are evicted once ``in-memory weight + charge > target``.
The charge is capped at half the target, so in-memory values always have at
least half of it: a tier 2 larger than that (an explicit
``shm.shared-memory.max-bytes`` above the target) would otherwise have every
value, even those costing nothing because they are mapped from their file,
evicted as soon as it is inserted. With ``max-bytes: auto`` the budget stays
below the cap (0.3 x the memory limit against a 0.6 target).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import zict


class ChargedLRU(zict.LRU):
    """:class:`zict.LRU` whose ``offset`` includes ``charge()`` (at most
    half of ``n``), read at every eviction decision; everything else is
    zict's contract. Setting ``offset`` sets the part added on top of that
    charge."""

    def __init__(
        self,
        n: float,
        d: MutableMapping[Any, Any],
        *,
        charge: Callable[[], float],
        **kwargs: Any,
    ):
        self._charge = charge
        self._extra_offset: float = 0
        super().__init__(n, d, **kwargs)

    @property  # type: ignore[override]
    def offset(self) -> float:
        return self._extra_offset + min(self._charge(), self.n / 2)

    @offset.setter
    def offset(self, value: float) -> None:
        self._extra_offset = value
