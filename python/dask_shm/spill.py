"""SpillBuffer: a drop-in for ``distributed.spill.SpillBuffer`` on a Rust file store."""

from __future__ import annotations

import functools
import logging
import os
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar, cast

import zict
from dask.typing import Key
from distributed.metrics import context_meter
from distributed.sizeof import safe_sizeof
from distributed.spill import SpilledSize
from distributed.utils import RateLimiterFilter

from dask_shm._core import ForgedHandleError, SpillFileError
from dask_shm.shared.guard import ensure_value
from dask_shm.spill_store import MaxSpillExceeded, PickleError, SpillStore

if TYPE_CHECKING:
    from dask_shm.shared.store import Handle, SharedSpillStore
    from dask_shm.shared.transfer import Received

logger = logging.getLogger(__name__)
logger.addFilter(RateLimiterFilter("Spill file on disk reached capacity"))
logger.addFilter(RateLimiterFilter("Spill to disk failed"))


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
        Bytes of managed memory above which the least recently used values spill.
    max_spill:
        Limit on the bytes held on disk, or False for no limit.
    memmap:
        Unspill through a private (copy-on-write) memory mapping of the file
        instead of reading it into a new buffer: numpy, pyarrow and
        non-object pandas data are deserialized without a copy and pages are
        read lazily on first touch. Writes to such values stay private.
    shared:
        Shared-memory mode (see :mod:`dask_shm.shared`): files on the tmpfs
        ``shm.shared-memory.root`` (``spill_directory`` may then be None: a
        fresh directory is made there), mapped on unspill and kept while the
        value is in memory, so such a value costs only its private bytes
        (``sizeof`` minus what lives in the mapping) against ``target`` and
        evicting it again writes nothing; other workers on the host can take
        the file over by hard link. Values that are mostly pickled Python
        objects, or smaller than ``shm.shared-memory.min-size``, stay private.
        If the root is unusable (not Linux, missing, not a tmpfs), a warning is
        logged and the buffer runs in private mode (``self.shared`` is False).
    """

    logged_pickle_errors: set[Key]
    #: (label, unit) -> ever-increasing cumulative value
    cumulative_metrics: defaultdict[tuple[str, str], float]

    def __init__(
        self,
        spill_directory: str | None,
        target: int,
        max_spill: int | Literal[False] = False,
        *,
        memmap: bool = False,
        shared: bool = False,
    ):
        self._operation_lock = threading.RLock()
        self.cumulative_metrics = defaultdict(float)
        self.logged_pickle_errors = set()
        #: shared mode: transfers by hard link and their fallbacks
        self.shm_counters: defaultdict[str, int] = defaultdict(int)
        store = (
            _open_shared_store(spill_directory, max_spill, self.cumulative_metrics)
            if shared
            else None
        )
        self.shared = store is not None
        if store is not None:
            # The shared store keeps its own weak cache of private values;
            # mapped values need none (the kernel shares their pages).
            super().__init__(fast={}, slow=store, n=target, weight=self._shared_weight)
            return
        if spill_directory is None:
            raise ValueError("spill_directory is required unless shared=True")
        slow = SpillStore(
            spill_directory, max_spill, metrics=self.cumulative_metrics, mapped=memmap
        )
        # A value still referenced elsewhere since its last unspill is served
        # from the weak-value cache instead of being read (and held) twice.
        slow_cached = zict.Cache(slow, zict.WeakValueMapping())
        super().__init__(fast={}, slow=slow_cached, n=target, weight=_in_memory_weight)

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

        HandleLeakError
            ``value`` is a shared-memory handle, not a value (nothing stored).

        Any other failure (an older value failed to pickle, OSError, max_spill
        reached) is logged and the key that caused it stays in memory.
        """
        ensure_value(key, value)
        try:
            if self.shared:
                self._shared_setitem(key, value)
            else:
                super().__setitem__(key, value)
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
            if self.shared:
                self._shared_store.discard_retained(key)

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
    def _slow_uncached(self) -> SpillStore:
        if self.shared:
            return cast(SpillStore, self.slow)
        return cast(SpillStore, cast(zict.Cache, self.slow).data)

    # -- shared-memory mode ------------------------------------------------------

    @property
    def _shared_store(self) -> SharedSpillStore:
        return cast("SharedSpillStore", self.slow)

    def _shared_weight(self, key: Key, value: object) -> int:
        private = self._shared_store.private_weight(key, value)
        return safe_sizeof(value) if private is None else private

    def _shared_setitem(self, key: Key, value: object) -> None:
        from dask_shm.shared import transfer

        store = self._shared_store
        received = transfer.claim(value)
        with self.lock:
            r = store.retained.get(key)
            if r is not None and r.value_id != id(value):
                store.discard_retained(key)
            if received is not None:
                name = self._adopt_received(key, received)
                if name is not None:
                    store.retain(key, value, name)
        super().__setitem__(key, value)

    def _adopt_received(self, key: Key, received: Received) -> str | None:
        try:
            name = self._shared_store.adopt(key, received.handle)
        except (ForgedHandleError, OSError) as e:
            # The value is fine (already deserialized); it just stays private.
            logger.info("dask-shm: could not link the file received for %r: %s", key, e)
            self.shm_counters["adopt_failures"] += 1
            return None
        finally:
            received.release()
        self.shm_counters["received_links"] += 1
        self.shm_counters["received_bytes"] += received.handle.size
        return name

    def slow_to_fast(self, key: Key) -> object:
        if not self.shared:
            return super().slow_to_fast(key)
        store = self._shared_store
        self._cancel_restore[key] = False
        try:
            with self.unlock():
                value, backed = store.load(key)
            if self._cancel_restore[key]:
                raise KeyError(key)
        finally:
            del self._cancel_restore[key]
        if backed:
            # The file stays, backing the value; only its private bytes count.
            store.retain(key, value)
            self.fast.set_noevict(key, value)
        elif self.weight(key, value) <= self.n:
            self.fast.set_noevict(key, value)
            del self.slow[key]
        with self.unlock():
            self.fast.evict_until_below_target()
            for cb in self.slow_to_fast_callbacks:
                cb(key, value)
        return value

    def fast_to_slow(self, key: Key, value: object) -> None:
        if self.shared and self._shared_store.release(key, value):
            return  # its file is still there: nothing to write
        super().fast_to_slow(key, value)

    def shared_bytes(self, key: Key) -> int:
        """Bytes of ``key``'s shared file that count for this worker (1/k of
        the file for k hard links); 0 for a private key or a private buffer.
        Read by the span extension to report per-span shared memory."""
        if not self.shared:
            return 0
        store = self._shared_store
        name = store.file_of(key)
        if name is None or name not in store.shareable:
            return 0
        return store.files.sizes(name)[1]

    @_serialized
    def export(self, key: Key) -> Handle | None:
        """Shared mode: make sure ``key`` is in a file and return a handle for a
        peer on this host (a fresh hard link the caller deletes once the peer
        has linked it). A value held privately in memory is written out and
        leaves memory (its next use maps the file). Returns None when the
        key is absent, the buffer is private, the value is not worth sharing,
        or writing/linking fails (the caller then sends bytes)."""
        if not self.shared:
            return None
        store = self._shared_store
        with self.lock:
            try:
                if store.file_of(key) is None:
                    if key not in self.fast:
                        return None
                    value = self.fast.d[key]
                    store[key] = value
                    del self.fast[key]
                return store.export(key)
            except (MaxSpillExceeded, PickleError, OSError) as e:
                logger.info("dask-shm: cannot hand %r over by hard link: %s", key, e)
                return None

    @property
    def spill_directory(self) -> str:
        return self._slow_uncached.directory

    @property
    def spilled_total(self) -> SpilledSize:
        """``(sizeof, bytes on disk)`` summed over the spilled values."""
        return self._slow_uncached.total_weight


