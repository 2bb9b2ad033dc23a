"""SpillBuffer: a drop-in for ``distributed.spill.SpillBuffer`` on a Rust file store."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Literal, NoReturn, TypeVar, cast

import zict
from dask.typing import Key
from distributed.metrics import context_meter
from distributed.sizeof import safe_sizeof
from distributed.spill import SpilledSize

from dask_shm._core import SpillFileError
from dask_shm.charged_lru import ChargedLRU
from dask_shm.config import byte_size, spill_compression, spill_limit, spill_recycle_bytes
from dask_shm.spill_store import MaxSpillExceeded, PickleError, SpillStore

# Stock's logger, messages and rate limits (distributed.spill installs its
# RateLimiterFilters on import): people configure exactly this logger to debug
# memory (distributed.logging), and tests capture it.
logger = logging.getLogger("distributed.spill")


class _Handled(Exception):
    """Internal: a spill failure that was logged and left the key in memory."""


def _in_memory_weight(key: Key, value: object) -> int:
    return safe_sizeof(value)


F = TypeVar("F", bound=Callable[..., Any])


def _serialized(method: F) -> F:
    """Run ``method`` holding the buffer's operation lock.

    zict.Buffer releases its own lock while it reads or writes the slow
    store, so an eviction in one thread can interleave with a write or read
    of the same key in another and lose the key or return a superseded value
    (stock's SpillBuffer has the same race). Public operations of this buffer
    run one at a time instead: in a worker they come almost only from the
    event loop thread, so nothing is lost by it.
    """

    @functools.wraps(method)
    def wrapper(self: SpillBuffer, *args: Any, **kwargs: Any) -> Any:
        with self._operation_lock:
            return method(self, *args, **kwargs)

    return cast(F, wrapper)


class SpillBuffer(zict.Buffer[Key, object]):
    """MutableMapping that keeps recently used values in memory up to ``target``
    bytes (measured with ``sizeof``) and spills the least recently used ones to
    files in ``spill_directory``.

    Behaves like ``distributed.spill.SpillBuffer``, including its error contract:

    - a value individually larger than ``target`` goes straight to disk; if it
      fails to pickle, the key is forgotten and the exception is raised;
    - if spilling an *older* value fails (unpicklable, OSError such as a full
      disk, or ``max_spill`` reached), the failure is logged once, nothing is
      raised, and the offending key stays in memory;
    - a value unspilled while another reference to it is still alive is not
      duplicated: the same object is returned;
    - reading a key never fails because spilling *other* keys to make room
      for it failed (stock lets its internal exception escape there): that
      failure is logged and those keys stay in memory;
    - a spill file that is deleted, truncated or corrupted behind our back
      raises :class:`dask_shm.SpillFileError` naming the key on read; the key
      stays in the buffer and can be deleted.

    Parameters
    ----------
    spill_directory:
        Directory for the spill files (created with mode 0700).
    target:
        Bytes of managed memory above which the least recently used values spill:
        an int or a string such as ``"1GiB"`` (``dask.utils.parse_bytes``).
    max_spill:
        Limit on the bytes held on disk (an int or a string such as ``"10GiB"``),
        or False for no limit.
    memmap:
        Unspill through a private (copy-on-write) memory mapping of the file
        instead of reading it into a new buffer: numpy, pyarrow and
        non-object pandas data are deserialized without a copy and pages are
        read lazily on first touch. Writes to such values stay private.
    recycle_bytes:
        Bytes of removed values' files kept to be overwritten by later spills
        (an int or a string such as ``"256 MiB"``; 0: none; never with
        ``memmap``). None (default): ``shm.spill-recycle-bytes``.
    shared:
        Must be False. Shared-memory mode is :class:`dask_shm.shared.SharedSpillBuffer`
        (``SharedSpillBuffer.from_config(target)`` replaces the former
        ``SpillBuffer(None, target, shared=True)``).

    Raises TypeError for ``shared=True``; TypeError or ValueError naming the
    parameter for a ``target`` or ``max_spill`` that is not a byte size >= 0.
    """

    logged_pickle_errors: set[Key]
    #: (label, unit) -> ever-increasing cumulative value
    cumulative_metrics: defaultdict[tuple[str, str], float]

    def __init__(
        self,
        spill_directory: str | os.PathLike[str] | None,
        target: int | str,
        max_spill: int | str | Literal[False] = False,
        *,
        memmap: bool = False,
        shared: bool = False,
        recycle_bytes: int | str | None = None,
        store: SpillStore | None = None,
        weight: Callable[[Key, object], float] = _in_memory_weight,
        charge: Callable[[], float] | None = None,
    ):
        """The parts (keyword-only, for buffers built on this class) default
        to stock's: ``store`` holds the spilled values (default: a
        :class:`SpillStore` in ``spill_directory``, its frames compressed
        as ``distributed.worker.memory.spill-compression`` says when the
        buffer is built, behind a weak-value cache; given,
        ``spill_directory``, ``max_spill`` and ``recycle_bytes`` are its
        business and must be left at None, False and None),
        ``weight`` measures a value in memory (default ``sizeof``),
        ``charge`` returns bytes held outside the values that count against
        ``target`` too (at most half of it, see :class:`ChargedLRU`)."""
        target = byte_size(target, "target")
        max_spill = spill_limit(max_spill, "max_spill")
        if shared:
            raise TypeError(
                "SpillBuffer(shared=True) is now dask_shm.shared.SharedSpillBuffer: use "
                "SharedSpillBuffer.from_config(target, max_spill) (or register "
                "dask_shm.SharedMemoryPlugin on the workers)"
            )
        self._operation_lock = threading.RLock()
        self.logged_pickle_errors = set()
        slow: MutableMapping[Key, object]
        if store is None:
            if spill_directory is None:
                raise ValueError("spill_directory is required")
            self.cumulative_metrics = defaultdict(float)
            recycle = (
                spill_recycle_bytes()
                if recycle_bytes is None
                else byte_size(recycle_bytes, "recycle_bytes")
            )
            store = SpillStore(
                spill_directory,
                max_spill,
                metrics=self.cumulative_metrics,
                mapped=memmap,
                recycle_bytes=recycle,
                # read here, as stock's SpillBuffer does when it is built
                compression=spill_compression(),
            )
            # A value still referenced elsewhere since its last unspill is served
            # from the weak-value cache instead of being read (and held) twice.
            slow = zict.Cache(store, zict.WeakValueMapping())
        else:
            if spill_directory is not None or max_spill is not False or recycle_bytes is not None:
                raise ValueError(
                    "spill_directory, max_spill and recycle_bytes belong to the given store"
                )
            self.cumulative_metrics = store.cumulative_metrics
            slow = store
        self._store = store
        if charge is None:
            super().__init__(fast={}, slow=slow, n=target, weight=weight)
            return
        # zict.Buffer.__init__ always builds a plain LRU: the same state, with
        # the charged one (tests/test_spill_buffer.py checks it stays the same).
        zict.common.ZictBase.__init__(self)
        self.fast = ChargedLRU(
            target,
            {},
            charge=charge,
            weight=weight,
            on_evict=[self.fast_to_slow],
            on_cancel_evict=[self._cancel_evict],
        )
        self.slow = slow
        self.weight = weight
        self.fast_to_slow_callbacks = []
        self.slow_to_fast_callbacks = []
        self._cancel_restore = {}

    def _insert(self, key: Key, value: object) -> None:
        """Store ``value`` (zict's insertion: memory or, if too large, disk)."""
        zict.Buffer.__setitem__(self, key, value)

    def _handle(self, e: Exception, key: Key | None) -> NoReturn:
        """Turn an internal spill exception into the public contract: raise
        ``_Handled`` after logging, or re-raise for a key being inserted that
        is too large for memory and cannot be pickled."""
        if isinstance(e, MaxSpillExceeded):
            logger.warning("Spill file on disk reached capacity; keeping data in memory")
            raise _Handled() from e
        if isinstance(e, PickleError):
            if e.key == key:
                # The value being inserted went straight to disk and failed to
                # serialize: forget it and tell the caller.
                del self[cast(Key, key)]
                raise e
            if e.key not in self.logged_pickle_errors:
                logger.error("Failed to pickle %r", e.key, exc_info=e)
                self.logged_pickle_errors.add(e.key)
            raise _Handled() from e
        # OSError: typically a full disk
        logger.error("Spill to disk failed; keeping data in memory", exc_info=e)
        raise _Handled() from e

    @_serialized
    def __setitem__(self, key: Key, value: object) -> None:
        """Store ``value`` in memory, or on disk if it alone exceeds ``target``;
        older values may spill as a result.

        Raises
        ------
        Exception
            ``value`` exceeds ``target`` and failed to pickle; it was forgotten.

        Any other failure (an older value failed to pickle, OSError, max_spill
        reached) is logged and the key that caused it stays in memory.
        """
        try:
            self._insert(key, value)
            self.logged_pickle_errors.discard(key)
        except (MaxSpillExceeded, PickleError, OSError) as e:
            try:
                self._handle(e, key)
            except _Handled:
                pass

    @_serialized
    def evict(self) -> int:
        """Spill the least recently used value, even below target.

        Returns its ``sizeof``, or -1 if spilling failed (logged; the value
        stays in memory). Never raises.
        """
        try:
            _, _, weight = self.fast.evict()
            return cast(int, weight)
        except KeyError:
            # Another thread deleted or overwrote the oldest key mid-eviction
            # (or fast became empty): nothing was evicted, nothing was lost.
            return -1
        except (MaxSpillExceeded, PickleError, OSError) as e:
            try:
                self._handle(e, None)
            except _Handled:
                return -1

    def __getitem__(self, key: Key) -> object:
        with self._operation_lock:
            fast = self.fast
            if key in fast:
                # Counted here, not in fast.__getitem__, which also runs on eviction.
                nbytes = fast.weights[key]
                metrics = self.cumulative_metrics
                metrics["memory-read", "count"] += 1
                metrics["memory-read", "bytes"] += nbytes
                context_meter.digest_metric("memory-read", 1, "count")
                context_meter.digest_metric("memory-read", nbytes, "bytes")
                # Under the operation lock nothing can evict it meanwhile.
                return fast[key]
            return self._unspill(key)

    def _unspill(self, key: Key) -> object:
        try:
            return super().__getitem__(key)
        except SpillFileError:
            raise
        except (MaxSpillExceeded, PickleError, OSError) as e:
            # Reading the key worked; spilling older keys to make room for it
            # failed. Unlike stock, which lets this internal error escape, log
            # it, keep those keys in memory and return the value.
            if key not in self:
                raise
            try:
                self._handle(e, None)
            except _Handled:
                pass
            return self.fast[key] if key in self.fast else self.slow[key]

    def __delitem__(self, key: Key) -> None:
        with self._operation_lock:
            # zict.Buffer.__delitem__ minus its lock and its bookkeeping of
            # restores and evictions in flight: under the operation lock there
            # are none.
            try:
                del self.fast[key]
            except KeyError:
                del self.slow[key]
            self.logged_pickle_errors.discard(key)

    def pop(self, key: Key, default: object = None) -> object:
        raise NotImplementedError(
            "Are you calling .pop(key, None) as a way to discard a key if it exists?"
            "It may cause data to be read back from disk! Please use `del` instead."
        )

    def close(self) -> None:
        if "fast" in self.__dict__:  # __init__ may have failed before zict's
            super().close()

    @property
    def memory(self) -> Mapping[Key, object]:
        """Key/value pairs held in memory (alias of ``fast``). Read only."""
        return self.fast

    @property
    def disk(self) -> Mapping[Key, object]:
        """Key/value pairs spilled to disk (alias of ``slow``). Read only."""
        return self.slow

    @property
    def store(self) -> SpillStore:
        """The store holding the spilled values (``disk`` without its
        weak-value cache): ``weight_by_key``, ``total_weight``, ``path(key)``,
        ``files``. Read it; do not write through it."""
        return self._store

    @property
    def _slow_uncached(self) -> SpillStore:
        # Former private name of ``store``, kept for code written against it.
        return self.store

    @property
    def spill_directory(self) -> str:
        return self.store.directory

    @property
    def spilled_total(self) -> SpilledSize:
        """``(sizeof, bytes on disk)`` summed over the spilled values."""
        return self.store.total_weight
