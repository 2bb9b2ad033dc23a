"""Arrays born shared: large numpy allocations made by tasks live in files on
the shared-memory root from the start.

A process-wide arena (Rust, :mod:`dask_shm._core` ``born_*``) serves numpy
allocations of at least ``threshold`` bytes from ``MAP_SHARED`` mappings of
fresh files in a private directory; everything smaller, and everything the
arena refuses (byte budget, mapping budget, tmpfs full), comes from the
handler that was current before (numpy's default). numpy chooses its handler
per context (a contextvar), so :func:`allocating` turns it on only for the
code it wraps, and :func:`install_on_worker` wraps the execution of every
task of a worker.

Each block's file has one page in front of the array's bytes. :func:`seal`
writes a spill-file header there (the format of ``rust/format.rs``, the
header frame padded so the array's frame starts exactly at that page) and
remaps the owner's pages private copy-on-write at the same address: the file
is then a complete, immutable spill file a store can adopt and a peer can
link, and nothing was copied. Writes the owner makes afterwards stay private.

Whether it pays off depends on the tmpfs: fresh tmpfs pages fault in 4 KiB
units unless the file system serves huge pages, while numpy's ordinary large
allocations get transparent huge pages. See :func:`huge_pages` and the
README ("Arrays born shared").
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import dask.config
import msgpack
from dask.utils import parse_bytes
from distributed.diagnostics.plugin import WorkerPlugin

from dask_shm import _core
from dask_shm.shared import paths

if TYPE_CHECKING:
    from dask.typing import Key
    from distributed import Worker

    from dask_shm.shared.store import SharedSpillStore

logger = logging.getLogger(__name__)

#: Smallest allocation served from a file unless configured otherwise.
DEFAULT_THRESHOLD = 1 << 20
_MAGIC = b"DSKSHM01"
_ALIGN = 64
_PAD_KEY = "born-padding"


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def _mount_options(path: str, mounts: str = "/proc/mounts") -> list[str]:
    """Options of the mount holding ``path`` (empty when unknown)."""
    found = paths.filesystem_of(path, mounts)
    if found is None:
        return []
    mount_point = found[0]
    options: list[str] = []
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 4 and paths._unescape_mount(fields[1]) == mount_point:
                    options = fields[3].split(",")  # the last (top) mount wins
    except OSError:
        return []
    return options


def huge_pages(root: str, mounts: str = "/proc/mounts") -> bool:
    """True when files on the tmpfs at ``root`` get transparent huge pages:
    the mount says ``huge=always``, ``huge=within_size`` or ``huge=advise``
    (the arena asks with ``madvise``), or the kernel forces them for every
    tmpfs (``shmem_enabled`` is ``force``)."""
    for option in _mount_options(root, mounts):
        if option in ("huge=always", "huge=within_size", "huge=advise"):
            return True
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return "[force]" in f.read()
    except OSError:
        return False


@dataclass(frozen=True)
class BornSettings:
    """``shm.shared-memory.born-*`` config.

    - ``born-shared``: ``auto`` (on when the root serves huge pages, see
      :func:`huge_pages`), ``true`` or ``false``;
    - ``born-threshold``: smallest allocation served from a file (1 MiB);
    - ``born-budget``: most bytes in blocks at once per worker; ``auto`` is
      the worker's memory limit, capped at half the root's free space.
    """

    mode: bool | Literal["auto"] = "auto"
    threshold: int = DEFAULT_THRESHOLD
    budget: int | Literal["auto"] = "auto"

    @classmethod
    def from_config(cls) -> BornSettings:
        """Read the config. Raises ValueError naming the key and the accepted values."""
        mode = dask.config.get("shm.shared-memory.born-shared", default="auto")
        if mode not in (True, False, "auto"):
            raise ValueError(
                f"config shm.shared-memory.born-shared must be true, false or 'auto'; got {mode!r}"
            )
        threshold = _bytes("born-threshold", DEFAULT_THRESHOLD, minimum=1)
        raw = dask.config.get("shm.shared-memory.born-budget", default="auto")
        budget: int | Literal["auto"] = (
            "auto" if raw == "auto" else _bytes("born-budget", raw, minimum=0)
        )
        return cls(mode, threshold, budget)

    def enabled_for(self, root: str) -> bool:
        return huge_pages(root) if self.mode == "auto" else bool(self.mode)

    def budget_for(self, root: str, memory_limit: int | None) -> int:
        if self.budget != "auto":
            return self.budget
        st = os.statvfs(root)
        half_free = st.f_bavail * st.f_frsize // 2
        return min(half_free, memory_limit) if memory_limit else half_free


def _bytes(name: str, default: Any, minimum: int) -> int:
    raw = dask.config.get(f"shm.shared-memory.{name}", default=default)
    try:
        if isinstance(raw, bool):
            raise TypeError
        value = parse_bytes(raw) if isinstance(raw, str) else int(raw)
        if value < minimum:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(
            f"config shm.shared-memory.{name} must be a byte size >= {minimum} "
            f"(e.g. 1 MiB); got {raw!r}"
        ) from None
    return value


# -- the arena -------------------------------------------------------------------


def start(
    directory: str,
    *,
    threshold: int = DEFAULT_THRESHOLD,
    budget: int,
    max_blocks: int | None = None,
    reserve: bool = True,
) -> None:
    """Serve allocations of ``threshold`` bytes or more from files in
    ``directory`` (existing, 0700, on a tmpfs), up to ``budget`` bytes and
    ``max_blocks`` blocks (default: a quarter of ``vm.max_map_count``) at
    once. ``reserve`` allocates each block's tmpfs pages when it is made
    (``fallocate``), so a full tmpfs makes the allocation fall back to
    ordinary memory instead of killing the process with SIGBUS later.
    Only code inside :func:`allocating` uses the arena. Raises ValueError if
    ``directory`` does not exist."""
    if max_blocks is None:
        max_blocks = _max_map_count() // 4
    _core.born_configure(directory, threshold, budget, max_blocks, reserve)


def stop() -> None:
    """Serve no new blocks; arrays already born shared stay valid."""
    _core.born_configure(None, DEFAULT_THRESHOLD, 0, 0)


def stats() -> dict[str, Any]:
    """Arena counters: ``blocks``, ``bytes`` (mapped), ``owned_bytes`` (files
    only the arena holds: memory nobody else accounts for), ``allocated``,
    ``freed``, ``sealed``, ``refused_budget``, ``refused_blocks``,
    ``refused_error``, ``threshold`` and ``directory`` (None when stopped)."""
    return _core.born_stats()


@contextlib.contextmanager
def allocating() -> Iterator[None]:
    """numpy allocations in this context (and contexts copied from it, such as
    those of threads started with ``run_in_executor_with_context``) go
    through the arena; the previous handler is restored on exit. Raises
    RuntimeError when numpy lacks the handler API (numpy < 1.22)."""
    previous = _core.set_numpy_handler(_core.born_handler())
    try:
        yield
    finally:
        _core.set_numpy_handler(previous)


# -- looking arrays up -------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A born-shared block: its file, where it is mapped and how long it is."""

    path: str
    start: int
    length: int
    sealed: bool
    owned: bool


