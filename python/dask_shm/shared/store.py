"""The slow half of a shared-memory :class:`dask_shm.SpillBuffer`.

:class:`SharedSpillStore` is a :class:`~dask_shm.spill_store.SpillStore` whose
files live on a tmpfs and outlive unspilling:

- a value worth sharing (see :mod:`dask_shm.shared.payload`) is unspilled
  through a private copy-on-write mapping of its file, so it costs no private
  memory, and its file is *retained* while the value sits in memory: evicting
  it again writes nothing, and a peer on the same host can be handed the file;
- a value that is mostly pickled Python objects, or too small, stays private:
  copying read, file deleted on unspill, exactly like the private store;
- files received from peers are *adopted* by hard link.

Accounting (``total_weight``) covers every file, spilled or retained: memory is
the full ``sizeof`` for spilled keys and the shared bytes for retained ones (so
``nbytes - memory`` is what the worker holds privately), and the disk size of a
file with k hard links counts 1/k here.
"""

from __future__ import annotations

import errno
import logging
import os
import weakref
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from time import perf_counter
from typing import Literal, NamedTuple

from dask.typing import Key
from distributed.metrics import context_meter
from distributed.sizeof import safe_sizeof

from dask_shm import arrow_pool
from dask_shm._core import ForgedHandleError, SpillFileError, live_mappings
from dask_shm.shared import born, born_store, dirty, integrity
from dask_shm.shared.payload import read_tracking_mapping, worth_sharing
from dask_shm.shared.tiers import TieredFiles
from dask_shm.spill_store import (
    MaxSpillExceeded,
    PickleError,
    SpillStore,
    compress_frames,
    file_stem,
    pack_header,
    serialize_unsplit,
)
from dask_shm.sysctl import max_map_count

logger = logging.getLogger(__name__)


def map_budget(max_maps: int | None = None) -> int:
    """Mappings a process may hold before its shared stores read by copy
    instead of mapping: half of ``max_maps`` (default: :func:`max_map_count`),
    leaving the rest to the interpreter, libraries and other mappings."""
    return (max_map_count() if max_maps is None else max_maps) // 2


