"""Arrays born shared: large numpy allocations live in files on the
shared-memory root from the start.

A process-wide arena (Rust, :mod:`dask_shm._core` ``born_*``) serves numpy
allocations of at least ``threshold`` bytes from ``MAP_SHARED`` mappings of
fresh files in a private directory; everything smaller, and everything the
arena refuses (byte budget, mapping budget, tmpfs full), comes from the
handler that was current before (numpy's default). numpy chooses its handler
per context (a contextvar), so :func:`allocating` turns it on only for the
code it wraps.

A freed block that nobody else can see (never sealed or handed over, its
file linked only by the arena) is kept, file and mapping intact, in a
bounded free cache, and the next allocation of up to twice or down to half
its size takes it back (shrunk or grown, keeping the pages in common):
a steady workload creates no new files and faults no new tmpfs pages in
(fresh 4 KiB tmpfs pages cost ~3x what ordinary memory does). Cached blocks
still count against the budget and as the process's own memory
(``stats()["cached_bytes"]``); they go beyond the cache's cap, beyond the
bytes of the blocks in use (all but the newest freed), when a fresh
block needs their budget, once unused for :data:`CACHE_DECAY` (at the next
allocation or free, or :func:`release_expired`), on :func:`stop` and
:func:`release_cache`.

Each block's file has one page in front of the array's bytes. :func:`seal`
writes a spill-file header there (the format of ``rust/core/format.rs``, the
header frame padded so the array's frame starts exactly at that page) and
remaps the owner's pages private copy-on-write at the same address: the file
is then a complete, immutable spill file a store can adopt and a peer can
link, and nothing was copied. Writes the owner makes afterwards stay private.

Related modules: :mod:`.born_store` (a born array becomes a store's file),
:mod:`.born_worker` (config, and the worker plugin that runs tasks through
the arena).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dask_shm import _core
from dask_shm.config import byte_size, shipped_default
from dask_shm.spill_store import pack_header
from dask_shm.sysctl import max_map_count

#: Smallest allocation served from a file unless configured otherwise
#: (``shm.shared-memory.born-threshold`` in dask-shm.yaml).
DEFAULT_THRESHOLD = byte_size(
    shipped_default("shm.shared-memory.born-threshold"), "shm.shared-memory.born-threshold"
)
#: Largest default free cache (see :func:`default_cache`).
DEFAULT_CACHE_MAX = 256 << 20
#: Seconds a freed block waits in the free cache for an allocation of its
#: size before it is released (the arena's default).
CACHE_DECAY = _core.BORN_CACHE_DECAY
# rust/core/format.rs: magic, u32 frame count, u64 per frame length; frames of
# FRAME_ALIGN_MIN_LEN bytes or more start on a FRAME_ALIGNMENT boundary.
_MAGIC = b"DSK2"
_ALIGN = _core.FRAME_ALIGNMENT
_PAD_KEY = "born-padding"


def default_max_blocks() -> int:
    """A quarter of ``vm.max_map_count`` (each block is one mapping; the rest
    is left to the store's mappings and everything else in the process)."""
    return max_map_count() // 4


# -- the arena -------------------------------------------------------------------


def start(
    directory: str,
    *,
    threshold: int = DEFAULT_THRESHOLD,
    budget: int,
    max_blocks: int | None = None,
    reserve: bool = True,
    cache: int | None = None,
    cache_decay: float = CACHE_DECAY,
) -> None:
    """Serve allocations of ``threshold`` bytes or more from files in
    ``directory`` (existing, 0700, on a tmpfs), up to ``budget`` bytes and
    ``max_blocks`` blocks (default: a quarter of ``vm.max_map_count``) at
    once, cached blocks included. ``reserve`` allocates each block's tmpfs
    pages when it is made (``fallocate``), so a full tmpfs makes the
    allocation fall back to ordinary memory instead of killing the process
    with SIGBUS later. ``cache``: most bytes of freed blocks kept for reuse
    (default :func:`default_cache` of the budget; 0 turns reuse off), each
    until unused for ``cache_decay`` seconds.
    Only code inside :func:`allocating` uses the arena. Raises ValueError if
    ``directory`` does not exist."""
    if max_blocks is None:
        max_blocks = default_max_blocks()
    _core.born_configure(directory, threshold, budget, max_blocks, reserve, cache, cache_decay)


def default_cache(budget: int) -> int:
    """The free cache's default cap: a quarter of the budget, at most 256 MiB."""
    return min(budget // 4, DEFAULT_CACHE_MAX)


def stop() -> None:
    """Serve no new blocks and release the free cache; arrays already born
    shared stay valid."""
    _core.born_configure(None, DEFAULT_THRESHOLD, 0, 0)


def release_cache() -> int:
    """Unmap and unlink every cached (freed, kept for reuse) block; returns
    the bytes released."""
    return _core.born_release_cache()


def release_expired() -> int:
    """Unmap and unlink the cached blocks that waited unused longer than the
    cache's decay (:data:`CACHE_DECAY`); returns the bytes released.
    Allocations and frees do this themselves; a process that may sit idle
    calls it now and then."""
    return _core.born_release_expired()


def stats() -> dict[str, Any]:
    """Arena counters: ``blocks``, ``bytes`` (mapped), ``owned_bytes`` (live
    blocks whose files only the arena holds), ``cached_blocks`` and
    ``cached_bytes`` (freed blocks kept for reuse; also memory nobody else
    accounts for), ``allocated`` (``reused`` of them from the cache),
    ``freed``, ``evicted`` (cached blocks released), ``sealed``,
    ``refused_budget``, ``refused_blocks``, ``refused_error``, ``threshold``
    and ``directory`` (None when stopped)."""
    return _core.born_stats()


def own_bytes() -> int:
    """Bytes of tmpfs pages only the arena holds, live or cached: what a
    memory monitor that leaves shared pages out must add back."""
    s = _core.born_stats()
    return int(s["owned_bytes"]) + int(s["cached_bytes"])


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
    ``[msgpack(header), payload]`` in ``rust/core/format.rs``'s layout: frame
    table, then ``header`` padded (an extra ``born-padding`` entry, ignored by
    deserializers) so that the payload frame starts exactly at
    ``born_header_size()``. None if the header does not fit or the payload is
    too small to be an aligned frame."""
    page = _core.born_header_size()
    if payload < _core.FRAME_ALIGN_MIN_LEN:
        return None
    table_len = len(_MAGIC) + 4 + 8 * 2
    # The header frame is packed right after the table (it is shorter than
    # FRAME_ALIGN_MIN_LEN); the payload frame starts at the next alignment
    # boundary after it, which must be the page: table_len + h == page.
    wanted = page - table_len
    if wanted >= _core.FRAME_ALIGN_MIN_LEN:
        return None
    encoded = pack_header(header)
    if len(encoded) > wanted:
        return None
    padded = dict(header)
    pad = 0
    for _ in range(4):  # the pad's own length prefix may grow by a byte or two
        padded[_PAD_KEY] = b"\0" * pad
        encoded = pack_header(padded)
        if len(encoded) == wanted:
            break
        pad = max(pad + wanted - len(encoded), 0)
    if not (wanted - _ALIGN < len(encoded) <= wanted):
        return None
    prefix = _MAGIC + struct.pack("<IQQ", 2, len(encoded), payload) + encoded
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
    return seal_block(block, prefix)


def seal_block(block: Block, prefix: bytes) -> str | None:
    """:func:`seal` for a caller that has the block and its
    :func:`file_prefix` already. Same results and errors."""
    try:
        return _core.born_seal(block.start, block.length, prefix)
    except (LookupError, FileExistsError):
        return None


def disown(
    value: object,
    new_path: str,
    *,
    block: Block | None = None,
    holder: tuple[_core.FileStore, str] | None = None,
) -> None:
    """The sealed file of ``value``'s block now lives (also) at ``new_path``:
    the arena unlinks its own name and stops deleting the file on free.
    Raises LookupError if ``value`` is not a sealed block. ``block``:
    :func:`whole_block` of ``value``, if the caller has it. ``holder``:
    the store and entry that ``new_path`` is, whose file the block then
    counts as mapping (``_core.mapping_memory()``) until it is freed."""
    block = block or whole_block(value)
    if block is None:
        raise LookupError("not a born-shared array")
    store, entry = holder if holder is not None else (None, None)
    _core.born_disown(block.start, new_path, store, entry)
