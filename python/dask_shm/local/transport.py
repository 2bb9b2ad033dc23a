"""Shared-memory handoff between the parent and the pool processes.

:class:`Transport` provides the ``dumps``/``loads`` pair that
``dask.local.get_async`` uses for what crosses to the pool. An object is pickled
with protocol 5 (cloudpickle, so lambdas and closures work): buffers of at
least ``threshold`` bytes leave the pickle stream *out of band* and are written
once into one spill-format file of the computation's directory; the message
that crosses the pipe is the small pickle stream plus ``(file, frame, start,
stop)`` references. Readers map the files copy-on-write (nothing is copied;
writes by a task stay private to its process).

Written once: a buffer that already lives in a mapping of one of our files and
whose pages were never written (checked in ``/proc/self/pagemap``) is sent as
a reference to that file rather than copied again. In the parent this is every
intermediate result going back out to a dependent task; in a pool process it
is an output that is a view of an input.

Lifetime (decided in the parent, the only process that frees files): a file
lives while the parent holds a live mapping of it or a task message naming it
is in flight (until its reply is loaded). Pool processes only reuse files of
the task they are running, which are pinned until the parent has read their
reply. Whatever is left is removed with the directory by :meth:`Transport.close`,
or, after a computation on the warm pool, by :meth:`Transport.park`, which
keeps the files ready for reuse for the next computation in the same
directory (:meth:`Transport.seed`).

Recycling (``recycle_bytes`` > 0): on a tmpfs, writing a result into a new
file costs mostly the kernel allocating its pages, and deleting it freeing
them (an 18 MB result: about 10 ms to write fresh, 3 ms to delete, under 3 ms
to overwrite an existing file). So a file the parent no longer needs is not
deleted but kept (up to ``recycle_bytes``) and given, named in a task
message, to the pool process that runs the task; that process takes it into
its store's reuse pool and overwrites it with a later result. A file is only
given once nobody can read it any more: the parent holds no mapping of it, no
message naming it is in flight, and no pool process mapped it when it last
replied (each reply lists the files its process still maps; a process can
only map a file again through a task message, which pins the file until the
reply).
"""

from __future__ import annotations

import bisect
import io
import itertools
import os
import pickle
import shutil
import sys
import threading
import uuid
import warnings
import weakref
from collections.abc import Iterable
from itertools import count
from typing import Any

import cloudpickle

from dask_shm._core import (
    FileStore,
    MappedFile,
    MappedRange,
    buffer_address,
    map_frames,
    pages_unmodified,
)

#: ``(file name, frame index, start, stop)``: one out-of-band buffer.
Ref = tuple[str, int, int, int]
#: What crosses the pipe: ``(pickle stream, refs, message id, reply to,
#: sender pid, files)``. Task messages from the parent carry a message id and,
#: as ``files``, the files given to the receiving process for reuse; replies
#: from the pool name the task message they answer and, as ``files``, the
#: files their process still maps; ids are 0 and ``files`` empty otherwise.
Message = tuple[bytes, tuple[Ref, ...], int, int, int, tuple[str, ...]]

#: Files smaller than this are deleted rather than kept for reuse (the Rust
#: store's own threshold: below it, fresh pages cost less than reuse).
MIN_RECYCLE = 256 * 1024
#: Files given to a pool process with one task message: what one or two
#: results need; the process deletes what its reuse pool cannot hold.
GIFTS_PER_TASK = 2

#: Pool-process endpoints kept per directory (a user-supplied pool outlives
#: computations; older directories are forgotten).
_MAX_ENDPOINTS = 16


class _Pickler(cloudpickle.Pickler):
    """cloudpickle with protocol 5 that gives big non-contiguous numpy arrays a
    contiguous out-of-band copy instead of numpy's in-band ``tobytes`` fallback."""

    def __init__(self, file: io.BytesIO, threshold: int, buffer_callback: Any):
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._threshold = threshold

    def reducer_override(self, obj: Any) -> Any:
        np = sys.modules.get("numpy")
        if (
            np is not None
            and type(obj) is np.ndarray
            and obj.nbytes >= self._threshold
            and not (obj.flags.c_contiguous or obj.flags.f_contiguous)
            and not obj.dtype.hasobject
        ):
            return np.ascontiguousarray(obj).__reduce_ex__(5)
        return super().reducer_override(obj)


