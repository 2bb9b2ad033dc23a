"""Type stubs for the Rust extension module ``dask_shm._core``."""

from collections.abc import Callable, Collection, Iterable, Sequence
from os import PathLike
from typing import Any, Self, TypeVar, final

from typing_extensions import Buffer

__all__ = [
    "__version__",
    "AMM_MAX_COUNTED_WAITERS",
    "AMM_REJECTIONS",
    "AmmRun",
    "BORN_CACHE_DECAY",
    "born_block",
    "born_configure",
    "born_disown",
    "born_handler",
    "born_header_size",
    "born_release_cache",
    "born_release_expired",
    "born_seal",
    "born_stats",
    "buffer_address",
    "FileStore",
    "ForgedHandleError",
    "flush_deletes",
    "FRAME_ALIGN_MIN_LEN",
    "FRAME_ALIGNMENT",
    "file_fingerprint",
    "is_ram_backed",
    "live_mappings",
    "mapping_memory",
    "map_frames",
    "mapped_ranges",
    "MappedFile",
    "MappedRange",
    "move_entry",
    "pages_unmodified",
    "read_peer_file",
    "ReplicaHook",
    "replicas_to_keep",
    "ReplicaTracker",
    "seal_file",
    "set_numpy_handler",
    "SharePublishing",
    "SpillFileError",
    "TierBudget",
    "TrackerHub",
    "unlink_file",
    "watch_mappings",
    "written_in_place",
]

_T = TypeVar("_T")

__version__: str
#: A frame of at least FRAME_ALIGN_MIN_LEN bytes starts at a multiple of this
#: many bytes of its spill file; shorter frames are packed (as in stock's files).
FRAME_ALIGNMENT: int
FRAME_ALIGN_MIN_LEN: int
#: Seconds a freed born-shared block waits unused in the arena's free cache
#: before it is released, unless ``born_configure`` says otherwise.
BORN_CACHE_DECAY: float

class ForgedHandleError(ValueError):
    """A shared-memory handle from a peer names a file we must not accept
    (outside the root, a symlink, not a regular file, another owner, wrong size,
    not a spill file). Nothing was linked or mapped."""

class SpillFileError(OSError):
    """A spill file exists but cannot be read back: truncated, corrupted or not ours."""

