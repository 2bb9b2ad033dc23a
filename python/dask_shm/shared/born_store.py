"""A born-shared array becomes a shared store's file without a copy: what
spilling it and handing it to a same-host peer cost is one header page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dask_shm import _core
from dask_shm.shared import born


@dataclass(frozen=True)
class BornFile:
    """A born-shared array that can become a spill file as it is: its block
    and the prefix (frame table and header) that makes it one."""

    block: born.Block
    prefix: bytes

    @property
    def size(self) -> int:
        """Bytes of the file once sealed (header page and payload)."""
        return _core.born_header_size() + self.block.length

    @property
    def payload(self) -> int:
        """Bytes of the array's data: what lives in a mapping of the file."""
        return self.block.length

    def seal(self) -> str | None:
        """Write the header in front of the block (the owner's pages are
        private from now on); returns the file's path, or None when the
        block is no longer the arena's to seal."""
        return born.seal_block(self.block, self.prefix)

    def hand_over(self, value: object, path: str, holder: tuple[_core.FileStore, str]) -> None:
        """The sealed file now lives (also) at ``path``, entry ``holder[1]`` of
        store ``holder[0]``: the arena drops its own name and no longer
        deletes the file (:func:`born.disown`)."""
        born.disown(value, path, block=self.block, holder=holder)


def born_file(value: object) -> BornFile | None:
    """What makes ``value`` a spill file without copying its bytes, or None
    when it is not a whole born-shared numpy array whose serialized payload
    is the block itself (then it is written the ordinary way). Nothing is
    sealed or moved yet: the caller (a store with room for
    :attr:`BornFile.size` bytes) seals the block, links the file in and
    hands it over."""
    from dask_shm.spill_store import serialize_unsplit

    block = born.whole_block(value)
    if block is None or block.sealed or not block.owned:
        # Sealed already (another key's file, which may have changed or gone
        # since): this key's value gets a file of its own.
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
    return BornFile(block, prefix)


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
