"""The file tiers after private memory: an ordered list behind one FileStore face.

A worker's values live in private memory (tier 1), then in file tiers,
fastest first. :func:`tier_specs` is the one place that lists them (by
default the shared-memory tmpfs, tier 2, within a byte budget, then a
directory on a real file system, tier 3, unbounded); :func:`open_tiers`
makes a buffer's :class:`FileTier` of each, and :class:`TieredFiles` puts
them behind the methods of :class:`~dask_shm._core.FileStore` that the spill
stores use (the :class:`~dask_shm.spill_store.SpillFiles` protocol), so
:class:`~dask_shm.shared.store.SharedSpillStore` does not know how many tiers
there are. Its one concern is *where* a file lives:

- ``put`` writes to the first tier whose budget allows (the last tier has
  none); a tier that reported ENOSPC or EDQUOT is *full*: its budget shrinks
  to what it holds and new files go past it. Nothing is kept in memory
  because a tier is full.
- when a tier is over its budget (files that were mapped by values in
  memory are released, the budget shrank), its least recently used files
  that no value maps (unpinned) move to the next tier, and so on down, a
  bounded step at a time: each ``put`` and ``unpin`` moves some, and
  :meth:`TieredFiles.relieve` (a worker's relief thread) the rest. Files a
  peer links too go last (moving one frees no RAM while the peer holds it,
  and each holder would write its own copy).
- a move copies the file in Rust with the GIL released
  (:func:`~dask_shm._core.move_entry`); the entry keeps its name here, so
  callers never see it move (except the owner's :attr:`TieredFiles.on_moved`
  hook: the copy is a new file, to be sealed and fingerprinted again).
- files of every tier are read and mapped (``MAP_PRIVATE``) alike, and those
  of a linkable tier are linked out to same-host peers on its file system; a
  non-RAM tier's page cache is the one shared copy, which the kernel can
  reclaim under pressure.

A file received from a peer counts in its tier's budget at this holder's
share (size / holders when it arrives), as it does in the memory accounting.

Names: first-tier entries use that tier's store's names; entries written to
or adopted into a later tier directly are ``<tier number>:<name>`` (``:``
never occurs in a store name, see ``spill_store.file_stem``); moved entries
keep their name.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dask_shm._core import FileStore, TierBudget, move_entry
from dask_shm.shared import paths

logger = logging.getLogger(__name__)

#: per-file overhead of the spill format (header, alignment), an upper bound
#: used only to decide where a file goes before it is written
_FRAME_OVERHEAD = 128

#: bytes of files over budget moved down per hold of the lock by an unpin
#: (at least one file; a put moves about the size of what it writes) and per
#: step of a worker's relief thread (:meth:`TieredFiles.relieve`): a budget
#: lowered by gigabytes does not stall one caller (a worker's event loop
#: spilling a value) for the whole move
MOVE_STEP = 16 * 2**20

#: number of the first file tier (tier 1 is private memory)
FIRST_FILE_TIER = 2


@dataclass(frozen=True)
class TierSpec:
    """Where a file tier lives and what its files are, from settings.

    ``name`` names its figures (``<name>_bytes``, ``<name>_budget``,
    ``<name>_moves`` in the worker's metrics, see
    :func:`~dask_shm.shared.metrics.tier_figures`);
    ``ram``: its files are RAM (a tmpfs): they count in the worker's memory
    and a value mapping one costs only its private bytes; ``linkable``: its
    files may be handed to same-host peers by hard link (its root then gets
    an identity token); ``registry``: its root also holds the peer registry
    (swept with the dead processes' directories)."""

    name: str
    root: str
    ram: bool
    linkable: bool = True
    registry: bool = False
    #: bytes it may hold, when fixed by settings (a budget given to
    #: :func:`open_tiers`, such as the worker's tmpfs budget, takes precedence)
    budget: int | None = None


class _Roots(Protocol):
    """The settings :func:`tiers_of` reads (``SharedMemorySettings``)."""

    @property
    def root(self) -> str: ...
    @property
    def disk_root(self) -> str: ...


def tier_specs(root: str, disk_root: str) -> list[TierSpec]:
    """The file tiers, fastest first, from the ``shm.shared-memory`` roots:
    the shared-memory tmpfs ``root`` (tier 2), then ``disk_root`` on a real
    file system (tier 3). A new tier is a new entry here and in
    :func:`tiers_of` (its root and budget new settings) plus, if it is not a
    directory of files, its store in :func:`open_tiers`, and optionally what
    people read for it in :data:`TITLES`."""
    return [
        TierSpec("shared", root, ram=True, registry=True),
        TierSpec("disk", disk_root, ram=False),
    ]


#: How ``dask shm info`` (a word) and the dashboard (a phrase) call a tier's
#: files, by tier name; a tier not listed is called by its name (see
#: :func:`titles`).
TITLES: dict[str, tuple[str, str]] = {
    "shared": ("tmpfs", "shared-memory files"),
    "disk": ("disk", "files on disk"),
}


def titles(name: str) -> tuple[str, str]:
    """(word, phrase) that people read for the tier called ``name``."""
    return TITLES.get(name, (name, f"{name} files"))


def tiers_of(settings: _Roots, root: str | None = None) -> list[TierSpec]:
    """:func:`tier_specs` of parsed ``shm.shared-memory`` settings, with
    ``root`` (if given) in place of ``settings.root``: what the plugins, ``dask
    shm info`` and ``dask shm clean`` use, so that a tier's new settings reach
    them all from here."""
    return tier_specs(root or settings.root, settings.disk_root)


@dataclass(frozen=True)
class FileTier:
    """One file tier of a buffer: its files in ``store`` (a directory under
    ``root``), links for peers in ``outgoing`` (same file system), at most
    ``budget`` bytes (None: unbounded, the last tier). ``number`` is its
    place (2 for the first file tier); the rest as in :class:`TierSpec`."""

    name: str
    number: int
    root: str
    store: FileStore
    outgoing: str
    budget: TierBudget | None
    ram: bool
    linkable: bool

    @functools.cached_property
    def directory(self) -> str:
        # Remembered: paths are built from it at every write and export, and
        # the store's directory never changes (building a pathlib.Path each
        # time cost several microseconds).
        return str(self.store.directory)


def open_tiers(
    specs: Sequence[TierSpec], buffer_name: str, budgets: Mapping[str, int]
) -> list[FileTier]:
    """A buffer's tiers: for each spec, the store
    ``<root>/dask-shm-<uid>/<process>/<buffer_name>`` and the outgoing
    directory next to it, within ``budgets[spec.name]`` bytes, else
    ``spec.budget`` (neither: unbounded; only the last may be, and must be).
    Raises ValueError for a budget on the last tier or none on another,
    OSError if a directory cannot be made."""
    if not specs:
        raise ValueError("at least one file tier is needed")
    limits = {s.name: budgets.get(s.name, s.budget) for s in specs}
    if limits[specs[-1].name] is not None:
        raise ValueError(f"the last tier ({specs[-1].name}) takes what the others do not fit")
    unbounded = [s.name for s in specs[:-1] if limits[s.name] is None]
    if unbounded:
        raise ValueError(f"tier(s) {', '.join(unbounded)} need a budget")
    return [
        FileTier(
            name=spec.name,
            number=FIRST_FILE_TIER + i,
            root=spec.root,
            # No recycling: files are mapped. Deletes are paced: a worker
            # releases keys in batches within one event-loop callback.
            store=FileStore(paths.subdir(spec.root, buffer_name), defer_deletes=True),
            outgoing=paths.subdir(spec.root, "outgoing"),
            budget=None if (limit := limits[spec.name]) is None else TierBudget(limit),
            ram=spec.ram,
            linkable=spec.linkable,
        )
        for i, spec in enumerate(specs)
    ]


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
    """Entries in ``tiers``, fastest first, each within its budget (the last
    takes the rest). Thread-safe (its state changes under one lock).

    ``tiers`` come from :func:`open_tiers`; their stores must not recycle
    files (they are mapped).
    """

    def __init__(self, tiers: Sequence[FileTier]):
        if not tiers or tiers[-1].budget is not None:
            raise ValueError("the last tier must be unbounded")
        #: the file tiers, fastest first
        self.tiers: tuple[FileTier, ...] = tuple(tiers)
        self._first = self.tiers[0]
        # ram_bytes runs at every eviction decision of the charged LRU
        self._ram_stores = [t.store for t in self.tiers if t.ram]
        self._lock = threading.RLock()
        #: entries pinned after a failed move, until a move succeeds again
        self._stuck: set[str] = set()
        #: name here -> (index in ``tiers``, name in its store), for every
        #: entry not in the first tier
        self._placed: dict[str, tuple[int, str]] = {}
        #: writes in flight so far (names their budget reservations)
        self._reservations = 0
        #: files moved to a later tier, and their bytes
        self.moves = 0
        self.moved_bytes = 0
        #: tier name -> files moved into it
        self.moved_in: dict[str, int] = {t.name: 0 for t in self.tiers}
        #: new files written past the first tier (it had no room)
        self.overflow_writes = 0
        #: names of the tiers that reported ENOSPC/EDQUOT (their budget shrank)
        self.full: set[str] = set()
        #: the most the first tier may hold: its budget as opened, lowered to
        #: what it held when its root reported full (:meth:`cap` lowers its
        #: budget below this for a while, never above)
        first_budget = self._first.budget
        self._ceiling = 0 if first_budget is None else first_budget.limit
        #: called as ``on_moved(name, new path)`` after an entry moved to a later
        #: tier (the file there is a new inode: its owner re-seals and
        #: re-fingerprints it)
        self.on_moved: Callable[[str, str], None] | None = None

    # -- where things are --------------------------------------------------------

    def tier(self, name: str) -> FileTier:
        """The tier called ``name``; KeyError if there is none."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def _locate(self, name: str) -> tuple[int, str]:
        """(index of the tier holding entry ``name``, its name in that store)."""
        return self._placed.get(name) or (0, name)

    def _entry_name(self, index: int, inner: str) -> str:
        return inner if index == 0 else f"{self.tiers[index].number}:{inner}"

    def tier_of(self, name: str) -> int:
        """The number of the tier holding entry ``name`` (2 for the first
        file tier); KeyError for an unknown entry."""
        return self.holding(name).number

    def entry_of(self, name: str) -> tuple[FileStore, str]:
        """The store holding entry ``name`` and its name there."""
        index, inner = self._locate(name)
        return self.tiers[index].store, inner

    def holding(self, name: str) -> FileTier:
        """The tier holding entry ``name``; KeyError for an unknown entry."""
        placed = self._placed.get(name)
        if placed is not None:
            return self.tiers[placed[0]]
        if name in self._first.store:
            return self._first
        raise KeyError(name)

    @property
    def ram_stores(self) -> list[FileStore]:
        """The stores of the RAM tiers, whose files :meth:`ram_bytes` counts."""
        return list(self._ram_stores)

    def ram_bytes(self) -> int:
        """Bytes of RAM tiers' files that count for this store (1/k of a file
        with k hard links): what this worker holds in tmpfs files. O(1); link
        counts that peers changed are seen after :meth:`refresh_links`."""
        stores = self._ram_stores
        if len(stores) == 1:  # the usual case; read at every eviction decision
            return int(stores[0].total()[1])
        return sum([int(store.total()[1]) for store in stores])

    def refresh_links(self) -> int:
        """Correct the link counts of every tier's shared files (O(shared
        files), the GIL released: for a background thread); returns how
        many changed. A file whose other links are all gone moves again
        in its turn; one that gained some moves after the others."""
        changed = 0
        for index, tier in enumerate(self.tiers):
            seen = tier.store.refresh_links_changed()
            changed += len(seen)
            if tier.budget is None or not seen:
                continue
            with self._lock:
                # The first tier's store names its entries as they are named here.
                here = None if index == 0 else self._names_here(index)
                for inner, links in seen:
                    name = inner if here is None else here.get(inner)
                    if name is not None:
                        tier.budget.set_deferred(name, links > 1)
        return changed

    def _names_here(self, index: int) -> dict[str, str]:
        """Name in the store of tier ``index`` (not the first) -> name here."""
        return {inner: name for name, (i, inner) in self._placed.items() if i == index}

    # -- moving ------------------------------------------------------------------

    def _move(self, name: str, index: int) -> bool:
        """Move entry ``name`` from tier ``index`` to the next; False (logged)
        if it failed."""
        src, dst = self.tiers[index], self.tiers[index + 1]
        _, inner = self._locate(name)
        assert src.budget is not None
        try:
            moved, disk = move_entry(src.store, inner, dst.store)
        except (KeyError, OSError) as e:
            logger.warning("dask-shm: could not move %s to tier %d: %s", name, dst.number, e)
            # It stays here and counts here; pinned, so that it is not tried
            # again at every write (the budget makes room with other files)
            # until a later move succeeds (the next tier has room again).
            src.budget.pin(name)
            self._stuck.add(name)
            return False
        self._unstick()
        src.budget.remove(name)
        if dst.budget is not None:
            dst.budget.add(name, disk)
        self._placed[name] = (index + 1, moved)
        self.moves += 1
        self.moved_bytes += disk
        self.moved_in[dst.name] += 1
        if self.on_moved is not None:
            try:
                self.on_moved(name, str(dst.store.path(moved)))
            except OSError as e:
                logger.warning("dask-shm: could not seal %s after its move: %s", name, e)
        return True

    def _unstick(self) -> None:
        """Files whose move failed may be tried again (a move just worked)."""
        while self._stuck:
            name = self._stuck.pop()
            budget = self.tiers[self._locate(name)[0]].budget
            if budget is not None:
                budget.unpin(name)

    def enforce(self, incoming: int = 0) -> bool:
        """Move unpinned least recently used files down the tiers until each
        is within its budget, the first with room for ``incoming`` bytes;
        returns whether that room exists."""
        return self._move_over_budget(incoming, None)[0]

    def relieve(self, max_bytes: int) -> int:
        """Like :meth:`enforce` without incoming bytes, but stop once about
        ``max_bytes`` have moved (at least one file, if any must move): a
        step that holds the lock for a bounded time. Returns the bytes moved;
        0 when every tier is within its budget or nothing over it may move
        (pinned)."""
        return self._move_over_budget(0, max_bytes)[1]

    def make_room(self, incoming: int) -> bool:
        """Like :meth:`enforce`, but move about ``incoming`` bytes at most
        (at least one file): whether the first tier has room for
        ``incoming`` bytes now. False, having moved a step, when more would
        have to move than that."""
        return self._move_over_budget(incoming, incoming)[0]

    def _move_over_budget(self, incoming: int, max_bytes: int | None) -> tuple[bool, int]:
        """(whether the first tier has room for ``incoming`` bytes, bytes
        moved), moving files over budget down the tiers until done or, with
        ``max_bytes``, once that many have moved. Files a peer links too
        move after the others (deferred in their tier's budget)."""
        with self._lock:
            fits, before = True, self.moved_bytes
            for index, tier in enumerate(self.tiers[:-1]):
                assert tier.budget is not None
                victims, room = tier.budget.plan(incoming if index == 0 else 0)
                if index == 0:
                    fits = room
                for done, name in enumerate(victims, 1):
                    self._move(name, index)
                    if max_bytes is not None and self.moved_bytes - before >= max_bytes:
                        if index == 0 and done < len(victims):
                            fits = False  # the room needs the victims left
                        return fits, self.moved_bytes - before
            return fits, self.moved_bytes - before

    @property
    def first_ceiling(self) -> int:
        """The most the first tier may hold (its configured budget, or what
        it held when its root reported full)."""
        return self._ceiling

    def cap(self, limit: int | None) -> int:
        """Set the first tier's budget to ``limit`` bytes, at most
        :attr:`first_ceiling` (None: back to it); returns the budget now.
        Files over it move at the next write or :meth:`relieve`."""
        budget = self._first.budget
        if budget is None:
            return 0
        with self._lock:
            budget.limit = self._ceiling if limit is None else max(0, min(limit, self._ceiling))
            return int(budget.limit)

    def pin(self, name: str) -> None:
        """A value in memory maps ``name``'s file: it stays where it is."""
        with self._lock:
            budget = self.tiers[self._locate(name)[0]].budget
            if budget is not None:
                budget.pin(name)

    def unpin(self, name: str) -> None:
        """No value maps ``name`` any longer; it may move. If its tier is over
        budget, up to :data:`MOVE_STEP` bytes of files move now."""
        with self._lock:
            budget = self.tiers[self._locate(name)[0]].budget
            if budget is not None:
                budget.unpin(name)
            self.relieve(MOVE_STEP)

    # -- the FileStore face ----------------------------------------------------

    @property
    def directory(self) -> str:
        return self._first.directory

    @property
    def pooled(self) -> tuple[int, int]:
        return (0, 0)

    def put(
        self, stem: str, frames: Iterable[Any], memory: int, max_disk: int | None = None
    ) -> tuple[str, int] | None:
        """Write a new entry into the first tier its budget fits (no file is
        written twice). Same contract as ``FileStore.put``; ``max_disk``
        bounds all tiers together (two writes racing into different tiers
        may pass it by one file).

        The bytes are copied without the lock: the tier's budget holds the
        room for them meanwhile (a pinned reservation, which no move picks),
        so a long write does not stall the other threads' reads, deletes and
        moves."""
        frames = list(frames)
        size = sum(memoryview(f).nbytes for f in frames) + _FRAME_OVERHEAD * (len(frames) + 1)
        # Files over budget (the budget was lowered) move a step at a time:
        # about this write's size here, the rest in later calls or relieve().
        self.relieve(size)  # takes the lock itself
        index = 0
        while True:
            with self._lock:
                index = self._fitting(index, size)
                tier = self.tiers[index]
                rest = None if max_disk is None else max(0, max_disk - self._others_disk(index))
                reservation = self._reserve(tier, size)
            try:
                stored = tier.store.put(stem, frames, memory, rest)
            except BaseException as e:
                with self._lock:
                    self._unreserve(tier, reservation)
                    if not isinstance(e, OSError) or tier.budget is None or not _is_full(e):
                        raise
                    self._on_full(index, e)
                index += 1
                continue
            with self._lock:
                self._unreserve(tier, reservation)
                if stored is None:
                    return None
                name = self._entry_name(index, stored[0])
                if tier.budget is not None:
                    tier.budget.add(name, stored[1])
                if index > 0:
                    self._placed[name] = (index, stored[0])
                    self.overflow_writes += 1
                return name, stored[1]

    def _fitting(self, start: int, size: int) -> int:
        """Index of the first tier from ``start`` whose budget has room for
        ``size`` more bytes (the last tier has no budget)."""
        for index in range(start, len(self.tiers)):
            budget = self.tiers[index].budget
            if budget is None or budget.used + size <= budget.limit:
                return index
        raise AssertionError("the last tier is unbounded")

    def _reserve(self, tier: FileTier, size: int) -> str | None:
        """Hold ``size`` bytes of ``tier``'s budget for a write in flight;
        the reservation's name, None for a tier without a budget."""
        if tier.budget is None:
            return None
        self._reservations += 1
        # "\0" never occurs in a file name: no entry can be called this.
        name = f"\0writing-{self._reservations}"
        tier.budget.add(name, size)
        tier.budget.pin(name)
        return name

    @staticmethod
    def _unreserve(tier: FileTier, reservation: str | None) -> None:
        if reservation is not None and tier.budget is not None:
            tier.budget.remove(reservation)

    def _others_disk(self, index: int) -> int:
        return sum(int(t.store.total()[1]) for i, t in enumerate(self.tiers) if i != index)

    def _on_full(self, index: int, e: OSError) -> None:
        tier = self.tiers[index]
        assert tier.budget is not None
        if tier.name not in self.full:
            logger.warning(
                "dask-shm: the %s root is full (%s); new spills go to %s",
                "shared-memory" if tier.ram else tier.name,
                e,
                self.tiers[index + 1].directory,
            )
        self.full.add(tier.name)
        tier.budget.limit = min(tier.budget.limit, tier.budget.used)
        if index == 0:
            self._ceiling = min(self._ceiling, tier.budget.used)

    def adopt(self, path: str, size: int, stem: str, memory: int) -> tuple[str, int]:
        """Hard-link a peer's validated file in, into the linkable tier whose
        root holds ``path`` (the first tier if none claims it: its store then
        refuses the path). Raises ForgedHandleError or OSError (as
        FileStore.adopt)."""
        index = self.index_named(path)
        tier = self.tiers[index]
        with self._lock:
            inner, disk = tier.store.adopt(tier.root, path, size, stem, memory)
            name = self._entry_name(index, inner)
            if index > 0:
                self._placed[name] = (index, inner)
            if tier.budget is not None:
                # Budgeted at this holder's share: the sender keeps its link (the
                # peer's outgoing link, the last one, goes once the handshake ends).
                holders = max(tier.store.link_count(inner) - 1, 1)
                tier.budget.add(name, disk // holders)
                tier.budget.set_deferred(name, holders > 1)
            return name, disk

    def index_named(self, path: str) -> int:
        """Index of the linkable tier whose root holds ``path`` (the first
        tier, where a root is inside another, the innermost), else 0 (also
        for a path no file can have: a peer's handle is not trusted)."""
        try:
            real = _real_path(path)
        except (ValueError, OSError):  # an embedded NUL, say
            return 0
        found, depth = 0, -1
        for index, tier in enumerate(self.tiers):
            root = _real_directory(tier.root)
            if tier.linkable and real.startswith(root + os.sep) and len(root) > depth:
                found, depth = index, len(root)
        return found

    def link_out(self, name: str, tiers: Collection[int] | None = None) -> str | None:
        """A new hard link to ``name``'s file in its tier's outgoing directory;
        None when the file is in a tier whose number is not in ``tiers``
        (default: every linkable tier) or that is not linkable (checked under
        the lock: a file cannot move between the check and the link)."""
        with self._lock:
            index, inner = self._locate(name)
            tier = self.tiers[index]
            if not tier.linkable or (tiers is not None and tier.number not in tiers):
                return None
            path = str(tier.store.link_out(inner, tier.outgoing))
            if tier.budget is not None:
                tier.budget.set_deferred(name, True)  # until a refresh sees the link go
            return path

    def settled(self) -> threading.RLock:
        """Held, no file moves between tiers: where a file is and what
        ``on_moved`` recorded about it agree."""
        return self._lock

    def _read(self, name: str, mapped: bool) -> list[memoryview]:
        index, inner = self._locate(name)
        tier = self.tiers[index]
        if tier.budget is not None:
            tier.budget.touch(name)
        return tier.store.read_mapped(inner) if mapped else tier.store.read(inner)

    def _read_settled(self, name: str, mapped: bool) -> list[memoryview]:
        # Unlocked first: a move (another thread's write relieving the tier)
        # may remove the file from where it was just located; then again
        # with no move under way.
        try:
            return self._read(name, mapped)
        except (KeyError, FileNotFoundError):
            with self._lock:
                return self._read(name, mapped)

    def read(self, name: str) -> list[memoryview]:
        return self._read_settled(name, mapped=False)

    def read_mapped(self, name: str) -> list[memoryview]:
        return self._read_settled(name, mapped=True)

    def delete(self, name: str) -> tuple[int, int] | None:
        with self._lock:
            index, inner = self._locate(name)
            tier = self.tiers[index]
            self._placed.pop(name, None)
            self._stuck.discard(name)
            if tier.budget is not None:
                tier.budget.remove(name)
            return tier.store.delete(inner)

    def sizes(self, name: str) -> tuple[int, int]:
        index, inner = self._locate(name)
        return self.tiers[index].store.sizes(inner)

    def set_memory(self, name: str, memory: int) -> None:
        index, inner = self._locate(name)
        self.tiers[index].store.set_memory(inner, memory)

    def link_count(self, name: str) -> int:
        index, inner = self._locate(name)
        return self.tiers[index].store.link_count(inner)

    def path(self, name: str) -> str:
        index, inner = self._locate(name)
        return os.path.join(self.tiers[index].directory, inner)

    def total(self) -> tuple[int, int]:
        memory = disk = 0
        for t in self.tiers:
            m, d = t.store.total()
            memory += m
            disk += d
        return memory, disk

    def names(self) -> list[str]:
        return [*self._first.store.names(), *self._placed]

    def __len__(self) -> int:
        return sum(len(t.store) for t in self.tiers)

    def __contains__(self, name: str) -> bool:
        return name in self._placed or name in self._first.store

    def __repr__(self) -> str:
        parts = []
        for t in self.tiers:
            budget = "" if t.budget is None else f", {t.budget.used} of {t.budget.limit} bytes"
            parts.append(f"tier {t.number} {t.directory} ({len(t.store)} files{budget})")
        return f"<TieredFiles {', '.join(parts)}>"
