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
import os
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import msgpack
from dask.typing import Key
from distributed.metrics import context_meter
from distributed.sizeof import safe_sizeof

from dask_shm._core import live_mappings
from dask_shm.shared import dirty, integrity
from dask_shm.shared.payload import read_tracking_mapping, worth_sharing
from dask_shm.spill_store import PickleError, SpillStore, file_stem, serialize_unsplit


def max_map_count() -> int:
    """vm.max_map_count, or a conservative default when it cannot be read."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@dataclass
class Retained:
    """A key whose value is in memory, backed by its still-existing file."""

    name: str
    value_id: int
    memory: int
    shareable: int


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
        spill_directory: str,
        max_weight: int | Literal[False] = False,
        *,
        root: str,
        outgoing_directory: str,
        min_size: int,
        min_shared_fraction: float,
        metrics: defaultdict[tuple[str, str], float] | None = None,
    ):
        super().__init__(spill_directory, max_weight, metrics=metrics, mapped=True)
        self.root = root
        self.outgoing_directory = outgoing_directory
        self.min_size = min_size
        self.min_shared_fraction = min_shared_fraction
        #: file name -> shareable bytes, for files worth sharing
        self.shareable: dict[str, int] = {}
        #: keys in memory whose file is kept
        self.retained: dict[Key, Retained] = {}
        #: private values read back and still referenced elsewhere
        self._private_cache: weakref.WeakValueDictionary[Key, object] = (
            weakref.WeakValueDictionary()
        )
        self._map_budget = max_map_count() // 2
        self.degraded_reads = 0
        #: file name -> what it looked like when written or adopted
        self.fingerprints: dict[str, integrity.Fingerprint] = {}

    # -- writing -------------------------------------------------------------

    def _prepare(self, key: Key, value: object) -> tuple[list, int | None]:
        """File frames for ``value`` and its shareable bytes (None when the
        value should stay private). Raises PickleError."""
        try:
            header, frames = serialize_unsplit(value)
        except Exception as e:
            raise PickleError(key) from e
        share, shareable = worth_sharing(header, frames, self.min_size, self.min_shared_fraction)
        return [msgpack.dumps(header, use_bin_type=True), *frames], (shareable if share else None)

    def __setitem__(self, key: Key, value: object) -> None:
        with context_meter.add_callback(self._record):
            frames, shareable = self._prepare(key, value)
            name = self._write(key, frames, safe_sizeof(value))
        self.fingerprints[name] = integrity.seal(str(self.files.path(name)))
        if shareable is not None:
            self.shareable[name] = shareable
        self._private_cache.pop(key, None)
        self._register(key, name)

    def _forget_file(self, name: str) -> None:
        self.shareable.pop(name, None)
        self.fingerprints.pop(name, None)
        super()._forget_file(name)

    # -- reading -------------------------------------------------------------

    def load(self, key: Key) -> tuple[object, bool]:
        """Read a spilled key back. Returns ``(value, backed)``: ``backed`` is
        True when the value lives in a mapping of its file (the caller may then
        :meth:`retain` the file instead of deleting it)."""
        name = self.filenames[key]
        integrity.verify(key, str(self.files.path(name)), self.fingerprints.get(name))
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

    # -- retained files --------------------------------------------------------

    def retain(self, key: Key, value: object, name: str | None = None) -> None:
        """Keep a file backing ``value`` (in memory) for ``key``: by default
        the file ``key`` is spilled in, which leaves the store; or an adopted
        file ``name``. Its memory accounting drops to the shared bytes."""
        if name is None:
            name = self.filenames.pop(key)
        memory, _ = self.files.sizes(name)
        shareable = self.shareable.get(name, 0)
        self.retained[key] = Retained(name, id(value), memory, shareable)
        self.files.set_memory(name, min(shareable, memory))

    def release(self, key: Key, value: object) -> bool:
        """If ``value`` is the retained value of ``key``, put ``key`` back in
        the store without writing anything and return True."""
        r = self.retained.get(key)
        if r is None or r.value_id != id(value):
            return False
        integrity.verify(key, str(self.files.path(r.name)), self.fingerprints.get(r.name))
        if dirty.written_in_place(str(self.files.path(r.name))):
            self.discard_retained(key)  # the caller writes the value as it is now
            return False
        del self.retained[key]
        self.files.set_memory(r.name, r.memory)
        self._register(key, r.name)
        return True

    def discard_retained(self, key: Key) -> None:
        """Delete the file kept for ``key``, if any (its value left memory or
        was replaced)."""
        r = self.retained.pop(key, None)
        if r is not None:
            self._forget_file(r.name)

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

    def export(self, key: Key) -> Handle | None:
        """A new hard link to ``key``'s file in the outgoing directory, for a
        peer to adopt; None when the value is not worth sharing. The caller
        deletes the link once the peer has it. Raises OSError when the link
        cannot be made (EMLINK, ...)."""
        name = self.file_of(key)
        if name is None or name not in self.shareable:
            return None
        integrity.verify(key, str(self.files.path(name)), self.fingerprints.get(name))
        memory, _ = self.files.sizes(name)
        r = self.retained.get(key)
        if r is not None and dirty.written_in_place(str(self.files.path(name))):
            return None  # written in place: the file is no longer the value
        if r is not None:
            memory = r.memory
        path = str(self.files.link_out(name, self.outgoing_directory))
        return Handle(path, os.stat(path).st_size, memory, self.shareable[name])

    def adopt(self, key: Key, handle: Handle) -> str:
        """Link a peer's file in for ``key`` (not registered as spilled: the
        caller either retains it or registers it). Returns the file name.
        Raises ForgedHandleError or OSError."""
        name, _ = self.files.adopt(
            self.root, handle.path, handle.size, file_stem(key), handle.memory
        )
        self.shareable[name] = handle.shareable
        self.fingerprints[name] = integrity.fingerprint(str(self.files.path(name)))
        return name

    def __repr__(self) -> str:
        return (
            f"<SharedSpillStore {self.directory}: {len(self)} spilled, "
            f"{len(self.retained)} retained>"
        )