@final
class MappedFile:
    """A private (copy-on-write), writable memory mapping of one spill file.

    Exposes the buffer protocol; writes never reach the file.
    """

    @property
    def path(self) -> str: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class FileStore:
    """A directory of spill files, one per entry, with their size accounting.

    Thread-safe. The directory is created with mode 0700; files are 0600,
    created with O_EXCL|O_NOFOLLOW under a temporary name and published whole.
    """

    def __new__(
        cls, directory: str | PathLike[str], recycle_bytes: int = 0, defer_deletes: bool = False
    ) -> Self:
        """Open (creating it 0700) the directory. ``recycle_bytes`` > 0 keeps up
        to that many bytes of removed entries' files (hidden ``.pool-*`` names,
        not entries) for later puts to overwrite instead of creating new files.
        Only files with one link, never shared, mapped or being read are kept.
        Never use it for a store whose files anyone maps: overwriting a file
        changes the pages a private mapping has not touched yet.

        ``defer_deletes``: a calling thread that deletes many files in a
        burst hands the excess to one process-wide thread (on a tmpfs, freeing
        a file's pages is most of a delete's cost): each thread deletes in
        place while its budget of unlink time lasts (10 ms at once, refilled
        at a tenth of the time that passes). A deferred ``delete`` returns once
        the entry is no longer accounted, and :func:`flush_deletes` waits for
        the files. In a forked child deletes happen at once. ValueError with
        ``recycle_bytes``."""
    @property
    def directory(self) -> str: ...
    @property
    def pooled(self) -> tuple[int, int]:
        """``(files, bytes)`` held for reuse; always ``(0, 0)`` without recycling."""
    def put(
        self,
        stem: str,
        frames: Iterable[Buffer],
        memory: int,
        max_disk: int | None = None,
    ) -> tuple[str, int] | None:
        """Write ``frames`` to a new file ``{stem}#{n}`` and account it.

        A frame may be a strided buffer (a numpy view such as ``a[1:, 1:]``):
        the file holds its bytes in C order, as a contiguous copy would, written
        straight from its rows where they are contiguous (runs of 4 KiB or
        more), else from one copy.

        Returns ``(file name, bytes on disk)``, or None, having written nothing,
        if the total on disk would exceed ``max_disk``. Raises OSError on I/O
        failure (nothing is accounted and no file is left behind).
        """
    def read(self, name: str) -> list[memoryview]:
        """Frames of a file, copied into one private bytearray.

        Raises KeyError for an unknown name, SpillFileError for a truncated or
        corrupted file, FileNotFoundError if the file was deleted behind our back.
        """
    def read_mapped(self, name: str) -> list[memoryview]:
        """Frames of a file as writable views of a private mapping; frames of
        at least FRAME_ALIGN_MIN_LEN bytes are FRAME_ALIGNMENT-aligned."""
    def give_for_reuse(self, name: str) -> bool:
        """Take the file ``name`` of this directory (an entry of this store
        or a file another process wrote here) into the reuse pool, or delete
        it if the pool cannot keep it; True if pooled. The caller guarantees
        nobody maps or reads it any more. OSError for an invalid name."""
    def forget(self, name: str) -> bool:
        """Stop accounting the entry ``name``, leaving its file in place;
        False if unknown."""
    def delete(self, name: str) -> tuple[int, int] | None:
        """Forget an entry and delete (or, recycling, pool) its file;
        ``(memory, disk)`` it had, or None."""
    def sizes(self, name: str) -> tuple[int, int]:
        """``(memory, disk)`` of one entry (disk divided by its last known
        link count); KeyError if unknown."""
    def total(self) -> tuple[int, int]:
        """``(memory, disk)`` summed over all entries, the disk size of a
        shared file divided by its last known link count (see
        :meth:`refresh_links`). O(1): no file is looked at."""
    def refresh_links(self) -> int:
        """Correct the link counts of shared entries, which other processes
        change (one ``lstat`` each, the GIL released: O(shared entries), for a
        background thread). Returns how many changed."""
    def refresh_links_changed(self) -> list[tuple[str, int]]:
        """:meth:`refresh_links`, returning ``(name, links now)`` of each
        entry whose count changed."""
    def shared_len(self) -> int:
        """Number of shared entries (what :meth:`refresh_links` looks at)."""
    def adopt(
        self,
        root: str | PathLike[str],
        path: str | PathLike[str],
        size: int,
        stem: str,
        memory: int,
    ) -> tuple[str, int]:
        """Validate a peer's spill file (inside ``<root>/dask-shm-<uid>`` once
        resolved, not a symlink, a regular file of ours, ``size`` bytes, a
        valid header) and hard-link it in as ``{stem}#{n}``, accounted as
        shared. Returns ``(name, disk_bytes)``. Raises ForgedHandleError for
        a handle that fails validation, OSError when the link fails (EXDEV,
        EMLINK, EPERM, ...)."""
    def link_out(self, name: str, directory: str | PathLike[str]) -> str:
        """Hard-link an entry's file into ``directory`` under a fresh name and
        return that path; the entry is accounted as shared from then on."""
    def set_memory(self, name: str, memory: int) -> None:
        """Change the memory size accounted for an entry; KeyError if unknown."""
    def link_count(self, name: str) -> int:
        """Number of hard links of an entry's file (also corrects the count
        :meth:`total` uses for it)."""
    def path(self, name: str) -> str: ...
    def names(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, name: str, /) -> bool: ...

def flush_deletes() -> None:
    """Wait until the files every ``FileStore(..., defer_deletes=True)`` was
    asked to delete before this call are gone (those it deleted in place are
    gone already)."""

# --- local shared-memory scheduler (rust/core/local_transport.rs, rust/py/local_transport.rs) ---

