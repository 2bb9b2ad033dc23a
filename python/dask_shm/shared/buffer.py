"""SharedSpillBuffer: the spill buffer of shared-memory mode.

Layers, one concern each (zict style):

- :class:`SharedSpillBuffer` (this module): which values are in memory
  (``fast``, private bytes plus the bytes of RAM tiers' files against
  ``target``, see :mod:`~dask_shm.charged_lru`) and which are spilled; files
  received from peers (*arrivals*) and the values they back;
- :class:`~dask_shm.shared.store.SharedSpillStore`: serialized values in
  files, retained while a mapped value is in memory, exported/adopted by hard link;
- :class:`~dask_shm.shared.tiers.TieredFiles`: where each file lives, in an
  ordered list of file tiers (by default tier 2, the tmpfs within a byte
  budget, then tier 3, a real file system);
- :class:`~dask_shm._core.FileStore` (Rust): one directory of files.

The public error contract is :class:`dask_shm.SpillBuffer`'s. Settings are
passed in (:meth:`SharedSpillBuffer.create`, :meth:`SharedSpillBuffer.on_tiers`);
only :meth:`from_config`, an edge for direct users, reads dask config.

Adopting an existing file as the backing of a key (for code that builds
values directly in shared files, e.g. a numpy allocator): write the file in
the spill format anywhere under the root, then call :meth:`receive` with a
:class:`~dask_shm.shared.store.Handle` naming it (``stem`` =
``spill_store.file_stem(key)``) and store the returned value under the key
(``buffer[key] = value``): the file is hard-linked once, validated, mapped,
and owned by the buffer from then on; the caller may delete its own link.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal

import zict
from dask.typing import Key
from distributed.metrics import context_meter
from distributed.sizeof import safe_sizeof

from dask_shm import arrow_pool
from dask_shm._core import ForgedHandleError, MappedFile, flush_deletes, read_peer_file
from dask_shm.config import byte_size, fraction, spill_limit
from dask_shm.shared import born, limits, paths
from dask_shm.shared.guard import ensure_value
from dask_shm.shared.payload import read_tracking_mapping
from dask_shm.shared.store import Handle, SharedSpillStore, Unshared, mapped_values_bound
from dask_shm.shared.tiers import TieredFiles, TierSpec, open_tiers, tier_specs, tiers_of
from dask_shm.shared.write_ahead import ExportForecast
from dask_shm.spill import SpillBuffer, _Handled
from dask_shm.spill_store import MaxSpillExceeded, PickleError, file_stem, frames_to_object

logger = logging.getLogger(__name__)


@dataclass
class _Arrival:
    """A file received from a peer, backing a value not yet stored under a key."""

    name: str
    #: whether an object is the value that arrived (see :func:`_follow`)
    is_value: Callable[[object], bool]
    finalizer: weakref.finalize
    size: int


def _mappings_of(frames: Sequence[object]) -> list[weakref.ref[MappedFile]]:
    """Weak references to the mappings that ``frames`` are views of."""
    found = {id(f.obj): f.obj for f in frames if isinstance(f, memoryview)}
    return [weakref.ref(m) for m in found.values() if isinstance(m, MappedFile)]


def _follow(
    value: object, mappings: Sequence[weakref.ref[MappedFile]], on_garbage: Callable[[], None]
) -> tuple[Callable[[object], bool], weakref.finalize] | None:
    """How to recognise ``value`` when it is stored, and a finalizer calling
    ``on_garbage`` once it is garbage; None if it cannot be followed.

    A weak-referenceable value (an array, a frame) is followed itself. A dict,
    tuple or list of arrays (what dask's reductions pass on: ``mean_chunk``
    returns a dict) is not weak-referenceable; it is followed through the
    mapping among ``mappings`` that it keeps alive, which dies with it, and
    recognised by identity and type while that mapping lives, as the store
    recognises a retained value by identity."""
    try:
        ref = weakref.ref(value)
    except TypeError:
        pass
    else:
        return (lambda v: ref() is v), weakref.finalize(value, on_garbage)
    alive = [m for m in (r() for r in mappings) if m is not None]
    if not alive:
        return None
    value_id, value_type = id(value), type(value)
    finalizer = weakref.finalize(alive[0], on_garbage)
    return (lambda v: finalizer.alive and id(v) == value_id and type(v) is value_type), finalizer


def _finish(done: Future[None]) -> None:
    """Wake whoever waits for a write ahead (once; a second call does nothing)."""
    try:
        done.set_result(None)
    except InvalidStateError:
        pass


def _abandoned(buffer_ref: weakref.ref[SharedSpillBuffer], stem: str, name: str) -> None:
    """The value of an arrival died before it was stored (fetch cancelled or
    failed): delete its file. A finalizer runs in whatever thread drops the
    last reference, maybe one holding a lock the buffer's operations take
    after their own: if the buffer's lock is busy, a thread of its own waits
    for it."""
    buffer = buffer_ref()
    if buffer is None:
        return
    lock = buffer._operation_lock
    if lock.acquire(blocking=False):
        try:
            buffer._drop_arrival(stem, name)
        finally:
            lock.release()
        return
    threading.Thread(
        target=buffer._drop_arrival, args=(stem, name), name="dask-shm abandoned", daemon=True
    ).start()


class SharedSpillBuffer(SpillBuffer):
    """Spill buffer of shared-memory mode; same contract as
    :class:`dask_shm.SpillBuffer` plus:

    - a value worth sharing (numpy, pyarrow, non-object pandas) is unspilled
      through a mapping of its file and costs only its private bytes
      (``sizeof`` minus what lives in the mapping) against ``target``; its
      file is kept while it is in memory, so evicting it writes nothing;
    - spilled files go to the tmpfs (tier 2) within the store's budget, the
      rest to a real file system (tier 3), see :mod:`dask_shm.shared.tiers`;
      tier-2 bytes are RAM and count against ``target`` (up to half of it)
      before the values in memory do;
    - at most ``max_mapped`` values are held through a mapping of their file
      (each mapping counts against ``vm.max_map_count``); beyond that the least
      recently used ones go back to their files, which writes nothing, and
      are mapped again when next used;
    - :meth:`export` hands a key's file to a same-host peer; :meth:`receive`
      takes a peer's file in (one validated hard link, owned by this buffer
      from then on: released when the value is dropped unstored, or on close);
    - after :meth:`start_writing_ahead`, a fresh value whose task prefix
      usually goes to a peer is written to its file on a thread of its own
      as soon as it is stored (see :mod:`~dask_shm.shared.write_ahead`).

    Build one with :meth:`create` (settings as arguments) or
    :meth:`from_config` (reads ``shm.shared-memory.*``).
    """

    #: Shared-memory mode (for code that tells the two buffers apart).
    shared = True

    def __init__(self, store: SharedSpillStore, target: int, *, max_mapped: int | None = None):
        self._shared_store = store
        #: most values held in memory through a mapping of their file
        #: (default: :func:`~dask_shm.shared.store.mapped_values_bound`); may
        #: be changed at any time, it applies from the next insertion or use
        self.max_mapped = mapped_values_bound() if max_mapped is None else max_mapped
        #: mapped values sent back to their files to stay within ``max_mapped``
        self.unmapped = 0
        #: called right before a value in memory is written out to make room,
        #: so that tier 2's budget can follow the worker's memory at that
        #: moment (see :mod:`~dask_shm.shared.relief`); it runs in the thread
        #: holding the operation lock, so it may call this buffer's methods
        #: but must not wait for another thread that needs them
        self.before_spill: Callable[[], None] | None = None
        #: whether the worker is above its spill threshold (set by the
        #: worker's monitor, see :mod:`~dask_shm.shared.monitor`); after each
        #: unspill through a mapping, older values are evicted while it holds.
        #: Such a read costs no copy, so a run of them can add more memory
        #: between two looks of the worker's memory monitor (every 100 ms)
        #: than there is room for above its spill threshold, up to the
        #: nanny's terminate threshold (reads by copy go at stock's pace).
        self.over_spill_threshold: Callable[[], bool] | None = None
        #: values evicted because an unspill found the worker over that threshold
        self.evicted_on_unspill = 0
        #: transfers by hard link and their fallbacks
        self.shm_counters: defaultdict[str, int] = defaultdict(int)
        self._arrivals: dict[str, list[_Arrival]] = {}
        self._closed = False
        #: values of this many bytes or more are considered for writing ahead
        self._ahead_min_bytes = 0
        self._forecast: ExportForecast | None = None
        self._ahead_thread: ThreadPoolExecutor | None = None
        #: keys being written ahead -> done when that write is over (or dropped)
        self._ahead: dict[Key, Future[None]] = {}
        self._ahead_lock = threading.Lock()
        #: keys written ahead and not exported since
        self._written_ahead: set[Key] = set()
        # The shared store keeps its own weak cache of private values (mapped
        # values need none: the kernel shares their pages); the LRU is charged
        # for this worker's tmpfs files.
        super().__init__(
            None, target, store=store, weight=self._weight, charge=store.tiers.ram_bytes
        )

    # -- construction ------------------------------------------------------------

    @classmethod
    def create(
        cls,
        target: int | str,
        *,
        root: str,
        disk_root: str,
        budget: int | str,
        min_size: int | str,
        min_shared_fraction: float,
        max_spill: int | str | Literal[False] = False,
        name: str | None = None,
        max_mapped: int | None = None,
        compression: str | None = None,
    ) -> SharedSpillBuffer:
        """A buffer whose files live in ``<root>/dask-shm-<uid>/<process>/<name>``
        (tier 2, at most ``budget`` bytes) and the same path under
        ``disk_root`` (tier 3), holding at most ``max_mapped`` values through
        mappings (default: :func:`~dask_shm.shared.store.mapped_values_bound`).
        ``target``, ``budget``, ``min_size`` and ``max_spill`` are byte sizes
        (an int or a string such as ``"1GiB"``; ``max_spill`` may be False),
        ``min_shared_fraction`` is in [0, 1]. Values not worth sharing are
        compressed with ``compression`` (a distributed codec name; None:
        none) when spilled, as stock's spilling does.

        Raises TypeError or ValueError naming the parameter for a bad value,
        :class:`~dask_shm.shared.paths.UnusableRoot` if ``root`` is not a
        usable tmpfs, OSError if a directory cannot be made."""
        target = byte_size(target, "target")
        budget = byte_size(budget, "budget")
        specs = tier_specs(root, disk_root)
        return cls.on_tiers(
            target,
            specs,
            {specs[0].name: budget},
            min_size=min_size,
            min_shared_fraction=min_shared_fraction,
            max_spill=max_spill,
            name=name,
            max_mapped=max_mapped,
            compression=compression,
        )

    @classmethod
    def on_tiers(
        cls,
        target: int | str,
        specs: Sequence[TierSpec],
        budgets: Mapping[str, int],
        *,
        min_size: int | str,
        min_shared_fraction: float,
        max_spill: int | str | Literal[False] = False,
        name: str | None = None,
        max_mapped: int | None = None,
        compression: str | None = None,
    ) -> SharedSpillBuffer:
        """:meth:`create` on the file tiers ``specs`` (see
        :func:`~dask_shm.shared.tiers.tier_specs`) within ``budgets`` (bytes
        by tier name; see :func:`~dask_shm.shared.tiers.open_tiers`). Same
        errors as :meth:`create` (UnusableRoot for a RAM tier's root that is
        not a usable tmpfs)."""
        target = byte_size(target, "target")
        min_size = byte_size(min_size, "min_size")
        min_shared_fraction = fraction(min_shared_fraction, "min_shared_fraction")
        max_spill = spill_limit(max_spill, "max_spill")
        for spec in specs:
            if spec.ram:
                paths.check_root(spec.root)
        file_tiers = open_tiers(specs, name or f"buffer-{uuid.uuid4().hex[:12]}", budgets)
        store = SharedSpillStore(
            TieredFiles(file_tiers),
            max_spill,
            min_size=min_size,
            min_shared_fraction=min_shared_fraction,
            metrics=defaultdict(float),
            compression=compression,
        )
        return cls(store, target, max_mapped=max_mapped)

    @classmethod
    def from_config(
        cls,
        target: int | str,
        max_spill: int | str | Literal[False] = False,
        *,
        memory_limit: int | None = None,
        name: str | None = None,
    ) -> SharedSpillBuffer:
        """:meth:`create` with ``shm.shared-memory.*`` settings (the budget
        from ``max-bytes`` and ``memory_limit``) and distributed's
        ``spill-compression``. Raises ValueError for an invalid setting,
        UnusableRoot for an unusable root."""
        from dask_shm.config import SharedMemorySettings, spill_compression

        settings = SharedMemorySettings.from_config()
        budget = limits.tier2_budget(settings.max_bytes, settings.root, memory_limit)
        specs = tiers_of(settings)
        return cls.on_tiers(
            target,
            specs,
            {specs[0].name: budget.limit},
            min_size=settings.min_size,
            min_shared_fraction=settings.min_shared_fraction,
            max_spill=max_spill,
            name=name,
            compression=spill_compression(),
        )

    # -- public face -------------------------------------------------------------

    @property
    def store(self) -> SharedSpillStore:
        """The store of this buffer's files (spilled and retained); its
        ``tiers`` tell where each file lives."""
        return self._shared_store

    def tier2_bytes(self) -> int:
        """Bytes of this buffer's tmpfs files that count for this worker (1/k
        of a file with k links), mapped or not: what it adds to the worker's
        memory beyond its private pages. O(1): a counter kept as files come
        and go, with link counts as of the last :meth:`refresh_links`."""
        return self.store.tiers.ram_bytes()

    def cap_tier2(self, limit: int | None) -> int:
        """Lower tier 2's budget to ``limit`` bytes for a while (None: back to
        the configured one; never above it); new files then go past it, and
        :meth:`relieve_tier2` moves what it holds over the budget. Returns
        the budget now."""
        with self._operation_lock:
            return self.store.tiers.cap(limit)

    def relieve_tier2(self, max_bytes: int) -> int:
        """Move about ``max_bytes`` (at least one file) of tier 2's least
        recently used unpinned files over its budget to the next tier; returns
        the bytes moved, 0 when nothing over the budget may move. Runs under
        the operation lock (no read or write of this buffer meanwhile), so
        ``max_bytes`` bounds how long others wait."""
        with self._operation_lock:
            return self.store.tiers.relieve(max_bytes)

    def refresh_links(self) -> int:
        """Correct the link counts behind :meth:`tier2_bytes` that other
        processes changed (a peer dropped or added a link): O(shared files),
        the GIL released. A worker's share publisher does this every few
        seconds; direct users call it when they need the figure current.
        Returns how many counts changed."""
        return self.store.tiers.refresh_links()

    def shared_bytes(self, key: Key) -> int:
        """Bytes of ``key``'s shared file that count for this worker (1/k of
        the file for k hard links); 0 for a private key. Read by the span
        extension to report per-span shared memory."""
        name = self.store.file_of(key)
        return 0 if name is None else self._file_shared_bytes(name)

    def _file_shared_bytes(self, name: str) -> int:
        """This worker's bytes of file ``name``; 0 unless it is shareable.
        Raises KeyError for a file deleted meanwhile."""
        store = self.store
        if name not in store.shareable:
            return 0
        return store.files.sizes(name)[1]

    def shared_bytes_by_key(self) -> dict[Key, int]:
        """:meth:`shared_bytes` of every key that has shared bytes (the keys
        with a shareable file: spilled or retained), in one pass over those
        keys only; the span extension reads it once per report."""
        store = self.store
        # Snapshots (list() of a dict is atomic): no lock, as shared_bytes takes none.
        named = list(store.filenames.items())
        named += [(k, r.name) for k, r in list(store.retained.items())]
        out: dict[Key, int] = {}
        for key, name in named:
            try:
                shared = self._file_shared_bytes(name)
            except KeyError:  # deleted meanwhile
                continue
            if shared:
                out[key] = shared
        return out

    def close(self) -> None:
        """Release every arrival not yet stored (their files are deleted, as
        are those of every key removed before; this waits for them) and stop
        writing ahead (a write in flight is waited for, and its file dropped)."""
        with self._operation_lock:
            self._closed = True
            arrivals = [a for lst in self._arrivals.values() for a in lst]
            self._arrivals.clear()
            for a in arrivals:
                a.finalizer.detach()
                self.store.drop_file(a.name)
        # Outside the lock: a write in flight takes it to finish.
        if self._ahead_thread is not None:
            self._ahead_thread.shutdown(wait=True, cancel_futures=True)
            with self._ahead_lock:  # writes cancelled before they began
                dropped, self._ahead = list(self._ahead.values()), {}
            for done in dropped:
                _finish(done)
        super().close()
        flush_deletes()

    # -- weights, insertion, removal --------------------------------------------

    def _weight(self, key: Key, value: object) -> int:
        private = self.store.private_weight(key, value)
        return safe_sizeof(value) if private is None else private

    def private_nbytes(self, key: Key) -> int | None:
        """The ``sizeof`` of ``key``'s value, as weighed when it was stored,
        if the value is held only in private memory (no file of its own);
        None if it is in a file (spilled, or mapped from one) or absent.

        Answers without measuring the value again: ``sizeof`` of a pandas
        DataFrame walks its columns (milliseconds for a hundred of them)."""
        if self.store.file_of(key) is not None:
            return None
        weight = self.fast.weights.get(key)
        return None if weight is None else int(weight)

    def __setitem__(self, key: Key, value: object) -> None:
        """As :meth:`dask_shm.SpillBuffer.__setitem__`; additionally raises
        :class:`~dask_shm.shared.guard.HandleLeakError` (nothing stored) when
        ``value`` is a shared-memory handle instead of the value it names."""
        ensure_value(key, value)
        super().__setitem__(key, value)
        if self._forecast is not None:
            self._consider_writing_ahead(key, value)

    def __getitem__(self, key: Key) -> object:
        with self._operation_lock:
            unspilling = key not in self.fast
            value = super().__getitem__(key)
            self.store.touch_retained(key)
            try:
                self._unmap_over_bound(key)
                if unspilling and key in self.store.retained:
                    self._evict_over_spill_threshold(key)
            except (MaxSpillExceeded, PickleError, OSError) as e:
                # A value written in place since it was mapped had to be
                # written out and could not be: it stays in memory (logged).
                try:
                    self._handle(e, None)
                except _Handled:
                    pass
            return value

    def _evict_over_spill_threshold(self, keep: Key) -> None:
        """While :attr:`over_spill_threshold` says so, evict the least recently
        used values other than ``keep`` (the one just mapped), as the worker's
        memory monitor would at its next look. Evicting a mapped value writes
        nothing."""
        over = self.over_spill_threshold
        if over is None:
            return
        while len(self.fast) > 1 and keep in self.fast and over():
            if self.evict() < 0:
                return
            self.evicted_on_unspill += 1

    def _unmap_over_bound(self, keep: Key) -> None:
        """Send the least recently used mapped values back to their files
        until at most ``max_mapped`` remain (``keep`` stays). Eviction of a
        retained value writes nothing: its file is still there."""
        retained = self.store.retained
        while len(retained) > self.max_mapped:
            victim = next((k for k in retained if k != keep), None)
            if victim is None or victim not in self.fast.d:
                # Not in memory (cannot happen while consistent): stop, bounded anyway.
                return
            evicted, _, _ = self.fast.evict(victim)
            if evicted is None or victim in retained:
                return  # cancelled by another thread, or written out instead
            self.unmapped += 1

    def _insert(self, key: Key, value: object) -> None:
        store = self.store
        arrival = self._claim(key, value)
        with self.lock:
            r = store.retained.get(key)
            if r is not None and r.value_id != id(value):
                store.discard_retained(key)
            if arrival is not None:
                store.retain(key, value, arrival.name)
                store.tiers.unpin(arrival.name)  # the arrival's pin is now the retention's
                self.shm_counters["received_links"] += 1
                self.shm_counters["received_bytes"] += arrival.size
        zict.Buffer.__setitem__(self, key, value)
        if arrival is not None:
            with self._operation_lock:
                self._unmap_over_bound(key)

    def __delitem__(self, key: Key) -> None:
        if self._forecast is not None:
            self._forecast.deleted(key)
        with self._operation_lock:
            if key in self._written_ahead:
                self._written_ahead.discard(key)
                self.shm_counters["written_ahead_unused"] += 1
            super().__delitem__(key)
            self.store.discard_retained(key)

    def slow_to_fast(self, key: Key) -> object:
        store = self.store
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
        if self.store.release(key, value):
            return  # its file is still there: nothing to write
        if self.before_spill is not None:
            self.before_spill()
        super().fast_to_slow(key, value)

    def check_readable(self, key: Key) -> None:
        """Raise SpillFileError naming ``key`` if it is spilled and its file
        vanished or was tampered with (nothing is read)."""
        with self._operation_lock:
            self.store.check_readable(key)

    # -- same-host transfers -----------------------------------------------------

    def start_writing_ahead(self, min_bytes: int, forecast: ExportForecast | None = None) -> None:
        """From now on, write a value of ``min_bytes`` or more (by ``sizeof``)
        out to its file on a thread of this buffer's as soon as it is stored
        in private memory, when ``forecast`` (default: a new
        :class:`~dask_shm.shared.write_ahead.ExportForecast`) expects a peer
        to fetch it; :meth:`export` then finds the file ready or waits for
        the write in flight instead of writing the value itself. The value
        leaves private memory once written, as an exported one does. Values
        under ``min_bytes`` are sent as bytes anyway (``transfer-min-size``).
        """
        self._ahead_min_bytes = min_bytes
        self._forecast = forecast if forecast is not None else ExportForecast()

    def _consider_writing_ahead(self, key: Key, value: object) -> None:
        if self._closed or self.fast.weights.get(key, 0) < self._ahead_min_bytes:
            return  # small, backed by a file (little private weight) or evicted at once
        if self.fast.d.get(key) is not value or born.whole_block(value) is not None:
            return  # a born-shared array is handed over without a copy anyway
        assert self._forecast is not None
        if not self._forecast.stored(key):
            return
        if self._ahead_thread is None:
            self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="dask-shm-write-ahead")
        done: Future[None] = Future()
        with self._ahead_lock:
            self._ahead[key] = done
        try:
            self._ahead_thread.submit(self._write_ahead, key, value, done)
        except RuntimeError:  # closed meanwhile
            self._end_write_ahead(key, done)

    def _end_write_ahead(self, key: Key, done: Future[None]) -> None:
        with self._ahead_lock:
            if self._ahead.get(key) is done:  # not a later write of the same key's
                del self._ahead[key]
        _finish(done)

    def _write_ahead(self, key: Key, value: object, done: Future[None]) -> None:
        """Write ``value``, ``key``'s value in private memory, to a new file
        and make that file the key's (on this buffer's write-ahead thread).
        The copy runs without the buffer's locks; if the key changed
        meanwhile or the buffer closed, the file is dropped. Errors (a full
        root, a value that does not pickle) are left for the export to meet
        again: nothing changes."""
        store = self.store
        try:
            with self.lock:
                if self._closed or self.fast.d.get(key) is not value:
                    return  # deleted, replaced or spilled while queued: nothing to write
            name = store.write_file(key, value, only_shared=True, memory=self.private_nbytes(key))
            if isinstance(name, Unshared):
                return  # not worth sharing
            with self._operation_lock:
                with self.lock:
                    if self._adopt_written(key, value, name):
                        self._written_ahead.add(key)
                        self.shm_counters["written_ahead"] += 1
        except (MaxSpillExceeded, PickleError, OSError) as e:
            logger.debug("dask-shm: cannot write %r ahead: %s", key, e)
        finally:
            self._end_write_ahead(key, done)

    def export(self, key: Key, tiers: Collection[int] | None = None) -> Handle | None:
        """Make sure ``key`` is in a file and return a handle for a peer on
        this host (a fresh hard link the caller deletes once the peer has
        linked it). A value held privately in memory is written out and
        leaves memory (its next use maps the file) if it is worth sharing;
        one that is not stays as it is, unwritten. Returns None when the
        key is absent, the value is not worth sharing, its file is in a tier
        whose number is not in ``tiers`` (default: any linkable tier; the peer
        does not share that root; a value in memory is written out only when
        it can share the first tier), or writing/linking fails (the caller
        then sends bytes).

        The value's bytes are copied into the file without the buffer's
        locks: a worker's event loop reads, stores and deletes keys meanwhile
        (the copy of a large value takes milliseconds per MiB on 4 KiB tmpfs
        pages). If the key changed in the meantime (deleted, replaced,
        spilled), the new file is dropped and what the key is now decides; if
        the buffer closed, the file is dropped and None returned.

        A write ahead of ``key`` in flight is waited for (it is the same
        write, started earlier): the caller must not hold this buffer's
        locks, which that write takes to finish."""
        handed = self.hand_over(key, tiers)
        return handed if isinstance(handed, Handle) else None

    def hand_over(self, key: Key, tiers: Collection[int] | None = None) -> Handle | Unshared | None:
        """:meth:`export`, except that a value in private memory found not
        worth sharing comes back as the serialization that told
        (:class:`~dask_shm.shared.store.Unshared`), for the caller to send
        instead of serializing the value once more."""
        writing = self._ahead.get(key)
        if writing is not None:
            wait([writing])
        handed = self._export(key, tiers)
        if isinstance(handed, Handle) and self._forecast is not None:
            self._forecast.exported(key)
            self._written_ahead.discard(key)
        return handed

    def _export(self, key: Key, tiers: Collection[int] | None) -> Handle | Unshared | None:
        with self._operation_lock:
            store = self.store
            with self.lock:
                try:
                    if store.file_of(key) is not None:
                        return store.export(key, tiers)
                    first = store.tiers.tiers[0].number
                    if key not in self.fast or (tiers is not None and first not in tiers):
                        return None
                    value = self.fast.d[key]
                    memory = int(self.fast.weights[key])  # its sizeof: not retained
                    if store.write_born(key, value):  # no copy: under the locks
                        return self._exported(key, tiers)
                except (MaxSpillExceeded, PickleError, OSError, ForgedHandleError) as e:
                    # (ForgedHandleError: the sealed block could not be linked in)
                    return self._not_exported(key, e)
        try:
            name = store.write_file(key, value, only_shared=True, memory=memory)
        except (MaxSpillExceeded, PickleError, OSError) as e:
            return self._not_exported(key, e)
        if isinstance(name, Unshared):
            return name  # not worth sharing: it goes as bytes, as in stock
        with self._operation_lock:
            with self.lock:
                try:
                    adopted = self._adopt_written(key, value, name)
                    if not adopted and (self._closed or store.file_of(key) is None):
                        return None  # closed, or the key left memory and has no file
                    return store.export(key, tiers)  # the file written, or the key's file now
                except (MaxSpillExceeded, PickleError, OSError) as e:
                    return self._not_exported(key, e)

    def _adopt_written(self, key: Key, value: object, name: str) -> bool:
        """File ``name``, written from ``value`` without the locks, becomes
        ``key``'s and the private copy leaves memory, if the buffer is open
        and ``key`` still holds ``value``; else the file is dropped and False
        returned. Under both locks."""
        if self._closed or self.fast.d.get(key) is not value:
            self.store.drop_file(name)
            return False
        self.store.register_file(key, name)
        self._drop_private(key)
        return True

    def _exported(self, key: Key, tiers: Collection[int] | None) -> Handle | None:
        """``key``'s value was just written to its file: drop the private
        copy and link the file out. Under both locks."""
        self._drop_private(key)
        return self.store.export(key, tiers)

    def _drop_private(self, key: Key) -> None:
        """``key``'s file now holds its value: the private copy leaves memory.
        Under both locks."""
        del self.fast[key]
        # The private copy is gone (unless a task still holds it): pyarrow's
        # pool would keep its pages.
        arrow_pool.release_unused()

    @staticmethod
    def _not_exported(key: Key, e: Exception) -> None:
        logger.info("dask-shm: cannot hand %r over by hard link: %s", key, e)
        return None

    def receive(self, handle: Handle) -> object:
        """The value a peer's handle names, backed by one validated hard link
        of its file in this buffer (tier of the file's root). Until the value
        is stored here under the key of ``handle.stem`` the file is an
        *arrival*: deleted as soon as the value (for a dict, tuple or list of
        arrays: the mapping it holds) is garbage (fetch cancelled or failed)
        or the buffer closes. A valid file that cannot be linked or mapped is
        read by copy (the value is then private).

        Raises ForgedHandleError for a handle that fails validation (nothing
        linked or mapped), RuntimeError once the buffer is closed.
        """
        with self._operation_lock:
            if self._closed:
                raise RuntimeError("received a shared-memory handle for a closed buffer")
            store = self.store
            try:
                name = store.adopt(handle)
            except ForgedHandleError:
                raise
            except OSError as e:
                return self._copy_in(handle, e)
            mappings: list[weakref.ref[MappedFile]] = []

            def read() -> object:
                frames = store.map_file(name)
                mappings.extend(_mappings_of(frames))
                return frames_to_object(frames)

            try:
                value, backed = read_tracking_mapping(read)
            except OSError as e:
                # Out of mappings (vm.max_map_count) or similar: degrade to a copy.
                try:
                    return frames_to_object(store.read_file(name))
                finally:
                    store.drop_file(name)
                    self._count_fallback(handle, e)
            except BaseException:
                store.drop_file(name)
                raise
            if not backed:
                # It came back as a private copy (its deserializer copied the
                # frames): the link is of no use, and the value weighs in full.
                store.drop_file(name)
                self.shm_counters["received_private_copies"] += 1
                return value
            try:
                followed = _follow(
                    value,
                    mappings,
                    functools.partial(_abandoned, weakref.ref(self), handle.stem, name),
                )
            except BaseException:
                store.drop_file(name)
                raise
            if followed is None:
                # Neither the value nor its mapping can be followed: it stays
                # a private value over its mapping (the mapping keeps the pages
                # alive; the link goes now).
                store.drop_file(name)
                return value
            is_value, finalizer = followed
            store.pin_file(name)
            self._arrivals.setdefault(handle.stem, []).append(
                _Arrival(name, is_value, finalizer, handle.size)
            )
        context_meter.digest_metric("shm-receive-link", 1, "count")
        context_meter.digest_metric("shm-receive-link", handle.size, "bytes")
        return value

    def _copy_in(self, handle: Handle, e: OSError) -> object:
        files = self.store.tiers
        root = files.tiers[files.index_named(handle.path)].root
        self._count_fallback(handle, e)
        return frames_to_object(read_peer_file(root, handle.path, handle.size))

    def _count_fallback(self, handle: Handle, e: OSError) -> None:
        logger.info("dask-shm: copying %s instead of linking it: %s", handle.path, e)
        self.shm_counters["receive_fallback_transfers"] += 1
        self.shm_counters["receive_fallback_bytes"] += handle.size
        context_meter.digest_metric("shm-receive-fallback", 1, "count")

    def _claim(self, key: Key, value: object) -> _Arrival | None:
        """The arrival backing ``value`` if it came for ``key``; it is no
        longer an arrival afterwards (the caller retains its file)."""
        if not self._arrivals:
            return None
        stem = file_stem(key)
        waiting = self._arrivals.get(stem)
        if not waiting:
            return None
        for i, a in enumerate(waiting):
            if a.is_value(value):
                a.finalizer.detach()
                del waiting[i]
                if not waiting:
                    del self._arrivals[stem]
                return a
        return None

    def _drop_arrival(self, stem: str, name: str) -> None:
        with self._operation_lock:
            waiting = self._arrivals.get(stem, [])
            for i, a in enumerate(waiting):
                if a.name == name:
                    del waiting[i]
                    break
            else:
                return
            if not waiting:
                self._arrivals.pop(stem, None)
            self.store.drop_file(name)
            self.shm_counters["abandoned_arrivals"] += 1

    def pending_arrivals(self) -> int:
        """Files received but whose value is not (yet) stored under a key."""
        return sum(len(v) for v in self._arrivals.values())