def _data_range(value: object) -> tuple[int, int] | None:
    import numpy as np

    if type(value) is not np.ndarray or value.dtype.hasobject:
        return None
    address = value.__array_interface__["data"][0]
    return address, value.nbytes


def block_of(value: object) -> Block | None:
    """The block a numpy array's bytes live in (any view of it), or None."""
    found = _data_range(value)
    if found is None:
        return None
    block = _core.born_block(found[0])
    return None if block is None else Block(*block)


def whole_block(value: object) -> Block | None:
    """The block if ``value`` is a contiguous numpy array whose bytes are
    exactly that block (what :func:`seal` can turn into a spill file)."""
    found = _data_range(value)
    if found is None:
        return None
    address, nbytes = found
    block = _core.born_block(address)
    if block is None:
        return None
    b = Block(*block)
    if b.start != address or b.length != nbytes:
        return None
    return b


def file_prefix(header: dict, payload: int) -> bytes | None:
    """The bytes that make a block of ``payload`` bytes a valid spill file
    ``[msgpack(header), payload]``: frame table, padding, and ``header``
    padded (an extra ``born-padding`` entry, ignored by deserializers) so
    that the payload frame starts exactly at ``born_header_size()``. None if
    the header does not fit."""
    page = _core.born_header_size()
    table = _MAGIC + struct.pack("<Q", 2)
    first = _align(len(table) + 16)
    # The payload starts at align(first + h): h must lie in (page - 64 - first, page - first].
    wanted = page - first
    encoded = msgpack.dumps(header, use_bin_type=True)
    if len(encoded) > wanted:
        return None
    padded = dict(header)
    pad = 0
    for _ in range(4):  # the pad's own length prefix may grow by a byte or two
        padded[_PAD_KEY] = b"\0" * pad
        encoded = msgpack.dumps(padded, use_bin_type=True)
        if len(encoded) == wanted:
            break
        pad = max(pad + wanted - len(encoded), 0)
    if not (wanted - _ALIGN < len(encoded) <= wanted):
        return None
    prefix = table + struct.pack("<QQ", len(encoded), payload)
    prefix += b"\0" * (first - len(prefix)) + encoded
    assert _align(len(prefix)) == page
    return prefix