class _Mapping:
    """One live mapping of one file in this process, with the ranges handed out."""

    __slots__ = ("name", "mapped", "base", "size", "frames", "live")

    def __init__(self, name: str, mapped: MappedFile, base: int, frames: list[tuple[int, int]]):
        self.name = name
        self.mapped = mapped
        self.base = base
        self.size = len(mapped)
        self.frames = frames
        self.live = 0


def _check_range(
    name: str, frames: list[tuple[int, int]], frame: int, start: int, stop: int
) -> None:
    """ValueError unless ``start:stop`` lies inside frame ``frame`` of ``frames``."""
    if not 0 <= frame < len(frames) or not 0 <= start <= stop <= frames[frame][1]:
        raise ValueError(f"reference {start}:{stop} outside frame {frame} of {name}")


class _Endpoint:
    """Per-process, per-directory state: the file store this process writes
    with, the live mappings it can reuse, and (in the owner, i.e. the parent)
    the reference counts that decide when a file is deleted."""

    def __init__(self, directory: str, owner_pid: int, recycle_bytes: int = 0):
        self.directory = directory
        self.is_owner = os.getpid() == owner_pid
        if not os.path.isdir(directory):
            # Never re-create the directory of a computation that has ended.
            raise FileNotFoundError(f"the computation's directory {directory} is gone")
        # Pool processes overwrite the files given to them; the parent's own
        # files (graph literals) are deleted as before.
        self.store = FileStore(directory, recycle_bytes=0 if self.is_owner else recycle_bytes)
        self.recycle_bytes = recycle_bytes
        #: (owner) files nobody reads any more, ready to be given: name -> size
        self.free: dict[str, int] = {}
        self.free_bytes = 0
        #: (owner) dead files that a pool process mapped when it last replied
        self.deferred: dict[str, int] = {}
        #: (owner) pool process id -> the files it mapped when it last replied
        self.held_by: dict[int, frozenset[str]] = {}
        self.lock = threading.RLock()
        self.mappings: dict[int, _Mapping] = {}
        #: Live mappings by base address, for finding the one holding a buffer.
        self.bases: list[int] = []
        self.by_base: dict[int, _Mapping] = {}
        self.refcounts: dict[str, int] = {}
        self.inflight: dict[int, tuple[str, ...]] = {}
        self.ids = count(1)
        self.local = threading.local()
        self.closed = False
        # Unique to this endpoint: a pool process may still map a file of an
        # earlier computation in the same (parked) directory, and ``find``
        # knows files by name.
        self.stem = f"p{os.getpid()}-{uuid.uuid4().hex[:8]}"

    # --- reference counting (owner only) ------------------------------------
    def _acquire(self, names: Iterable[str]) -> None:
        with self.lock:
            for name in names:
                self.refcounts[name] = self.refcounts.get(name, 0) + 1

    def _release(self, names: Iterable[str]) -> None:
        doomed = []
        with self.lock:
            if self.closed:
                return
            for name in names:
                left = self.refcounts.get(name, 0) - 1
                if left > 0:
                    self.refcounts[name] = left
                else:
                    self.refcounts.pop(name, None)
                    doomed.append(name)
        for name in doomed:
            self._retire(name)

    def _retire(self, name: str) -> None:
        """A file the parent no longer needs: keep it for reuse if it is worth
        it and there is room, else delete it."""
        if self.recycle_bytes <= 0 or name in self.store:
            self._delete(name)
            return
        try:
            size = os.stat(os.path.join(self.directory, name)).st_size
        except OSError:
            return
        if size < MIN_RECYCLE:
            self._delete(name)
            return
        with self.lock:
            if any(name in held for held in self.held_by.values()):
                self.deferred[name] = size
                return
            kept = self._keep_free(name, size)
        if not kept:
            self._delete(name)

    def _keep_free(self, name: str, size: int) -> bool:
        """Add a file to the ones ready to give, if within ``recycle_bytes``
        (caller holds the lock)."""
        if self.free_bytes + size > self.recycle_bytes:
            return False
        self.free[name] = size
        self.free_bytes += size
        return True

    def _replied(self, pid: int, held: tuple[str, ...]) -> None:
        """Pool process ``pid`` replied, still mapping ``held``: release the
        deferred files nobody maps any more."""
        doomed = []
        with self.lock:
            self.held_by[pid] = frozenset(held)
            if not self.deferred:
                return
            for name, size in list(self.deferred.items()):
                if not any(name in h for h in self.held_by.values()):
                    del self.deferred[name]
                    if not self._keep_free(name, size):
                        doomed.append(name)
        for name in doomed:
            self._delete(name)

    def _gifts(self) -> tuple[str, ...]:
        """Files to give to the process that will run the next task."""
        with self.lock:
            names = list(itertools.islice(self.free, GIFTS_PER_TASK))
            for name in names:
                self.free_bytes -= self.free.pop(name)
        return tuple(names)

    def _give_back(self, names: tuple[str, ...]) -> None:
        """(parent) Given files that reached the parent itself: keep them."""
        for name in names:
            self._retire(name)

    def _take_gifts(self, names: tuple[str, ...]) -> None:
        """(pool process) Take given files into the store's reuse pool (the
        store deletes what it cannot keep)."""
        for name in names:
            try:
                self.store.give_for_reuse(name)
            except OSError:
                pass

    def mapped_names(self) -> tuple[str, ...]:
        """Files this process maps with at least one live range."""
        with self.lock:
            return tuple({m.name for m in self.mappings.values() if m.live > 0})

    def _delete(self, name: str) -> None:
        if name in self.store:
            self.store.delete(name)
            return
        try:
            os.unlink(os.path.join(self.directory, name))
        except FileNotFoundError:
            pass

    # --- mapping ------------------------------------------------------------
    def _range_died(self, key: int) -> None:
        with self.lock:
            mapping = self.mappings.get(key)
            if mapping is None:
                return
            mapping.live -= 1
            if mapping.live > 0:
                return
            del self.mappings[key]
            self._unindex(mapping)
        if self.is_owner:
            self._release([mapping.name])

    def _map(self, name: str, frame: int, start: int, stop: int) -> _Mapping:
        """A new mapping of file ``name``, registered once the first range to
        be handed out from it is known to be inside it (ValueError if not:
        nothing is kept)."""
        mapped, base, frames = map_frames(os.path.join(self.directory, name))
        _check_range(name, frames, frame, start, stop)
        mapping = _Mapping(name, mapped, base, frames)
        with self.lock:
            self.mappings[id(mapping)] = mapping
            bisect.insort(self.bases, base)
            self.by_base[base] = mapping
        if self.is_owner:
            self._acquire([name])
        return mapping

    def open_ranges(self, refs: tuple[Ref, ...]) -> list[MappedRange]:
        """One exported range per ref, mapping each named file once, except
        that a ref overlapping a range already handed out from a mapping gets
        a mapping of its own: two objects of one message (a task's inputs)
        never share memory, as two unpickled copies would not."""
        #: file name -> its mappings here, each with the byte ranges handed out
        opened: dict[str, list[tuple[_Mapping, list[tuple[int, int]]]]] = {}
        ranges = []
        for name, frame, start, stop in refs:
            for mapping, used in opened.get(name, ()):
                _check_range(name, mapping.frames, frame, start, stop)
                offset = mapping.frames[frame][0]
                lo, hi = offset + start, offset + stop
                if not any(lo < u_hi and u_lo < hi for u_lo, u_hi in used):
                    break
            else:
                mapping, used = self._map(name, frame, start, stop), []
                opened.setdefault(name, []).append((mapping, used))
                offset = mapping.frames[frame][0]
            used.append((offset + start, offset + stop))
            key = id(mapping)
            rng = MappedRange(mapping.mapped, offset + start, stop - start)
            with self.lock:
                mapping.live += 1
            weakref.finalize(rng, self._range_died, key).atexit = False
            ranges.append(rng)
        return ranges

    def _unindex(self, mapping: _Mapping) -> None:
        i = bisect.bisect_left(self.bases, mapping.base)
        if i < len(self.bases) and self.bases[i] == mapping.base:
            del self.bases[i]
            del self.by_base[mapping.base]

    def find(self, addr: int, length: int, allowed: frozenset[str] | None) -> Ref | None:
        """A reference to a live, unmodified mapping that holds these bytes."""
        with self.lock:
            i = bisect.bisect_right(self.bases, addr) - 1
            if i < 0:
                return None
            m = self.by_base[self.bases[i]]  # live mappings never overlap
        if addr + length > m.base + m.size or (allowed is not None and m.name not in allowed):
            return None
        for frame, (offset, flen) in enumerate(m.frames):
            start = addr - (m.base + offset)
            if 0 <= start and start + length <= flen:
                try:
                    if not pages_unmodified(addr, length):
                        return None  # written to since it was mapped
                except OSError:
                    return None
                return (m.name, frame, start, start + length)
        return None

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.mappings.clear()
            self.bases.clear()
            self.by_base.clear()
            self.refcounts.clear()
            self.inflight.clear()
            self.free.clear()
            self.deferred.clear()
            self.held_by.clear()


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