@final
class MappedRange:
    """``length`` bytes of a :class:`MappedFile` from ``offset``, exported through
    the buffer protocol (writable, private) and weakly referenceable: objects
    built on it keep it, and the mapping, alive.

    Raises ValueError if the range is not inside the mapping.
    """

    def __new__(cls, mapping: MappedFile, offset: int, length: int) -> Self: ...
    @property
    def mapping(self) -> MappedFile: ...
    @property
    def address(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def map_frames(path: str | PathLike[str]) -> tuple[MappedFile, int, list[tuple[int, int]]]:
    """Map a spill-format file written by any process, copy-on-write.

    Returns ``(mapping, base address, [(offset, length) per frame])``. Raises
    OSError (FileNotFoundError, ...) if it cannot be opened and SpillFileError
    if it is truncated, corrupted or not a spill file.
    """

def buffer_address(obj: Buffer) -> tuple[int, int]:
    """``(address, length)`` of the contiguous bytes ``obj`` exports; never copies.

    Raises BufferError if ``obj`` cannot export one contiguous buffer.
    """

def pages_unmodified(addr: int, len: int) -> bool:
    """True if no page of ``[addr, addr + len)`` was written since it was
    mapped from its file (read from ``/proc/self/pagemap``). The range must lie
    in a live private file mapping. Raises OSError if pagemap is unreadable.
    """

# --- Active Memory Manager (rust/core/amm.rs decides; rust/py/amm*.rs bind) ---

#: ``{code: message}`` for every rejection code ``AmmRun.last_reject`` can hold: the
#: single definition of the codes (``amm::Reject``). Messages are stock's log
#: messages, as ``str.format`` templates over the task's ``state``; empty where stock
#: rejects silently (a drop of a task without replicas).
AMM_REJECTIONS: dict[int, str]
#: Below this many waiters ReduceReplicas counts the places they wait at.
AMM_MAX_COUNTED_WAITERS: int

def replicas_to_keep(desired: int, waiters: Iterable[Any] | None) -> int:
    """Replicas stock's ReduceReplicas keeps for a task wanting ``desired`` whose
    waiting dependents are ``waiters``: ``max(desired, waiters)``, waiters counted
    by distinct place (``processing_on`` or the waiter) when ``desired < n <
    AMM_MAX_COUNTED_WAITERS``."""

@final
class ReplicaTracker:
    """The over-replicated tasks and the tasks changed since the last run, kept in
    Rust between ReduceReplicas runs (``AmmRun.reduce_replicas_tracked``), so a run
    looks only at those, the tasks with pending actions and KeepReplicas targets.
    The first run, a new ``replicated_tasks`` object, ``request_rescan`` and too
    many changes fall back to a full scan. Weak-referenceable."""

    def __init__(self) -> None: ...
    def touch(self, ts: Any) -> None:
        """``ts``'s replicas (or waiters) may have changed."""
    def touch_dependencies(self, ts: Any) -> None:
        """``ts`` changed state or worker: touch it and each of its dependencies."""
    def request_rescan(self) -> None: ...
    @property
    def over_replicated(self) -> int: ...
    @property
    def last_run(self) -> tuple[bool, int, bool]:
        """(full scan, tasks looked at, ordered by a pass over replicated_tasks)."""

@final
class TrackerHub:
    """The ReplicaTrackers of one scheduler, held weakly; the scheduler's hooks
    report replica changes to it, and it to each live tracker."""

    def __init__(self) -> None: ...
    def add(self, tracker: ReplicaTracker) -> None: ...
    def __len__(self) -> int:
        """Number of live trackers."""
    def touch(self, ts: Any) -> None: ...
    def touch_dependencies(self, ts: Any) -> None: ...

@final
class ReplicaHook:
    """Scheduler method ``name`` (``add_replica`` or ``send_task_to_worker``),
    wrapped to report each call to ``hub`` before running ``original`` with the
    same arguments. ValueError for any other name."""

    def __new__(cls, name: str, original: Any, hub: TrackerHub) -> Self: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    @property
    def __name__(self) -> str: ...
    @property
    def __wrapped__(self) -> Any: ...

@final
class AmmRun:
    """One Active Memory Manager run: the run's workers and their Rust table.

    Works directly on the scheduler's ``WorkerState``/``TaskState`` objects (workers
    matched by identity) and on the manager's ``pending`` dict
    (``{TaskState: (set[WorkerState], set[WorkerState])}``). Tie rule: among workers
    tied on stock's sort key, the one listed first in ``workers`` wins. Rejection
    codes (``last_reject``): the keys of ``AMM_REJECTIONS``.
    """

    def __new__(
        cls,
        workers: list[Any],
        memory: list[int],
        running: list[bool],
        eligible: list[bool],
    ) -> Self:
        """Raises ValueError if lengths differ or a worker is listed twice."""
    @staticmethod
    def read_workers(
        workers: Iterable[Any],
        running: Collection[Any],
        status_running: Any,
        measure: str,
        worker_type: type | None = None,
    ) -> AmmRun:
        """The run over the scheduler's ``workers`` (in order) as they are now:
        memory ``getattr(ws.memory, measure)``, running ``ws.status ==
        status_running``, eligible ``ws in running``. With ``worker_type``, the
        memory of workers of exactly that type is computed in Rust from what
        ``WorkerState.memory`` reads (plain dicts and ints; anything else is asked
        from Python)."""
    def __len__(self) -> int: ...
    def __contains__(self, ws: object, /) -> bool: ...
    @property
    def workers(self) -> list[Any]: ...
    @property
    def last_reject(self) -> int: ...
    @property
    def deferred_tasks(self) -> int:
        """Tasks a deferring bulk policy suggested something for without creating
        their ``pending`` entry (``len(pending) + deferred_tasks`` = stock's size)."""
    def memory(self, ws: Any) -> int:
        """Memory downstream of accepted actions; KeyError if ``ws`` is unknown."""
    def set_memory(self, ws: Any, value: int) -> None: ...
    def replicate(self, ts: Any, candidates: Any | None, pending_repl: set[Any]) -> Any | None:
        """Least loaded running candidate without a replica or pending one; recorded
        in ``pending_repl`` and accounted. None if rejected."""
    def drop(self, ts: Any, candidates: Any | None, pending_drop: set[Any]) -> Any | None:
        """Holder to drop from: not pending, no dependents processing there, highest
        (not running, memory); never the last replica; ping-pong guard. None if
        rejected."""
    def reduce_replicas(
        self,
        tasks: Iterable[Any],
        pending: dict[Any, Any],
        targets: dict[Any, int] | None = None,
        defer: bool = False,
    ) -> tuple[int, int]:
        """Stock ReduceReplicas in one pass; returns (tasks suggested, drops suggested).
        ``defer``: new accepted actions are kept for ``enact`` instead of
        ``pending`` (for the last policy of a run)."""
    def reduce_replicas_tracked(
        self,
        tracker: ReplicaTracker,
        tasks: Iterable[Any],
        pending: dict[Any, Any],
        targets: dict[Any, int] | None = None,
        defer: bool = False,
        validate: bool = False,
    ) -> tuple[int, int]:
        """``reduce_replicas`` looking only at what ``tracker`` says may have drops
        to suggest; same decisions. ``validate``: AssertionError if a full scan
        disagrees with the tracker."""
    def retire_worker(
        self, ws: Any, pending: dict[Any, Any], defer: bool = False
    ) -> tuple[int, int]:
        """Stock RetireWorker in one pass; returns (keys to move, keys without recipient)."""
    def enact(
        self,
        pending: dict[Any, Any],
        scheduler: Any,
        stimulus_id: str,
        validate: bool,
        logger: Any | None = None,
    ) -> None:
        """Send the accepted actions (``pending`` and deferred) grouped by worker:
        ``scheduler.request_acquire_replicas`` per worker, then
        ``request_remove_replicas``, each preceded by stock's DEBUG record on
        ``logger`` if given. ``validate``: AssertionError on an action that would
        drop the last replica, replicate onto a holder or drop from a non-holder."""

def read_peer_file(
    root: str | PathLike[str], path: str | PathLike[str], size: int
) -> list[memoryview]:
    """Validate a peer's spill file as ``FileStore.adopt`` does and copy it into
    a private buffer; one memoryview per frame. Raises ForgedHandleError or
    OSError."""

def live_mappings() -> int:
    """Number of spill-file mappings (``MappedFile``) alive in this process."""

def mapping_memory() -> tuple[int, int]:
    """``(mapped, kept)`` bytes (whole pages) of this process's live
    spill-file mappings (``MappedFile``) of files on RAM-backed file systems
    (tmpfs: what shows as ``RssShmem``): ``mapped`` of all of them, until
    each is unmapped; ``kept`` of the files that no ``FileStore`` entry of
    this process holds any more (deleted, forgotten, moved away, or never an
    entry), once per file: they stay in RAM only because they are mapped.
    O(1)."""

@final
class SharePublishing:
    """A Rust thread that writes, every ``interval`` seconds until
    :meth:`stop`, the line ``<share> <namespace or -> <mapped> <kept>
    <stamp>`` to ``path`` (through ``<path>.tmp`` and a rename): ``share``
    the sum of ``stores``' disk totals (``FileStore.total()[1]``), ``mapped``
    and ``kept`` this process's :func:`mapping_memory` with the born arena's
    own bytes (owned and cached) added to both, ``stamp`` CLOCK_MONOTONIC
    seconds (``time.monotonic()``) read before the figures. Never takes the
    GIL to publish; a write that fails leaves the last line. Holds the
    stores weakly. Raises ValueError for an interval that is not a positive
    number, OSError if the thread cannot start."""

    def __new__(
        cls, path: str, stores: Sequence[FileStore], namespace: int | None, interval: float
    ) -> Self: ...
    @staticmethod
    def figures_of(stores: Sequence[FileStore]) -> tuple[int, int, int]:
        """``(share, mapped, kept)`` as the thread computes them, now."""
    def running(self) -> bool:
        """Whether the thread still publishes."""
    def stop(self) -> None:
        """End the thread, waiting for a write in progress; idempotent."""

def watch_mappings(read: Callable[[], _T]) -> tuple[_T, bool]:
    """Call ``read()`` and return ``(its value, kept)``: ``kept`` tells whether
    a mapping (``MappedFile``) that ``read`` made on this thread is still alive
    once it returned. Mappings made or freed meanwhile by other threads, or by
    anything ``read`` frees (a garbage collection), do not change the answer."""

def mapped_ranges(device: int, inode: int) -> list[tuple[int, int]]:
    """``(start, end)`` addresses of this process's live ``MappedFile``
    mappings of the file ``(device, inode)``: O(1) in the number of other
    mappings (unlike reading ``/proc/self/maps``)."""

def written_in_place(path: str | PathLike[str], keep_gil: bool) -> bool:
    """Whether any page of this process's spill-file mappings (``MappedFile``)
    of the file at ``path`` was written by this process, from
    ``/proc/self/pagemap``: True too when that cannot be told, False when the
    file is not mapped at all. The GIL is held throughout if ``keep_gil``."""

def is_ram_backed(path: str | PathLike[str]) -> bool:
    """Whether ``path`` lies on a RAM-backed file system (tmpfs, ramfs or
    hugetlbfs, by ``statfs`` magic number): dask-shm's one rule for "this is
    shared memory" (rust/core/fs.rs). False if ``path`` cannot be examined
    (missing, no access) and off Linux; never raises for such paths."""

def seal_file(path: str | PathLike[str], keep_gil: bool) -> tuple[int, int, int]:
    """Make the file at ``path`` read-only (0400), never through a symlink,
    and return its fingerprint ``(size, mtime_ns, inode)``; the GIL is held
    throughout if ``keep_gil`` (for a RAM-backed file system: see
    ``file_fingerprint``). Raises OSError naming ``path`` (ELOOP for a
    symlink, which is left as it is)."""

def file_fingerprint(path: str | PathLike[str], keep_gil: bool) -> tuple[int, int, int]:
    """``(size, mtime_ns, inode)`` of whatever is at ``path`` (``lstat``). With
    ``keep_gil`` the GIL is not released: a thread that releases it while
    another thread runs Python waits up to the interpreter's switch interval
    (5 ms) to take it back, far longer than a tmpfs metadata operation
    takes. Raises OSError naming ``path`` (FileNotFoundError if absent)."""

def unlink_file(path: str | PathLike[str], keep_gil: bool) -> bool:
    """Delete the file at ``path`` (the GIL held if ``keep_gil``, as in
    ``file_fingerprint``); False if nothing was there. Raises OSError naming
    ``path`` for any other failure."""

# --- tiers of the shared-memory store (rust/core/tier.rs, rust/py/tier.rs) ---

def move_entry(src: FileStore, name: str, dst: FileStore) -> tuple[str, int]:
    """Move entry ``name`` of ``src`` into ``dst``: copy in the kernel
    (copy_file_range, else sendfile), account it in ``dst`` with the same
    memory size, then remove it from ``src``; the GIL is released. Returns
    ``(name in dst, disk bytes)``. Raises KeyError/OSError/SpillFileError,
    leaving ``src`` unchanged."""

@final
class TierBudget:
    """Byte budget of tier 2 with least-recently-used order; pinned entries
    (mapped by values in memory) never move. Thread-safe bookkeeping only."""

    def __new__(cls, limit: int) -> Self: ...
    limit: int
    @property
    def used(self) -> int: ...
    def add(self, name: str, size: int) -> None: ...
    def remove(self, name: str) -> bool: ...
    def touch(self, name: str) -> None: ...
    def pin(self, name: str) -> None: ...
    def unpin(self, name: str) -> None: ...
    def is_pinned(self, name: str) -> bool: ...
    def set_deferred(self, name: str, deferred: bool) -> None:
        """Whether the entry moves only after every entry that is not
        deferred (a file another holder links too); its last use is kept."""
    def is_deferred(self, name: str) -> bool: ...
    def plan(self, incoming: int) -> tuple[list[str], bool]:
        """``(victims, fits)``: entries to move out, oldest first (deferred
        ones after all the others), and whether ``incoming`` more bytes then
        fit within the limit."""
    def __len__(self) -> int: ...

# -- arrays born shared (rust/core/born.rs, rust/py/born.rs) ----------------------

def born_configure(
    directory: str | PathLike[str] | None,
    threshold: int,
    budget: int,
    max_blocks: int,
    reserve: bool = True,
    cache: int | None = None,
    cache_decay: float | None = None,
) -> None:
    """Configure the process-wide arena: allocations of at least ``threshold``
    bytes become files in ``directory`` (0700, on a tmpfs), up to ``budget``
    mapped bytes and ``max_blocks`` mappings (cached blocks included);
    ``None`` stops new blocks and releases the free cache. ``reserve``
    fallocates each block's pages when made. ``cache``: most bytes of freed
    blocks kept for reuse (None: a quarter of the budget, at most 256 MiB),
    each until unused for ``cache_decay`` seconds (None: BORN_CACHE_DECAY). Raises
    ValueError if the directory does not exist or ``cache_decay`` < 0."""

def born_release_cache() -> int:
    """Unmap and unlink every cached block; returns the bytes released."""

def born_release_expired() -> int:
    """Unmap and unlink the cached blocks that waited unused longer than the
    cache's decay; returns the bytes released."""

def born_handler() -> Any:
    """numpy ``mem_handler`` capsule serving large allocations from the arena
    and the rest from the handler current at the first call."""

def set_numpy_handler(handler: Any | None) -> Any:
    """``PyDataMem_SetHandler`` in the current context; returns the previous
    handler. ``None`` restores numpy's default."""

def born_block(address: int) -> tuple[str, int, int, bool, bool] | None:
    """``(path, start, length, sealed, owned)`` of the block holding
    ``address``, or None."""

def born_seal(address: int, length: int, header: bytes) -> str:
    """Write ``header`` in front of the block's bytes in its file and remap the
    block private copy-on-write at the same address; returns the file path.
    Raises LookupError (no such block), FileExistsError (sealed with another
    header), ValueError (header too long) or OSError."""

def born_disown(
    address: int,
    new_path: str | PathLike[str],
    store: FileStore | None = None,
    entry: str | None = None,
) -> None:
    """The sealed block's file now lives at ``new_path``: its own name is
    unlinked and freeing only unmaps. With ``store`` and ``entry`` (the
    entry ``new_path`` is), the block counts as a mapping of that entry's
    file in :func:`mapping_memory` until it is freed. Raises LookupError."""

def born_header_size() -> int:
    """Bytes in front of a block's data inside its file (one page)."""

def born_stats() -> dict[str, Any]:
    """Arena counters (see ``dask_shm.shared.born.stats``)."""