def header_size() -> int:
    """Bytes in front of a block's data in its file: what sealing writes."""
    return _core.born_header_size()


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def seal(value: object, header: dict) -> str | None:
    """Make the block holding ``value`` (a whole-block numpy array, see
    :func:`whole_block`) a complete spill file holding ``header`` and the
    array's bytes, immutable from now on (the owner's later writes are
    private copy-on-write). ``header`` is what
    :func:`dask_shm.spill_store.serialize_unsplit` gives for ``value``.
    Returns the file's path, or None if ``value`` is not a whole block, the
    header does not fit, or the block was sealed with another header (the
    caller then writes a file the ordinary way). Raises OSError when the
    system refuses (the block is unchanged)."""
    block = whole_block(value)
    if block is None:
        return None
    prefix = file_prefix(header, block.length)
    if prefix is None:
        return None
    try:
        return _core.born_seal(block.start, block.length, prefix)
    except (LookupError, FileExistsError):
        return None


def disown(value: object, new_path: str) -> None:
    """The sealed file of ``value``'s block now lives (also) at ``new_path``:
    the arena unlinks its own name and stops deleting the file on free.
    Raises LookupError if ``value`` is not a sealed block."""
    block = whole_block(value)
    if block is None:
        raise LookupError("not a born-shared array")
    _core.born_disown(block.start, new_path)


# -- spill stores -------------------------------------------------------------------


def adopt_into(store: SharedSpillStore, key: Key, value: object) -> str | None:
    """Turn ``value``'s block into ``store``'s file for ``key`` without copying
    its bytes: seal it (header in front, owner's pages private from now on),
    hard-link it into the store and hand it over (:func:`disown`). Returns the
    store's file name, accounted and marked shareable but not registered
    for ``key`` (the caller registers or retains it), or None when ``value``
    is not a whole born-shared numpy array whose serialized payload is the
    block itself (the caller writes a file the ordinary way).

    Also None when tier 2 has no room for the file even after moving
    unmapped files to tier 3 (the ordinary write then goes to tier 3).
    Raises MaxSpillExceeded when the file would take the store past its
    ``max_weight``; OSError or ForgedHandleError if linking fails (the block
    is then sealed but still the arena's, and the value is unchanged)."""
    from distributed.sizeof import safe_sizeof

    from dask_shm.spill_store import MaxSpillExceeded, file_stem, serialize_unsplit

    block = whole_block(value)
    if block is None:
        return None
    header, frames = serialize_unsplit(value)
    if len(frames) != 1 or _core.buffer_address(frames[0]) != (block.start, block.length):
        return None
    size = _core.born_header_size() + block.length
    if store.max_weight is not False and store.files.total()[1] + size > store.max_weight:
        raise MaxSpillExceeded(key)
    if not store.tiers.enforce(size):
        return None  # no room in tier 2 even after moving files out: a tier-3 write
    path = seal(value, header)
    if path is None:
        return None
    name, _ = store.tiers.adopt(path, size, file_stem(key), safe_sizeof(value))
    disown(value, store.files.path(name))
    store.shareable[name] = block.length
    return name


# -- workers ------------------------------------------------------------------------

#: Workers of this process running their tasks through the arena (in-process
#: clusters share one arena: the settings of the last one installed apply).
_installed: set[int] = set()


