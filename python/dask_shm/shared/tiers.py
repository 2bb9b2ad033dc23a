"""Tier 2 (tmpfs) over tier 3 (a real file system), behind one FileStore face.

:class:`TieredFiles` has the methods of :class:`~dask_shm._core.FileStore`
that the spill stores use, so :class:`~dask_shm.shared.store.SharedSpillStore`
does not know there are two tiers. Its one concern is *where* a file lives:

- ``put`` writes to tier 2 while the :class:`~dask_shm._core.TierBudget`
  allows; what does not fit is written straight to tier 3, and so is
  everything once the tmpfs reported ENOSPC (the budget shrinks to what is
  in tier 2 then). Nothing is kept in memory because the tmpfs is full.
- when tier 2 is over its budget (files that were mapped by values in
  memory are released, the budget shrank), the least recently used files
  that no value maps (unpinned) move to tier 3.
- a move copies the file in Rust with the GIL released
  (:func:`~dask_shm._core.move_entry`); the entry keeps its name here, so
  callers never see it move (except the owner's :attr:`TieredFiles.on_moved`
  hook: the copy is a new file, to be sealed and fingerprinted again).
- tier-3 files are read and mapped (``MAP_PRIVATE``) like tier-2 ones, and
  linked out to same-host peers on their file system; their page cache is the
  one shared copy, which the kernel can reclaim under pressure.

A file received from a peer counts in the budget at this holder's share
(size / holders when it arrives), as it does in the memory accounting.

Names: tier-2 entries use the tier-2 store's names; entries written to or
adopted into tier 3 directly are ``3:<name>`` (``:`` never occurs in a
store name, see ``spill_store.file_stem``); moved entries keep their tier-2 name.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Any

from dask_shm._core import FileStore, TierBudget, move_entry

logger = logging.getLogger(__name__)

#: per-file overhead of the spill format (header, alignment), an upper bound
#: used only to decide where a file goes before it is written
_FRAME_OVERHEAD = 128


def _is_full(e: OSError) -> bool:
    """ENOSPC or EDQUOT (the Rust store's OSErrors may carry the code only in
    their message, as "(os error 28)")."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    return e.errno in codes or any(f"(os error {c})" in str(e) for c in codes)


@functools.lru_cache(maxsize=64)
def _real_directory(directory: str) -> str:
    """``os.path.realpath`` of a directory, remembered: the roots and the
    directories files are adopted from are few and long-lived (a renamed or
    re-pointed directory is still caught by the store's own checks when it
    opens the file inside the root)."""
    return os.path.realpath(directory)