_endpoints: dict[str, _Endpoint] = {}
_endpoints_lock = threading.Lock()


def _endpoint(directory: str, owner_pid: int, recycle_bytes: int) -> _Endpoint:
    """This process's endpoint of ``directory``. A pool process keeps the
    :data:`_MAX_ENDPOINTS` most recent ones (it is never told that a
    computation ended); the parent keeps its own until the computation
    detaches them: their reference counts decide when files are deleted."""
    with _endpoints_lock:
        ep = _endpoints.get(directory)
        if ep is None or ep.closed:
            ep = _endpoints[directory] = _Endpoint(directory, owner_pid, recycle_bytes)
            guests = [d for d, e in _endpoints.items() if not e.is_owner]
            for old in guests[: max(0, len(guests) - _MAX_ENDPOINTS)]:
                del _endpoints[old]
        return ep


def _forget_endpoints() -> None:
    """In a forked child: the parent's endpoints are not this process's (it
    would delete files as their owner), and their lock may be held."""
    global _endpoints_lock
    _endpoints.clear()
    _endpoints_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_endpoints)


class Transport:
    """The ``dumps``/``loads`` pair of one computation, bound to its directory.

    Picklable: a pool process unpickling it joins the same directory. Created
    in the parent, which owns the files; :meth:`close` (parent only) deletes
    the directory with everything in it, whatever is still mapped anywhere
    (mappings outlive the files).

    ``dumps`` raises whatever pickling raises (e.g. ``PicklingError``) and
    OSError if a file cannot be written; ``loads`` raises OSError
    (FileNotFoundError, ...) or :class:`dask_shm.SpillFileError` if a referenced
    file is missing or damaged.
    """

    def __init__(
        self,
        directory: str,
        threshold: int,
        owner_pid: int | None = None,
        recycle_bytes: int = 0,
    ):
        if threshold < 1:
            raise ValueError(f"threshold must be a positive number of bytes; got {threshold!r}")
        if recycle_bytes < 0:
            raise ValueError(f"recycle_bytes must be >= 0; got {recycle_bytes!r}")
        self.directory = directory
        self.threshold = threshold
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid
        self.recycle_bytes = recycle_bytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (Transport, (self.directory, self.threshold, self.owner_pid, self.recycle_bytes))

    def __repr__(self) -> str:
        return (
            f"<Transport {self.directory} threshold={self.threshold} "
            f"recycle_bytes={self.recycle_bytes}>"
        )

    @property
    def _ep(self) -> _Endpoint:
        return _endpoint(self.directory, self.owner_pid, self.recycle_bytes)

    def dumps(self, obj: object) -> Message:
        """Serialize ``obj`` for the other side; see the module docstring."""
        ep = self._ep
        threshold = self.threshold
        big: list[pickle.PickleBuffer] = []

        def keep_small_in_band(buf: pickle.PickleBuffer) -> bool:
            try:
                raw = buf.raw()
            except BufferError:
                return True  # non-contiguous: pickle handles (or rejects) it as usual
            with raw:
                if raw.nbytes < threshold:
                    return True
            big.append(buf)
            return False

        stream = io.BytesIO()
        _Pickler(stream, threshold, keep_small_in_band).dump(obj)
        payload = stream.getvalue()

        current = getattr(ep.local, "task", None)
        if current is not None:
            # The reply of the task this thread is running. Outside the parent,
            # only that task's files are sure to exist until the reply is read.
            msg_id, reply_to = 0, current[0]
            allowed = None if ep.is_owner else current[1]
        elif ep.is_owner:
            msg_id, reply_to, allowed = next(ep.ids), 0, None
        else:
            msg_id, reply_to, allowed = 0, 0, frozenset()

        refs: list[Ref] = []
        fresh: list[tuple[int, memoryview]] = []
        for buf in big:
            raw = buf.raw()
            ref = ep.find(*buffer_address(raw), allowed) if raw.nbytes else None
            if ref is None:
                fresh.append((len(refs), raw))
                refs.append(("", 0, 0, 0))
            else:
                refs.append(ref)
        if fresh:
            frames = [raw for _, raw in fresh]
            try:
                stored = ep.store.put(ep.stem, frames, sum(f.nbytes for f in frames))
            except OSError as e:
                # E.g. /dev/shm is full: send everything through the pipe.
                _warn_once(
                    f"dask_shm.get: cannot write to {self.directory} ({e}); "
                    "sending data through pipes instead"
                )
                del fresh, frames, refs, big
                payload = cloudpickle.dumps(obj, protocol=5)
                refs = []
                stored = None
            if stored is not None:
                if not ep.is_owner:
                    # The parent owns the file from now on; a warm pool
                    # process's ledger would otherwise grow with every result.
                    ep.store.forget(stored[0])
                for k, (i, raw) in enumerate(fresh):
                    refs[i] = (stored[0], k, 0, raw.nbytes)
        final = tuple(refs)
        if current is not None:
            ep.local.task = None
        if msg_id and final:
            # Pin the files until the reply to this task has been loaded.
            names = tuple({r[0] for r in final})
            with ep.lock:
                ep.inflight[msg_id] = names
            ep._acquire(names)
        files: tuple[str, ...] = ()
        if msg_id and ep.free:
            files = ep._gifts()
        elif reply_to and not ep.is_owner:
            files = ep.mapped_names()
        return (payload, final, msg_id, reply_to, os.getpid(), files)

    def loads(self, message: Message) -> Any:
        """Rebuild what ``dumps`` serialized, mapping its files."""
        payload, refs, msg_id, reply_to, sender, files = message
        ep = self._ep
        if msg_id:
            ep.local.task = (msg_id, frozenset(r[0] for r in refs))
            if files:
                if ep.is_owner:  # a task run by a thread of the parent
                    ep._give_back(files)
                else:
                    ep._take_gifts(files)
        elif reply_to and ep.is_owner and sender != os.getpid():
            ep._replied(sender, files)
        ranges = ep.open_ranges(refs) if refs else []
        try:
            return pickle.loads(payload, buffers=ranges)
        finally:
            del ranges
            if reply_to and ep.is_owner:
                with ep.lock:
                    names = ep.inflight.pop(reply_to, ())
                ep._release(names)

    def _detach(self) -> dict[str, int]:
        """Forget this process's state of the directory; return the files
        that were ready to give (``name -> size``)."""
        with _endpoints_lock:
            ep = _endpoints.pop(self.directory, None)
        if ep is None:
            return {}
        with ep.lock:
            free = dict(ep.free)
        ep.close()
        return free

    def seed(self, files: dict[str, int]) -> None:
        """(parent, before the first task) Take files that :meth:`park` kept
        from the previous computation in this directory as ready to give
        (``name -> size``); what exceeds ``recycle_bytes`` is deleted."""
        ep = self._ep
        for name, size in files.items():
            with ep.lock:
                kept = ep._keep_free(name, size)
            if not kept:
                ep._delete(name)

    def park(self) -> dict[str, int]:
        """(parent, after a computation that succeeded, with no task running)
        Forget all state and delete every file of the directory but the ones
        ready to give (returned, ``name -> size``, for :meth:`seed`) and the
        hidden ones: the directory's lock and the pool processes' own reuse
        files (``.pool-*``, theirs to overwrite). Nobody maps what is kept:
        files still mapped (by results, or by objects a task left in a pool
        process) are deleted like the rest, and their mappings keep their
        pages until they go."""
        kept = self._detach()
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return {}
        for entry in entries:
            if entry.name in kept or entry.name.startswith("."):
                continue  # the lock, and the pool processes' hidden reuse files
            try:
                os.unlink(entry.path)
            except OSError:
                pass
        return kept

    def close(self, remove: bool = True) -> None:
        """Forget all state and (unless ``remove`` is false, when the owner of
        the directory removes it later) delete the directory and everything
        in it. Parent only."""
        self._detach()
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)
