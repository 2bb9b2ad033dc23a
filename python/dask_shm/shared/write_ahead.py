"""Which fresh values to write out before a peer asks for them.

Handing a value still in a worker's private memory to a same-host peer first
writes it into the tmpfs, when the peer's request arrives: on 4 KiB tmpfs
pages that write (about 0.4 ms per MiB) sits on the critical path of every
hand-over, where stock's socket copy overlaps with the peer's read. Written
as soon as the value is stored, on a thread of its own, the file is ready
(or nearly) when the request comes, a scheduler round trip later.

A write nobody needed costs CPU and makes the owner's later reads go through
a mapping of 4 KiB pages. :class:`ExportForecast` therefore writes ahead only
values of task prefixes (``key_split``) whose earlier values this worker
handed to a peer almost every time (:data:`MIN_SHARE`): a chain of tasks
alternating between workers, a block every worker of an all-to-all needs.
In dask's tree reductions and element-wise graphs a third or less of a
prefix's values move (measured in docs/benchmarks.md), and those prefixes
are left alone.
"""

from __future__ import annotations

import threading

from dask.typing import Key
from dask.utils import key_split

#: A prefix is written ahead once at least this share of its values went to a peer.
MIN_SHARE = 0.8
#: ... out of at least this many values whose fate is known.
MIN_SEEN = 8
#: Counts are halved when this many values are known, so that the forecast
#: follows a prefix whose use changes (a long-lived cluster runs many graphs).
WINDOW = 64


class ExportForecast:
    """Per task prefix, the share of stored values that went to a peer.

    :meth:`stored` opens a value (and says whether to write it ahead),
    :meth:`exported` closes it as fetched and :meth:`deleted` as not; a key
    never opened is ignored by both. Thread-safe: stores and deletes happen
    on the event loop, exports also on distributed's offload thread."""

    def __init__(
        self, min_share: float = MIN_SHARE, min_seen: int = MIN_SEEN, window: int = WINDOW
    ) -> None:
        if not 0 < min_share <= 1:
            raise ValueError(f"min_share must be in (0, 1], got {min_share!r}")
        if not 0 < min_seen <= window // 2:
            raise ValueError(f"min_seen must be in [1, window / 2], got {min_seen!r}")
        self.min_share = min_share
        self.min_seen = min_seen
        self.window = window
        #: key -> prefix of values stored and neither exported nor deleted yet
        self._open: dict[Key, str] = {}
        #: prefix -> [values exported, values known]
        self._counts: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def stored(self, key: Key) -> bool:
        """``key`` now holds a fresh value: whether to write it ahead."""
        prefix = key_split(key)
        with self._lock:
            self._open[key] = prefix
            exported, known = self._counts.get(prefix, (0, 0))
        return known >= self.min_seen and exported >= self.min_share * known

    def exported(self, key: Key) -> None:
        """``key``'s value was handed to a peer."""
        self._close(key, True)

    def deleted(self, key: Key) -> None:
        """``key``'s value left the worker (or was replaced)."""
        self._close(key, False)

    def share(self, prefix: str) -> tuple[int, int]:
        """(values exported, values known) of ``prefix`` in the current window."""
        with self._lock:
            exported, known = self._counts.get(prefix, (0, 0))
        return exported, known

    def _close(self, key: Key, exported: bool) -> None:
        if key not in self._open:  # most deletes: keep them cheap
            return
        with self._lock:
            prefix = self._open.pop(key, None)
            if prefix is None:
                return
            counts = self._counts.setdefault(prefix, [0, 0])
            counts[0] += exported
            counts[1] += 1
            if counts[1] >= self.window:
                counts[0] //= 2
                counts[1] //= 2