def _open_shared_store(
    spill_directory: str | None,
    max_spill: int | Literal[False],
    metrics: defaultdict[tuple[str, str], float],
) -> SharedSpillStore | None:
    """The store of a shared-mode buffer, or None (with a warning) when the
    configured root cannot be used."""
    from dask_shm.config import SharedMemorySettings
    from dask_shm.shared import paths
    from dask_shm.shared.store import SharedSpillStore

    settings = SharedMemorySettings.from_config()
    try:
        paths.check_root(settings.root)
        if spill_directory is None:
            spill_directory = paths.subdir(settings.root, f"buffer-{uuid.uuid4().hex[:12]}")
        elif (
            os.stat(paths.user_root(settings.root)).st_dev
            != os.stat(os.path.dirname(os.path.abspath(spill_directory)) or "/").st_dev
        ):
            raise paths.UnusableRoot(
                f"spill directory {spill_directory} is not on the shared-memory root "
                f"{settings.root}'s file system"
            )
        outgoing = paths.subdir(settings.root, "outgoing")
    except (paths.UnusableRoot, OSError) as e:
        logger.warning("dask-shm: %s; shared-memory mode is off, spilling privately", e)
        if spill_directory is None:
            raise ValueError(
                "shared-memory mode is unavailable and no spill_directory was given"
            ) from e
        return None
    return SharedSpillStore(
        spill_directory,
        max_spill,
        root=settings.root,
        outgoing_directory=outgoing,
        min_size=settings.min_size,
        min_shared_fraction=settings.min_shared_fraction,
        metrics=metrics,
    )
