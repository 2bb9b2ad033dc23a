"""A born-shared array becomes a shared store's file without a copy: what
spilling it and handing it to a same-host peer cost is one header page."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_shm import _core
from dask_shm.shared import born

if TYPE_CHECKING:
    from dask.typing import Key

    from dask_shm.shared.store import SharedSpillStore


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

    block = born.whole_block(value)
    if block is None:
        return None
    kind = _kind(value, block)
    prefix = None if kind is None else _PREFIXES.get(kind)
    if prefix is None:
        header, frames = serialize_unsplit(value)
        if len(frames) != 1 or _core.buffer_address(frames[0]) != (block.start, block.length):
            return None
        prefix = born.file_prefix(header, block.length)
        if prefix is None:
            return None
        if kind is not None:
            if len(_PREFIXES) >= _MAX_PREFIXES:
                _PREFIXES.clear()
            _PREFIXES[kind] = prefix
    size = _core.born_header_size() + block.length
    if store.max_weight is not False and store.files.total()[1] + size > store.max_weight:
        raise MaxSpillExceeded(key)
    if not store.tiers.enforce(size):
        return None  # no room in tier 2 even after moving files out: a tier-3 write
    path = born.seal_block(block, prefix)
    if path is None:
        return None
    name, _ = store.tiers.adopt(path, size, file_stem(key), safe_sizeof(value))
    born.disown(value, store.files.path(name), block=block)
    store.shareable[name] = block.length
    return name


#: Spill-file prefixes (frame table + serialized header) of C-contiguous
#: arrays, by what distributed's numpy serializer puts in the header: dtype,
#: shape, strides, writeability (and the payload length); the first array of
#: each kind is serialized the ordinary way. Serializing
#: through ``distributed.protocol.serialize`` costs about 0.2 ms for an
#: array just computed (cold caches), a third of spilling a born array.
_PREFIXES: dict[tuple[Any, ...], bytes] = {}
_MAX_PREFIXES = 256


def _kind(value: Any, block: born.Block) -> tuple[Any, ...] | None:
    """What a C-contiguous array's prefix depends on; None for other arrays."""
    if not value.flags.c_contiguous:
        return None
    # the dtype itself, not its .str: structured dtypes of one size share a .str
    return (value.dtype, value.shape, value.strides, value.flags.writeable, block.length)