def mapped_values_bound(max_maps: int | None = None) -> int:
    """Values a shared buffer keeps in memory through a mapping of their
    file, at most: an eighth of ``max_maps`` (default:
    :func:`max_map_count`; 8,191 for the kernel's default), so that a worker
    stays far below the limit with room for born-shared blocks (a quarter,
    see :mod:`dask_shm.shared.born`), the interpreter and libraries. Beyond
    it the least recently used mapped values go back to their files, which
    writes nothing (see :class:`~dask_shm.shared.buffer.SharedSpillBuffer`)."""
    return max((max_map_count() if max_maps is None else max_maps) // 8, 1)


@dataclass
class Retained:
    """A key whose value is in memory, backed by its still-existing file."""

    name: str
    value_id: int
    memory: int
    shareable: int
    #: its bytes on disk as counted when it was retained (left out of max_weight)
    disk: int = 0


@dataclass(frozen=True)
class Handle:
    """What a peer needs to take over a file: ``path`` inside the
    shared-memory root, ``size`` bytes; ``memory`` is the value's ``sizeof``
    and ``shareable`` the bytes that live in the mapping once deserialized.
    It travels in ``get_data`` replies as a few fields and no frames (see
    :mod:`dask_shm.shared.transfer`)."""

    path: str
    size: int
    memory: int
    shareable: int
    #: file name stem of the key (``spill_store.file_stem``)
    stem: str = "in"


class Unshared(NamedTuple):
    """A value not worth sharing, serialized to tell: ``header`` and its
    ``frames``, uncompressed and unsplit (see
    :func:`~dask_shm.spill_store.serialize_unsplit`), which a sender may pass
    on instead of serializing the value again."""

    header: dict
    frames: list


class SharedSpillStore(SpillStore):
    """Spill store for shared-memory mode. Same error contract as
    :class:`SpillStore`; additionally :meth:`export` and :meth:`adopt` move files
    between stores of the same host by hard link.

    Mapping is given up (values are read by copy, and stay private) when this
    process already holds more than half of ``vm.max_map_count`` mappings, or
    when ``mmap`` fails for lack of resources: degraded, never failed.
    """

    def __init__(
        self,
        tiers: TieredFiles,
        max_weight: int | Literal[False] = False,
        *,
        min_size: int,
        min_shared_fraction: float,
        metrics: defaultdict[tuple[str, str], float] | None = None,
        compression: str | None = None,
    ):
        """Files go to ``tiers`` (see :mod:`dask_shm.shared.tiers`), at most
        ``max_weight`` bytes in all; a value is shared (unspilled through a
        mapping, handed to peers by link) when its payload is at least
        ``min_size`` bytes and ``min_shared_fraction`` of its file. A value
        that is not (read back by copy, as in stock) is compressed with
        ``compression`` (a distributed codec name, e.g. ``"lz4"``; None:
        none), as stock compresses what it spills."""
        super().__init__(tiers, max_weight, metrics=metrics, mapped=True, compression=compression)
        #: where each file lives (see :mod:`dask_shm.shared.tiers`)
        self.tiers = tiers
        #: the first tier's root (the shared-memory root)
        self.root = tiers.tiers[0].root
        tiers.on_moved = self._moved
        self.min_size = min_size
        self.min_shared_fraction = min_shared_fraction
        #: file name -> shareable bytes, for files worth sharing
        self.shareable: dict[str, int] = {}
        #: keys in memory whose file is kept, least recently used first
        self.retained: dict[Key, Retained] = {}
        self._retained_disk = 0
        #: private values read back and still referenced elsewhere
        self._private_cache: weakref.WeakValueDictionary[Key, object] = (
            weakref.WeakValueDictionary()
        )
        self._map_budget = map_budget()
        self.degraded_reads = 0
        #: file name -> what it looked like when written or adopted
        self.fingerprints: dict[str, integrity.Fingerprint] = {}

    # -- writing -------------------------------------------------------------

    def _prepare(self, key: Key, value: object) -> tuple[dict, list, int | None]:
        """``value`` serialized (header and frames, uncompressed) and its
        shareable bytes (None when the value should stay private). Raises
        PickleError."""
        try:
            header, frames = serialize_unsplit(value, self._digest)
        except Exception as e:
            raise PickleError(key) from e
        share, shareable = worth_sharing(header, frames, self.min_size, self.min_shared_fraction)
        return header, frames, (shareable if share else None)

    def __setitem__(self, key: Key, value: object) -> None:
        self.write(key, value)

    def write(self, key: Key, value: object, *, only_shared: bool = False) -> bool:
        """Write ``value`` to a file for ``key``, as ``store[key] = value``
        does; returns whether it was written. With ``only_shared``, a value
        not worth sharing (see ``min_size``) is not: it is serialized to tell,
        and nothing else happens. Raises PickleError, MaxSpillExceeded or
        OSError."""
        if self.write_born(key, value):
            return True
        name = self.write_file(key, value, only_shared=only_shared)
        if isinstance(name, Unshared):
            return False
        self.register_file(key, name)
        return True

    def write_born(self, key: Key, value: object) -> bool:
        """If ``value`` is an array born shared, make its block ``key``'s file
        (only a header is written) and return True; else False, nothing
        done. Raises MaxSpillExceeded or OSError (see :meth:`adopt_born`)."""
        start = perf_counter()
        name = self.adopt_born(key, value)
        if name is None:
            return False
        self._digest_write(perf_counter() - start, born.header_size())
        # The born file is ours now: read-only, and its fingerprint is the
        # one later reads are checked against.
        self.fingerprints[name] = integrity.seal(str(self.files.path(name)))
        self.register_file(key, name)
        return True

    def write_file(
        self, key: Key, value: object, *, only_shared: bool = False, memory: int | None = None
    ) -> str | Unshared:
        """A new sealed file holding ``value``, accounted but no key's yet
        (:meth:`register_file` makes it ``key``'s, :meth:`drop_file` deletes
        it); when ``only_shared`` and the value is not worth sharing, nothing
        is written and the serialization that told comes back
        (:class:`Unshared`). ``memory`` is the value's ``sizeof`` when the
        caller knows it (a buffer's weight of the value); None: measured here.
        Needs no lock of the caller's: it reads ``value`` and touches only the
        new file (the copy releases the GIL). Raises PickleError,
        MaxSpillExceeded or OSError."""
        header, frames, shareable = self._prepare(key, value)
        if shareable is None:
            if only_shared:
                return Unshared(header, frames)
            if self._compression:  # read back by copy: compressed, as stock spills
                with context_meter.add_callback(self._record):  # stock's compress meter
                    header, frames = compress_frames(header, frames, self._compression)
        if memory is None:
            memory = safe_sizeof(value)
        name = self._write(key, [pack_header(header), *frames], memory)
        del frames
        arrow_pool.release_unused()  # serialization's temporary copies, if any
        try:
            self.fingerprints[name] = integrity.seal(str(self.files.path(name)))
        except OSError:
            self._forget_file(name)
            raise
        if shareable is not None:
            self.shareable[name] = shareable
        return name

    def register_file(self, key: Key, name: str) -> None:
        """File ``name`` (from :meth:`write_file` or :meth:`write_born`) is
        now ``key``'s spilled copy; a file ``key`` had before is deleted."""
        self._private_cache.pop(key, None)
        self._register(key, name)

    def adopt_born(self, key: Key, value: object) -> str | None:
        """Turn ``value``'s block into this store's file for ``key`` without
        copying its bytes: seal it (header in front, owner's pages private
        from now on), hard-link it in and hand it over (see
        :mod:`~dask_shm.shared.born_store`). Returns the file name, accounted
        and marked shareable but not registered for ``key`` (the caller
        registers or retains it), or None when ``value`` is not a whole
        born-shared numpy array whose serialized payload is the block itself,
        or when the first tier has no room for the file after moving a step
        of unmapped files down (about the file's size), or when sealing or
        linking the block fails (a full root, its file gone: the block is
        then sealed but still the arena's, and the value is unchanged); the
        caller then writes a file the ordinary way.
        Raises MaxSpillExceeded when the file would take the store past its
        ``max_weight``."""
        found = born_store.born_file(value)
        if found is None:
            return None
        size = found.size
        if self.max_weight is not False and self._spilled_disk() + size > self.max_weight:
            raise MaxSpillExceeded(key)
        if not self.tiers.make_room(size):
            return None  # no room in the first tier after moving a step of files down
        try:
            path = found.seal()
            if path is None:
                return None
            name, _ = self.tiers.adopt(path, size, file_stem(key), safe_sizeof(value))
        except (OSError, ForgedHandleError) as e:
            logger.info("dask-shm: %r is written the ordinary way: %s", key, e)
            return None
        found.hand_over(value, self.files.path(name), self.tiers.entry_of(name))
        self.shareable[name] = found.payload
        return name

    def _moved(self, name: str, path: str) -> None:
        """File ``name`` was copied to a later tier (a new inode at ``path``): it is
        read-only like every file of ours, and checked against its new
        fingerprint from now on. Raises OSError (the old fingerprint is
        dropped then: the file is not checked rather than wrongly refused)."""
        try:
            self.fingerprints[name] = integrity.seal(path)
        except OSError:
            self.fingerprints.pop(name, None)
            raise

    def _forget_file(self, name: str) -> None:
        self.shareable.pop(name, None)
        self.fingerprints.pop(name, None)
        super()._forget_file(name)

    # -- reading -------------------------------------------------------------

    def _verified_path(self, key: Key, name: str) -> str:
        """The path of file ``name`` (of ``key``), checked against its
        fingerprint; SpillFileError if it was tampered with. A mismatch is
        checked again with no move between tiers under way: a move by another
        thread changes the path and the fingerprint one after the other."""
        path = str(self.files.path(name))
        try:
            integrity.verify(key, path, self.fingerprints.get(name))
        except SpillFileError:
            with self.tiers.settled():
                path = str(self.files.path(name))
                integrity.verify(key, path, self.fingerprints.get(name))
        return path

    def load(self, key: Key) -> tuple[object, bool]:
        """Read a spilled key back. Returns ``(value, backed)``: ``backed`` is
        True when the value lives in a mapping of its file (the caller may then
        :meth:`retain` the file instead of deleting it)."""
        name = self.filenames[key]
        self._verified_path(key, name)
        if name not in self.shareable:
            cached = self._private_cache.get(key)
            if cached is not None:
                return cached, False
            value = self._read(key, name, mapped=False)
            try:
                self._private_cache[key] = value
            except TypeError:
                pass  # not weak-referenceable
            return value, False
        if live_mappings() >= self._map_budget:
            self.degraded_reads += 1
            return self._read(key, name, mapped=False), False
        try:
            return read_tracking_mapping(lambda: self._read(key, name, mapped=True))
        except OSError as e:
            if e.errno not in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):
                raise
            self.degraded_reads += 1
            return self._read(key, name, mapped=False), False

    def __getitem__(self, key: Key) -> object:
        return self.load(key)[0]

    def check_readable(self, key: Key) -> None:
        """Raise SpillFileError naming ``key`` if it is spilled here and its
        file vanished or was tampered with (one ``lstat``; nothing read)."""
        name = self.filenames.get(key)
        if name is None:
            return
        try:
            path = str(self.files.path(name))
            if not os.path.lexists(path):
                # Gone for a reason of ours (unspilled, moved down a tier) meanwhile?
                if self.filenames.get(key) != name or str(self.files.path(name)) != path:
                    return
                raise SpillFileError(f"the spilled file of key {key!r} ({path}) vanished")
        except KeyError:
            return  # deleted meanwhile
        self._verified_path(key, name)

    # -- retained files --------------------------------------------------------

    def retain(self, key: Key, value: object, name: str | None = None) -> None:
        """Keep a file backing ``value`` (in memory) for ``key``: by default
        the file ``key`` is spilled in, which leaves the store; or an adopted
        file ``name``. Its memory accounting drops to the shared bytes (none
        for a file of a tier that is not RAM)."""
        if name is None:
            name = self.filenames.pop(key)
        memory, disk = self.files.sizes(name)
        # A mapping of a file on a real file system is page cache the process's
        # RSS counts (RssFile), so such a value weighs its full size, like a
        # private one.
        shareable = self.shareable.get(name, 0) if self.tiers.holding(name).ram else 0
        self.retained[key] = Retained(name, id(value), memory, shareable, disk)
        self._retained_disk += disk
        self.files.set_memory(name, min(shareable, memory))
        self.tiers.pin(name)

    def release(self, key: Key, value: object) -> bool:
        """If ``value`` is the retained value of ``key``, put ``key`` back in
        the store without writing anything and return True. Raises
        MaxSpillExceeded if that would take the spilled files past
        ``max_weight`` (the value stays retained)."""
        r = self.retained.get(key)
        if r is None or r.value_id != id(value):
            return False
        if dirty.written_in_place(self._verified_path(key, r.name)):
            self.discard_retained(key)  # the caller writes the value as it is now
            return False
        if self.max_weight is not False and self._spilled_disk() + r.disk > self.max_weight:
            # Spilled again, it would take the spilled files past the limit,
            # as writing it would in stock: it stays in memory (file kept).
            raise MaxSpillExceeded(key)
        del self.retained[key]
        self._retained_disk -= r.disk
        self.files.set_memory(r.name, r.memory)
        self._register(key, r.name)
        self.tiers.unpin(r.name)
        return True

    def touch_retained(self, key: Key) -> None:
        """``key`` was used: if retained, it becomes the most recently used
        (:attr:`retained` is kept in order of use, least recent first)."""
        r = self.retained.pop(key, None)
        if r is not None:
            self.retained[key] = r

    def discard_retained(self, key: Key) -> None:
        """Delete the file kept for ``key``, if any (its value left memory or
        was replaced)."""
        r = self.retained.pop(key, None)
        if r is not None:
            self._retained_disk -= r.disk
            self._forget_file(r.name)

    def _unspilled_disk(self) -> int:
        # Files of values back in memory stay on disk here (stock deletes
        # them): max_weight bounds the spilled files only, else a worker
        # reading values back would hit it and pause for good.
        return max(self._retained_disk, 0)

    def _spilled_disk(self) -> int:
        """Bytes on disk of the spilled keys' files (what ``max_weight`` bounds)."""
        return int(self.files.total()[1]) - self._unspilled_disk()

    def private_weight(self, key: Key, value: object) -> int | None:
        """Private bytes of a retained value (``sizeof`` minus what lives in
        the mapping), or None if ``value`` is not the retained value of ``key``."""
        r = self.retained.get(key)
        if r is None or r.value_id != id(value):
            return None
        return max(safe_sizeof(value) - r.shareable, 0)

    def file_of(self, key: Key) -> str | None:
        """Name of the file holding ``key``, spilled or retained."""
        name = self.filenames.get(key)
        if name is None and key in self.retained:
            name = self.retained[key].name
        return name

    def path(self, key: Key) -> str:
        """Path of the file holding ``key``, spilled or retained."""
        name = self.file_of(key)
        if name is None:
            raise KeyError(key)
        return str(self.files.path(name))

    # -- hand-over between stores ------------------------------------------------

    def export(self, key: Key, tiers: Collection[int] | None = None) -> Handle | None:
        """A new hard link to ``key``'s file in its tier's outgoing directory,
        for a peer to adopt; None when the value is not worth sharing or its
        file is in a tier whose number is not in ``tiers`` (default: any
        linkable tier). The caller deletes the link once
        the peer has it. Raises OSError when the link cannot be made (EMLINK,
        ...), SpillFileError when the file was tampered with."""
        name = self.file_of(key)
        if name is None or name not in self.shareable:
            return None
        file_path = self._verified_path(key, name)
        fingerprint = self.fingerprints.get(name)
        memory, _ = self.files.sizes(name)
        r = self.retained.get(key)
        if r is not None and dirty.written_in_place(file_path):
            return None  # written in place: the file is no longer the value
        if r is not None:
            memory = r.memory
        path = self.tiers.link_out(name, tiers)
        if path is None:
            return None
        # The fingerprint's size was just checked against the file.
        size = os.stat(path).st_size if fingerprint is None else fingerprint.size
        return Handle(path, size, memory, self.shareable[name], file_stem(key))

    def adopt(self, handle: Handle) -> str:
        """Link a peer's file in (one validated hard link, into the tier
        whose root holds it). It is not registered as any key's: the caller
        retains it for a key or deletes it (:meth:`drop_file`). Returns the
        file name. Raises ForgedHandleError or OSError."""
        name, _ = self.tiers.adopt(handle.path, handle.size, handle.stem, handle.memory)
        self.shareable[name] = handle.shareable
        self.fingerprints[name] = integrity.fingerprint(str(self.files.path(name)))
        return name

    def map_file(self, name: str) -> list[memoryview]:
        """Frames of file ``name`` as views of a private mapping (for a file
        just adopted). Raises OSError."""
        return self.files.read_mapped(name)

    def read_file(self, name: str) -> list[memoryview]:
        """Frames of file ``name`` copied into private memory. Raises OSError."""
        return self.files.read(name)

    def drop_file(self, name: str) -> None:
        """Delete a file that no key holds (an abandoned arrival)."""
        self._forget_file(name)

    def pin_file(self, name: str) -> None:
        """Keep file ``name`` in its tier while a value maps it."""
        self.tiers.pin(name)

    def __repr__(self) -> str:
        return (
            f"<SharedSpillStore {self.directory}: {len(self)} spilled, "
            f"{len(self.retained)} retained>"
        )