def install_on_worker(
    worker: Worker,
    directory: str,
    *,
    threshold: int,
    budget: int,
    budget_fn: Callable[[], int] | None = None,
) -> None:
    """Start the arena in ``directory`` and run every task of ``worker``
    inside :func:`allocating` (its ``execute`` coroutine is wrapped; the
    task's thread inherits the context). ``budget_fn``, if given, is asked
    for the arena's byte budget before each task (e.g. what the tier-2
    budget leaves). Undo with :func:`uninstall_from_worker`."""
    start(directory, threshold=threshold, budget=budget)
    if id(worker) in _installed:
        return
    original = worker.execute
    max_blocks = _max_map_count() // 4

    async def execute(key: Any, *, stimulus_id: str) -> Any:
        try:
            if budget_fn is not None:
                _core.born_configure(directory, threshold, budget_fn(), max_blocks)
            context: contextlib.AbstractContextManager = allocating()
        except (OSError, ValueError, RuntimeError) as e:
            # E.g. the directory was removed behind our back: the task runs on
            # ordinary memory rather than failing.
            logger.warning("dask-shm: arrays born shared off for %r: %s", key, e)
            context = contextlib.nullcontext()
        with context:
            return await original(key, stimulus_id=stimulus_id)

    execute.__wrapped__ = original  # type: ignore[attr-defined]
    worker.execute = execute  # type: ignore[method-assign]
    _installed.add(id(worker))


def uninstall_from_worker(worker: Worker) -> None:
    """Stop wrapping ``worker``'s tasks; stop the arena when no worker of this
    process uses it any more (arrays already born stay valid)."""
    if id(worker) not in _installed:
        return
    _installed.discard(id(worker))
    if getattr(worker.execute, "__wrapped__", None) is not None:
        del worker.execute  # the instance attribute; the class's method shows again
    if not _installed:
        stop()


class BornSharedPlugin(WorkerPlugin):
    """Arrays born shared on a worker in shared-memory mode (install it after
    :class:`~dask_shm.shared.plugin.SharedMemoryPlugin`).

    Follows :class:`BornSettings` (``shm.shared-memory.born-*``): with
    ``born-shared: auto`` (the default) it turns on only when the root serves
    huge pages, and otherwise logs why it stays off. Blocks go to a 0700
    directory in this process's directory on the root (removed on teardown;
    one left by a killed worker goes with its process directory). Their
    bytes count as the worker's own memory (the monitor ignores shared pages,
    so they are added back) until a store adopts them.

    Raises ValueError at setup for an invalid config value.
    """

    name = "dask-shm-born-shared"
    idempotent = True

    def __init__(self, settings: BornSettings | None = None):
        self.settings = settings

    def setup(self, worker: Worker) -> None:
        from dask_shm.shared.buffer import SharedSpillBuffer

        settings = self.settings or BornSettings.from_config()
        if id(worker) in _installed:
            return  # already on (e.g. SharedMemoryPlugin turned it on from config)
        buffer = worker.data
        if not isinstance(buffer, SharedSpillBuffer):
            logger.info("dask-shm: arrays born shared need shared-memory mode; off")
            return
        root = buffer.store.root
        if not settings.enabled_for(root):
            logger.info(
                "dask-shm: arrays born shared stay off: %s serves no huge pages, and "
                "fresh 4 KiB tmpfs pages make numpy slower than ordinary memory "
                "(mount the root with huge=within_size, or set "
                "shm.shared-memory.born-shared: true)",
                root,
            )
            return
        try:
            _core.born_handler()
        except (RuntimeError, ImportError) as e:
            logger.warning("dask-shm: arrays born shared need numpy >= 1.22 (%s); off", e)
            return
        self._directory = paths.subdir(root, f"born-{uuid.uuid4().hex[:12]}")
        budget = settings.budget_for(root, worker.memory_manager.memory_limit)
        tier2 = buffer.store.tiers.budget

        def room() -> int:
            # Blocks and tier-2 files share the tier-2 budget.
            return max(0, min(budget, tier2.limit - tier2.used))

        install_on_worker(
            worker, self._directory, threshold=settings.threshold, budget=room(), budget_fn=room
        )
        self._monitor = worker.monitor.get_process_memory

        def process_memory() -> int:
            return self._monitor() + stats()["owned_bytes"]

        worker.monitor.get_process_memory = process_memory  # type: ignore[method-assign]
        logger.info(
            "dask-shm: arrays of %s bytes or more born shared on %s (%s)",
            settings.threshold,
            worker.address,
            self._directory,
        )

    def teardown(self, worker: Worker) -> None:
        directory = getattr(self, "_directory", None)
        if directory is None:
            return
        uninstall_from_worker(worker)
        worker.monitor.get_process_memory = self._monitor  # type: ignore[method-assign]
        shutil.rmtree(directory, ignore_errors=True)
