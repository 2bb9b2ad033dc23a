"""Type stubs for the Rust extension module ``dask_shm._core``."""

from collections.abc import Iterable
from os import PathLike
from typing import final

from typing_extensions import Buffer

__version__: str
#: Every frame inside a spill file starts at a multiple of this many bytes.
FRAME_ALIGNMENT: int

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

    def __init__(self, directory: str | PathLike[str]) -> None: ...
    @property
    def directory(self) -> str: ...
    def put(
        self,
        stem: str,
        frames: Iterable[Buffer],
        memory: int,
        max_disk: int | None = None,
    ) -> tuple[str, int] | None:
        """Write ``frames`` to a new file ``{stem}#{n}`` and account it.

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
        """Frames of a file as writable, 64-byte-aligned views of a private mapping."""
    def delete(self, name: str) -> tuple[int, int] | None:
        """Forget an entry and delete its file; ``(memory, disk)`` it had, or None."""
    def sizes(self, name: str) -> tuple[int, int]:
        """``(memory, disk)`` of one entry; KeyError if unknown."""
    def total(self) -> tuple[int, int]:
        """``(memory, disk)`` summed over all entries."""
    def path(self, name: str) -> str: ...
    def names(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, name: str) -> bool: ...

# --- local shared-memory scheduler (rust/local_transport.rs) ---

@final
class MappedRange:
    """``length`` bytes of a :class:`MappedFile` from ``offset``, exported through
    the buffer protocol (writable, private) and weakly referenceable: objects
    built on it keep it, and the mapping, alive.

    Raises ValueError if the range is not inside the mapping.
    """

    def __init__(self, mapping: MappedFile, offset: int, length: int) -> None: ...
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

def pages_unmodified(addr: int, length: int) -> bool:
    """True if no page of ``[addr, addr + length)`` was written since it was
    mapped from its file (read from ``/proc/self/pagemap``). The range must lie
    in a live private file mapping. Raises OSError if pagemap is unreadable.
    """

@final
class AmmWorkerTable:
    """Per-run table of worker memory and status for the Active Memory Manager.

    Workers are indices ``0..n``. Choices are returned as a worker index (>= 0) or a
    negative rejection code. Tie rule: lowest index wins. Raises IndexError for an
    out-of-range index and ValueError for inconsistent lengths/offsets.
    """

    def __init__(self, memory: list[int], running: list[bool], eligible: list[bool]) -> None: ...
    def __len__(self) -> int: ...
    def memory(self, w: int) -> int: ...
    def set_memory(self, w: int, value: int) -> None: ...
    def replicate(
        self, candidates: list[int] | None, holders: list[int], pending: list[int], nbytes: int
    ) -> int:
        """Lowest-memory eligible candidate (all if None) outside holders and pending;
        its memory grows by ``nbytes``."""
    def drop(
        self,
        holders: list[int],
        pending: list[int],
        candidates: list[int] | None,
        dependents: list[int],
        nbytes: int,
    ) -> int:
        """Holder to drop a replica: not pending, no dependents processing there,
        highest (not running, memory); never the last replica; ping-pong guard."""
    def replicate_many(
        self, nbytes: list[int], excluded: list[int], offsets: list[int]
    ) -> list[int]:
        """``replicate(None, excluded[offsets[i]:offsets[i+1]], [], nbytes[i])`` in turn."""
    def drop_many(
        self,
        nbytes: list[int],
        counts: list[int],
        holders: list[int],
        holder_offsets: list[int],
        pending: list[int],
        pending_offsets: list[int],
        dependents: list[int],
        dependent_offsets: list[int],
        candidate: int | None = None,
    ) -> list[int]:
        """``counts[i]`` consecutive drops of key ``i``; accepted drops become pending."""