def _real_path(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(_real_directory(head), tail)


class TieredFiles:
    """Entries in tier 2 (``tmpfs``) up to ``budget`` bytes, the rest in
    tier 3 (``disk``). Thread-safe (its state changes under one lock).

    Parameters
    ----------
    tmpfs, disk:
        The two stores (``disk`` must not recycle files: they are mapped).
    budget:
        Bytes of tier-2 files to keep at most (files pinned by mapped values
        may exceed it; they move once unpinned).
    roots:
        ``(tier-2 root, tier-3 root)``: the directories peers' handles are
        validated against when adopting their files.
    outgoing:
        ``(tier-2 dir, tier-3 dir)`` for links handed to peers; each on its tier's
        file system.
    """

    def __init__(
        self,
        tmpfs: FileStore,
        disk: FileStore,
        budget: int,
        *,
        roots: tuple[str, str],
        outgoing: tuple[str, str],
    ):
        self.tmpfs = tmpfs
        self.disk = disk
        self.budget = TierBudget(budget)
        self.roots = roots
        self.outgoing = outgoing
        self._lock = threading.RLock()
        #: name here -> name in ``disk``, for every tier-3 entry
        self._in_disk: dict[str, str] = {}
        self.moves = 0
        self.moved_bytes = 0
        self.direct_to_disk = 0
        self.tmpfs_full = False
        #: called as ``on_moved(name, new path)`` after an entry moved to tier 3
        #: (the file there is a new inode: its owner re-seals and re-fingerprints it)
        self.on_moved: Callable[[str, str], None] | None = None

    # -- where things are --------------------------------------------------------

    def _locate(self, name: str) -> tuple[FileStore, str]:
        inner = self._in_disk.get(name)
        if inner is not None:
            return self.disk, inner
        return self.tmpfs, name

    def tier_of(self, name: str) -> int:
        """2 or 3; KeyError for an unknown entry."""
        if name in self._in_disk:
            return 3
        if name in self.tmpfs:
            return 2
        raise KeyError(name)

    def tier2_bytes(self) -> int:
        """Bytes of tier-2 files that count for this store (1/k of a file
        with k hard links): what this worker holds in the tmpfs. O(1); link
        counts that peers changed are seen after :meth:`refresh_links`."""
        return int(self.tmpfs.total()[1])

    def refresh_links(self) -> int:
        """Correct the link counts of both tiers' shared files (O(shared
        files), the GIL released: for a background thread); returns how
        many changed."""
        return int(self.tmpfs.refresh_links()) + int(self.disk.refresh_links())

    # -- moving ------------------------------------------------------------------

    def _move(self, name: str) -> bool:
        """Move tier-2 entry ``name`` to tier 3; False (logged) if it failed."""
        try:
            inner, disk = move_entry(self.tmpfs, name, self.disk)
        except (KeyError, OSError) as e:
            logger.warning("dask-shm: could not move %s to tier 3: %s", name, e)
            self.budget.remove(name)
            return False
        self.budget.remove(name)
        self._in_disk[name] = inner
        self.moves += 1
        self.moved_bytes += disk
        if self.on_moved is not None:
            try:
                self.on_moved(name, str(self.disk.path(inner)))
            except OSError as e:
                logger.warning("dask-shm: could not seal %s after its move: %s", name, e)
        return True

    def enforce(self, incoming: int = 0) -> bool:
        """Move unpinned least recently used files to tier 3 until tier 2 is
        within its budget with room for ``incoming`` bytes; returns whether
        that room exists."""
        with self._lock:
            victims, fits = self.budget.plan(incoming)
            for name in victims:
                self._move(name)
            return fits

    def pin(self, name: str) -> None:
        """A value in memory maps ``name``'s file: it stays where it is."""
        with self._lock:
            self.budget.pin(name)

    def unpin(self, name: str) -> None:
        """No value maps ``name`` any longer; it may move (now, if over budget)."""
        with self._lock:
            self.budget.unpin(name)
            self.enforce()

    # -- the FileStore face ----------------------------------------------------

    @property
    def directory(self) -> str:
        return str(self.tmpfs.directory)

    @property
    def pooled(self) -> tuple[int, int]:
        return (0, 0)

    def put(
        self, stem: str, frames: Iterable[Any], memory: int, max_disk: int | None = None
    ) -> tuple[str, int] | None:
        """Write a new entry: tier 2 if it fits the budget, else straight to
        tier 3 (no file is written twice). Same contract as ``FileStore.put``;
        ``max_disk`` bounds both tiers together."""
        frames = list(frames)
        size = sum(memoryview(f).nbytes for f in frames) + _FRAME_OVERHEAD * (len(frames) + 1)
        with self._lock:
            self.enforce()
            if self.budget.used + size <= self.budget.limit:
                rest = None if max_disk is None else max(0, max_disk - self.disk.total()[1])
                try:
                    stored = self.tmpfs.put(stem, frames, memory, rest)
                except OSError as e:
                    if not _is_full(e):
                        raise
                    self._on_tmpfs_full(e)
                else:
                    if stored is not None:
                        self.budget.add(stored[0], stored[1])
                    return stored
            rest = None if max_disk is None else max(0, max_disk - self.tmpfs.total()[1])
            stored = self.disk.put(stem, frames, memory, rest)
            if stored is None:
                return None
            name = f"3:{stored[0]}"
            self._in_disk[name] = stored[0]
            self.direct_to_disk += 1
            return name, stored[1]

    def _on_tmpfs_full(self, e: OSError) -> None:
        if not self.tmpfs_full:
            logger.warning(
                "dask-shm: the shared-memory root is full (%s); new spills go to %s",
                e,
                self.disk.directory,
            )
        self.tmpfs_full = True
        self.budget.limit = min(self.budget.limit, self.budget.used)

    def adopt(self, path: str, size: int, stem: str, memory: int) -> tuple[str, int]:
        """Hard-link a peer's validated file in, into the tier whose root
        holds ``path``. Raises ForgedHandleError or OSError (as FileStore.adopt)."""
        tier3_root = self.roots[1]
        with self._lock:
            if _real_path(path).startswith(_real_directory(tier3_root) + os.sep):
                inner, disk = self.disk.adopt(tier3_root, path, size, stem, memory)
                name = f"3:{inner}"
                self._in_disk[name] = inner
                return name, disk
            name, disk = self.tmpfs.adopt(self.roots[0], path, size, stem, memory)
            # Budgeted at this holder's share: the sender keeps its link (the
            # peer's outgoing link, the last one, goes once the handshake ends).
            holders = max(self.tmpfs.link_count(name) - 1, 1)
            self.budget.add(name, disk // holders)
            return name, disk

    def link_out(self, name: str, tiers: Collection[int] = (2, 3)) -> str | None:
        """A new hard link to ``name``'s file in its tier's outgoing directory;
        None when the file is in a tier not in ``tiers`` (checked under the
        lock: a file cannot move between the check and the link)."""
        with self._lock:
            store, inner = self._locate(name)
            tier = 3 if store is self.disk else 2
            if tier not in tiers:
                return None
            out = self.outgoing[1] if tier == 3 else self.outgoing[0]
            return str(store.link_out(inner, out))

    def read(self, name: str) -> list[memoryview]:
        store, inner = self._locate(name)
        self.budget.touch(name)
        return store.read(inner)

    def read_mapped(self, name: str) -> list[memoryview]:
        store, inner = self._locate(name)
        self.budget.touch(name)
        return store.read_mapped(inner)

    def delete(self, name: str) -> tuple[int, int] | None:
        with self._lock:
            store, inner = self._locate(name)
            self._in_disk.pop(name, None)
            self.budget.remove(name)
            return store.delete(inner)

    def sizes(self, name: str) -> tuple[int, int]:
        store, inner = self._locate(name)
        return store.sizes(inner)

    def set_memory(self, name: str, memory: int) -> None:
        store, inner = self._locate(name)
        store.set_memory(inner, memory)

    def link_count(self, name: str) -> int:
        store, inner = self._locate(name)
        return store.link_count(inner)

    def path(self, name: str) -> str:
        store, inner = self._locate(name)
        return str(store.path(inner))

    def total(self) -> tuple[int, int]:
        m2, d2 = self.tmpfs.total()
        m3, d3 = self.disk.total()
        return m2 + m3, d2 + d3

    def names(self) -> list[str]:
        return [*self.tmpfs.names(), *self._in_disk]

    def __len__(self) -> int:
        return len(self.tmpfs) + len(self.disk)

    def __contains__(self, name: str) -> bool:
        return name in self._in_disk or name in self.tmpfs

    def __repr__(self) -> str:
        return (
            f"<TieredFiles tier 2 {self.tmpfs.directory} ({len(self.tmpfs)} files, "
            f"{self.budget.used} of {self.budget.limit} bytes), tier 3 "
            f"{self.disk.directory} ({len(self.disk)} files)>"
        )
