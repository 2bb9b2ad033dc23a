"""The slow half of :class:`dask_shm.SpillBuffer`: values serialized into files.

:class:`SpillStore` is a ``MutableMapping[Key, object]`` over a Rust
:class:`~dask_shm._core.FileStore`. It plays the part that ``distributed.spill.Slow``
plays in stock distributed (same serialization, same metrics, same accounting
surface) and raises the same internal exceptions, which :class:`SpillBuffer`
turns into its public error contract.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping
from time import perf_counter
from typing import Any, Literal, Protocol, TypeAlias
from urllib.parse import quote

import msgpack
from dask.typing import Key
from distributed.metrics import context_meter
from distributed.protocol.compression import decompress, maybe_compress
from distributed.protocol.serialize import (
    deserialize,
    merge_and_deserialize,
    serialize,
    serialize_bytelist,
)
from distributed.protocol.utils import frame_split_size
from distributed.sizeof import safe_sizeof
from distributed.spill import PickleError, SpilledSize

from dask_shm._core import FileStore, SpillFileError

#: ``f(label, value, unit)``, the signature of ``context_meter.digest_metric``.
Digest: TypeAlias = Callable[[Hashable, float, str], None]

#: File names longer than this are shortened and made unique with a hash.
_MAX_STEM = 200


# PickleError is stock's class on purpose: it is what a caller of a stock
# SpillBuffer sees when a value too large for memory fails to pickle, so
# `except` clauses written against stock keep working with ours.


#: Starting buffer of a msgpack packer (it grows as needed). msgpack's
#: default, 256 KiB, is above glibc's mmap threshold, and that threshold stays
#: at 128 KiB in a worker (the nanny sets MALLOC_TRIM_THRESHOLD_, which turns
#: glibc's adjustment off), so a header packed with it cost an mmap, a page
#: fault and a munmap: ~10 us, more while other threads map files.
PACK_BUF = 4096


#: ``msgpack.packb(obj, **kwargs)`` starting with a PACK_BUF buffer unless
#: ``buf_size`` is given: the same bytes. A partial, not a function: it runs
#: for every message a shared-memory worker packs, and this saves a Python
#: frame on each.
pack_small_first: Callable[..., bytes] = functools.partial(msgpack.packb, buf_size=PACK_BUF)


def pack_header(header: Mapping[str, Any]) -> bytes:
    """msgpack of a serialization header, as ``msgpack.dumps(header,
    use_bin_type=True)`` gives, without a quarter-MiB buffer per call."""
    return pack_small_first(header, use_bin_type=True)


class MaxSpillExceeded(Exception):
    """Internal: writing the key would take the spill directory past max_spill."""


def file_stem(key: Key) -> str:
    """File name stem for a key: ``quote(str(key))`` as stock distributed does,
    shortened with a hash suffix when too long for a file system."""
    stem = quote(str(key), safe="")
    if not stem:
        # no file can be named "" (the key ""); quote never makes a lone "%"
        return "%"
    if stem.startswith("."):
        stem = "%2E" + stem[1:]
    if len(stem) > _MAX_STEM:
        digest = hashlib.sha1(stem.encode()).hexdigest()[:16]
        stem = f"{stem[: _MAX_STEM - 17]}~{digest}"
    return stem


_PICKLE = ("pickle",)


def _is_arrow_table(value: object) -> bool:
    module = type(value).__module__
    return module.startswith("pyarrow") and type(value).__name__ in ("Table", "RecordBatch")


def serialize_unsplit(
    value: object, digest: Digest = context_meter.digest_metric
) -> tuple[dict, list]:
    """``serialize`` with every frame left whole and uncompressed: frames
    that ``serialize_bytelist`` would shard at 64 MiB are kept in one piece so
    that a deserializer reading from a mapping gets one contiguous buffer and
    never has to copy to merge shards.

    Reports the ``serialize`` and ``compress`` stages (the latter being the
    decision to leave every frame uncompressed) to ``digest`` (default:
    ``context_meter.digest_metric``), as stock's ``serialize_bytelist`` reports
    them to ``context_meter``, so memmap and shared buffers show the same
    metrics as stock. They are timed here rather than with
    ``context_meter.meter``, whose context managers cost more than a small
    value's serialization (this runs once per value a worker hands over).

    A pyarrow Table or RecordBatch is pickled (protocol 5: its buffers become
    the frames, no copy) rather than given to distributed's arrow serializer,
    which first copies the whole value into one IPC stream (a growing buffer
    of up to twice its size, kept by pyarrow's pool afterwards). Read back,
    both are the same value over the file's pages.

    A numpy array that is not contiguous (a slice such as ``a[1:, 1:]``)
    keeps itself as its payload frame, where distributed's serializer copies
    it into a contiguous array first (see :func:`_serialize_strided_array`):
    the frame is then a strided buffer, which the file stores write in C
    order from its rows and ``memoryview(frame).nbytes`` measures, but which
    is not a flat byte buffer."""
    serializers = _PICKLE if _is_arrow_table(value) else None
    start = perf_counter()
    gathered = _serialize_strided_array(value)
    if gathered is not None:
        header, frames = gathered
    else:
        header, frames = serialize(value, serializers=serializers, on_error="raise")
    serialized = perf_counter()
    header["compression"] = (None,) * len(frames)
    header["count"] = len(frames)
    digest("serialize", serialized - start, "seconds")
    digest("compress", perf_counter() - serialized, "seconds")
    return header, frames


#: Non-contiguous arrays smaller than this are copied by distributed's
#: serializer as usual: the copy costs less than the row-by-row write saves.
STRIDED_MIN_BYTES = 64 * 1024


def _serialize_strided_array(value: object) -> tuple[dict, list] | None:
    """``serialize``'s header and frames for a numpy array whose bytes are not
    contiguous but whose innermost axis is, with the array itself as the
    payload frame in place of the contiguous copy distributed's serializer
    would make (``np.ascontiguousarray``); None for any other value.

    The header is distributed's own, taken from serializing a C-contiguous
    array of the same shape and dtype over an anonymous mapping that is
    never written (so its pages are never touched): a file holding the
    array's bytes in C order under it reads back as that copy would, on any
    reader. The copy was a third of the cost of writing a slice (a 20 MiB
    ``a[1:, 1:]`` into a store on /dev/shm: 8.7-9.7 ms with it, 5.0-6.4 ms
    without, medians of 40 in one process on the dev box)."""
    np: Any = sys.modules.get("numpy")  # not imported: value is no array
    array: Any = value
    if np is None or type(array) is not np.ndarray:
        return None
    if array.nbytes < STRIDED_MIN_BYTES:
        return None
    if array.flags.c_contiguous or array.flags.f_contiguous:
        return None
    if array.dtype.kind not in "biufc" or array.dtype.hasobject or array.dtype.fields:
        return None
    if 0 in array.strides or array.strides[-1] != array.itemsize:
        return None
    # an anonymous mapping: its pages are never touched, and no allocator
    # (nor tracemalloc) sees an array-sized allocation
    stand_in = np.ndarray(array.shape, array.dtype, buffer=mmap.mmap(-1, array.nbytes))
    header, frames = serialize(stand_in, on_error="raise")
    sub = header.get("sub-header")
    if (
        header.get("serializer") != "dask"
        or len(frames) != 1
        or not isinstance(sub, dict)
        or tuple(sub.get("shape", ())) != array.shape
        or tuple(sub.get("strides", ())) != stand_in.strides
        or sub.keys() - {"dtype", "shape", "strides", "writeable"}
        or memoryview(frames[0]).nbytes != array.nbytes
    ):
        return None  # not distributed's numpy serializer as we know it
    return header, [array]


def _contiguous(frame: Any) -> Any:
    """``frame``, or a contiguous copy of it if it is a strided numpy array."""
    if memoryview(frame).contiguous:
        return frame
    import numpy as np

    return np.ascontiguousarray(frame)


def compress_frames(header: dict, frames: list, compression: str) -> tuple[dict, list]:
    """``serialize_unsplit``'s ``header`` and ``frames`` as stock's
    ``serialize_bytelist`` lays them out with ``compression``: every frame cut
    into shards of ``distributed.comm.shard`` bytes, each shard compressed
    where that shrinks it enough (``maybe_compress``). What a stock spill
    file holds, for a value that will be read back by copy anyway;
    ``frames_to_object`` reads both layouts."""
    num_sub_frames: list[int] = []
    offsets: list[int] = []
    shards: list[Any] = []
    # a strided array frame (see serialize_unsplit) is cut and compressed as its C-order bytes
    frames = [_contiguous(f) for f in frames]
    for frame in frames:
        sub = frame_split_size(frame)
        num_sub_frames.append(len(sub))
        offsets.append(len(shards))
        shards.extend(sub)
    codecs: list[str | None] = []
    compressed: list[Any] = []
    for shard in shards:
        codec, out = maybe_compress(shard, compression=compression)
        codecs.append(codec)
        compressed.append(out)
    header = {
        **header,
        "split-num-sub-frames": tuple(num_sub_frames),
        "split-offsets": tuple(offsets),
        "compression": tuple(codecs),
        "count": len(compressed),
    }
    return header, compressed


def frames_to_object(
    frames: list[memoryview], digest: Digest = context_meter.digest_metric
) -> object:
    """Deserialize frames laid out as ``[msgpack header, *payload frames]``.

    Reports the ``decompress`` and ``deserialize`` stages to ``digest``
    (default: ``context_meter.digest_metric``), as stock's
    ``merge_and_deserialize`` and ``decompress`` report them. Frames that are
    neither compressed nor split (every value written by
    :func:`serialize_unsplit`, which is every shared file) are deserialized
    directly and timed here: the two ``context_meter.meter`` decorators on
    distributed's functions cost about 15 us per call, as much as
    deserializing a small array."""
    header = msgpack.loads(frames[0], raw=False, use_list=False) if frames[0] else {}
    payload = frames[1:]
    codecs = header.get("compression")
    if codecs is None or any(codecs) or "split-num-sub-frames" in header:
        return merge_and_deserialize(header, decompress(header, payload))
    start = perf_counter()
    value = deserialize(header, payload)
    digest("decompress", 0.0, "seconds")  # nothing to decompress
    digest("deserialize", perf_counter() - start, "seconds")
    return value


def _file_bytes(frames: list[memoryview]) -> int:
    """Bytes of the file the frames were read from: like stock's ``disk-read``
    (the length of the pickled file), header and padding included. All frames
    view one buffer (a copy or a mapping) of the whole file."""
    return len(frames[0].obj) if frames else 0  # type: ignore[arg-type]


class SpillFiles(Protocol):
    """What :class:`SpillStore` needs of its files, one entry per value:
    :class:`~dask_shm._core.FileStore` (one directory) and
    :class:`~dask_shm.shared.tiers.TieredFiles` (a list of tiers) satisfy it.
    Sizes are ``(memory, disk)`` bytes; see ``FileStore`` for each method's
    contract."""

    @property
    def directory(self) -> str: ...
    def put(
        self, stem: str, frames: Iterable[Any], memory: int, max_disk: int | None = None
    ) -> tuple[str, int] | None: ...
    def read(self, name: str) -> list[memoryview]: ...
    def read_mapped(self, name: str) -> list[memoryview]: ...
    def delete(self, name: str) -> tuple[int, int] | None: ...
    def sizes(self, name: str) -> tuple[int, int]: ...
    def set_memory(self, name: str, memory: int) -> None: ...
    def path(self, name: str) -> str: ...
    def total(self) -> tuple[int, int]: ...
    def names(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, name: str, /) -> bool: ...


class _WeightByKey(Mapping[Key, SpilledSize]):
    """Read-only ``{key: SpilledSize}`` view of the store's accounting."""

    def __init__(self, store: SpillStore):
        self._store = store

    def __getitem__(self, key: Key) -> SpilledSize:
        return SpilledSize(*self._store.files.sizes(self._store.filenames[key]))

    def __iter__(self) -> Iterator[Key]:
        return iter(self._store.filenames)

    def __len__(self) -> int:
        return len(self._store.filenames)


class SpillStore(MutableMapping[Key, object]):
    """Values serialized with ``serialize_bytelist`` into one file per key.

    Guarantees: a key is readable once ``__setitem__`` returns; files are
    published whole (a crash mid-write leaves no readable half file);
    ``total_weight`` always equals the sum of ``weight_by_key``, and its disk
    part equals the bytes of the files in the directory.

    Raises (internal, caught by SpillBuffer): :class:`PickleError` when the
    value fails to serialize, :class:`MaxSpillExceeded` when the write would
    exceed ``max_weight``, ``OSError`` when the write fails (disk full, ...).
    Reading raises ``KeyError`` for an unknown key and
    :class:`~dask_shm._core.SpillFileError` naming the key when its file is
    missing, truncated or corrupted.
    """

    max_weight: int | Literal[False]
    filenames: dict[Key, str]
    weight_by_key: Mapping[Key, SpilledSize]

    files: SpillFiles

    def __init__(
        self,
        files: str | os.PathLike[str] | SpillFiles,
        max_weight: int | Literal[False] = False,
        *,
        metrics: defaultdict[tuple[str, str], float] | None = None,
        mapped: bool = False,
        recycle_bytes: int = 0,
        compression: str | None = None,
    ):
        """Values go to ``files``: a spill directory (str or path-like; a
        :class:`~dask_shm._core.FileStore` is opened there) or any
        :class:`SpillFiles`; at most ``max_weight`` bytes on disk; ``mapped``:
        unspill through a private mapping; ``recycle_bytes``: bytes of removed
        entries' files kept for reuse in a directory opened here (never when
        ``mapped``); ``compression``: the name of the distributed codec that
        compresses the frames (``"lz4"``, ``"zlib"``, ...; None: none; see
        :func:`dask_shm.config.spill_compression`; unused when ``mapped``,
        whose frames are mapped as written, but subclasses that read some
        values by copy may use it for those). Raises OSError if a
        directory cannot be made."""
        if isinstance(files, (str, os.PathLike)):
            # Recycling overwrites files of removed entries (recycle_bytes of them
            # at most): only safe when no value is ever a mapping of its file.
            files = FileStore(files, recycle_bytes=0 if mapped else recycle_bytes)
        self.files = files
        self.max_weight = max_weight
        self.mapped = mapped
        self.filenames = {}
        self._register_lock = threading.Lock()
        self.weight_by_key = _WeightByKey(self)
        self.cumulative_metrics = metrics if metrics is not None else defaultdict(float)
        self._compression = compression

    @property
    def directory(self) -> str:
        return str(self.files.directory)

    @property
    def total_weight(self) -> SpilledSize:
        return SpilledSize(*self.files.total())

    def _unspilled_disk(self) -> int:
        """Bytes on disk of files whose values are in memory (none here; a
        shared store keeps files of values read back): ``max_weight`` bounds
        the spilled ones only, as stock's ``max_spill`` does."""
        return 0

    def _record(self, label: Hashable, value: float, unit: str) -> None:
        self.cumulative_metrics[label, unit] += value  # type: ignore[index]

    def _digest(self, label: Hashable, value: float, unit: str) -> None:
        """Report a metric to this store and to the callbacks of the caller's
        context, as ``context_meter.digest_metric`` within
        ``context_meter.add_callback(self._record)`` would, without entering
        that context."""
        self._record(label, value, unit)
        context_meter.digest_metric(label, value, unit)

    def _digest_write(self, seconds: float, nbytes: int | None) -> None:
        """The metrics of one file write: stock's ``disk-write`` seconds, and
        its count and bytes unless nothing was written (``nbytes`` None:
        the write failed, timed all the same as by stock's meter)."""
        self._digest("disk-write", seconds, "seconds")
        if nbytes is not None:
            self._digest("disk-write", 1, "count")
            self._digest("disk-write", nbytes, "bytes")

    def _serialize(self, key: Key, value: object) -> list:
        """``[msgpack header, *payload frames]`` for ``value``; raises PickleError."""
        try:
            if self.mapped:
                header, frames = serialize_unsplit(value, self._digest)
                return [pack_header(header), *frames]
            with context_meter.add_callback(self._record):  # stock's serialize meters
                # [1:] drops stock's length prelude; our file has its own frame table.
                return serialize_bytelist(value, compression=self._compression, on_error="raise")[
                    1:
                ]
        except Exception as e:
            raise PickleError(key) from e

    def _write(self, key: Key, frames: list, memory: int) -> str:
        """Write ``frames`` to a new file for ``key``; returns its name.
        Raises MaxSpillExceeded or OSError."""
        max_disk = None if self.max_weight is False else self.max_weight + self._unspilled_disk()
        start = perf_counter()
        stored = None
        try:
            stored = self.files.put(file_stem(key), frames, memory, max_disk)
        finally:
            self._digest_write(perf_counter() - start, None if stored is None else stored[1])
        if stored is None:
            raise MaxSpillExceeded(key)
        return stored[0]

    def __setitem__(self, key: Key, value: object) -> None:
        frames = self._serialize(key, value)
        name = self._write(key, frames, safe_sizeof(value))
        self._register(key, name)

    def _register(self, key: Key, name: str) -> None:
        # Last write wins. zict.File keeps the *first* file when two writes of
        # a key race, which lets a stale value that a racing eviction left
        # registered shadow a newer one; a mapping must return what was set last.
        with self._register_lock:
            replaced = self.filenames.get(key)
            self.filenames[key] = name
        if replaced is not None:
            self._forget_file(replaced)

    def _forget_file(self, name: str) -> None:
        self.files.delete(name)

    def _read(self, key: Key, name: str, mapped: bool) -> object:
        """Read and deserialize the file ``name`` of ``key``, through a mapping
        or a copy. Raises KeyError or SpillFileError naming the key."""
        with context_meter.add_callback(self._record):
            try:
                with context_meter.meter("disk-read", "seconds"):
                    frames = self.files.read_mapped(name) if mapped else self.files.read(name)
            except KeyError:
                raise KeyError(key) from None
            except OSError as e:
                raise SpillFileError(
                    f"Cannot read back spilled key {key!r} from {self.files.path(name)}: {e}"
                ) from e
            context_meter.digest_metric("disk-read", 1, "count")
            context_meter.digest_metric("disk-read", _file_bytes(frames), "bytes")
            try:
                return frames_to_object(frames)
            except Exception as e:
                raise SpillFileError(
                    f"Spilled key {key!r} in {self.files.path(name)} failed to deserialize: "
                    f"{type(e).__name__}: {e}"
                ) from e

    def __getitem__(self, key: Key) -> object:
        return self._read(key, self.filenames[key], self.mapped)

    def __delitem__(self, key: Key) -> None:
        name = self.filenames.pop(key)
        self._forget_file(name)

    def __contains__(self, key: object) -> bool:
        return key in self.filenames

    def __iter__(self) -> Iterator[Key]:
        return iter(self.filenames)

    def __len__(self) -> int:
        return len(self.filenames)

    def path(self, key: Key) -> str:
        """Path of the file holding ``key``."""
        return str(self.files.path(self.filenames[key]))

    def __repr__(self) -> str:
        return f"<SpillStore {self.directory}: {len(self)} keys>"
