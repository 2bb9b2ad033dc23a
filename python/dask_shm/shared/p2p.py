"""P2P shuffle and rechunk batches handed to same-host peers as files.

Stock distributed sends every shard batch of a P2P shuffle or rechunk with
the ``shuffle_receive`` RPC (``ShuffleRun._send``), over loopback TCP when
the peer is on this host. In shared-memory mode, :func:`install` wraps three
methods of ``distributed.shuffle._core.ShuffleRun`` (class-wide, acting only
for runs of a worker registered with :func:`enable`):

- ``_send``: for a peer that shares our tier-2 root (it published that
  root's identity token in the :class:`~dask_shm.shared.registry.PeerRegistry`),
  the batch is written once as a file (:mod:`~dask_shm.shared.shard_file`)
  in ``<process dir>/p2p/<worker>/<run id>/`` and the same RPC carries only
  a small handle. The file is written in the event loop with one ``writev``
  (see :func:`_write`). The receiver unlinks the file as it opens it; the
  sender unlinks it when the call ends any other way than OK. If the file
  cannot be written (disk full, a batch that does not pickle) or the
  receiver cannot use it, the same batch is sent the stock way.
  Other peers get the stock call.
- ``receive``: a handle is opened (mapped copy-on-write, unlinked at once),
  and the shards go to distributed's own receive path. A run that keeps
  shards in memory (``distributed.p2p.storage.disk: false``) gets a copy of
  each shard's buffer, as stock deserialization gives, so that a consumed
  output chunk frees its memory without waiting for the rest of its batch. A handle it cannot
  use is answered with an error carrying :data:`RESEND`, which the sender
  turns into a stock resend: a shuffle never fails because of us.
- ``close``: the run's directory goes with the run (finished, failed or
  cancelled); the worker's directory goes at :func:`disable`, and a killed
  process's with its process directory (swept by peers).

The receiver does not adopt the file into its shuffle buffer: a batch holds
shards of many output partitions, and distributed's disk buffer appends
each partition's shards to a file of its own, so the bytes are written there
once again (as they are in stock).

Counters (``buffer.shm_counters``, see :mod:`~dask_shm.shared.metrics`):
``p2p_file_batches``/``p2p_file_bytes`` handed over by file,
``p2p_tcp_batches``/``p2p_tcp_bytes`` sent the stock way (bytes estimated by
``sizeof`` for batches distributed did not pickle), ``p2p_file_fallbacks``
batches that were meant to go by file but went by TCP.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.core import error_message
from distributed.metrics import context_meter
from distributed.sizeof import safe_sizeof

from dask_shm.shared import paths, shard_file
from dask_shm.shared.shard_file import ShardFile, ShardFileError

if TYPE_CHECKING:
    from distributed.shuffle._core import ShuffleRun

    from dask_shm.shared.buffer import SharedSpillBuffer
    from dask_shm.shared.registry import PeerRegistry

logger = logging.getLogger(__name__)

#: The key of the ``data`` argument of ``shuffle_receive`` that holds a handle.
HANDLE_KEY = "dask-shm-shard-file"
#: Set in the receiver's error reply when the sender should resend the stock way.
RESEND = "dask-shm-resend"


@dataclass
class WorkerFiles:
    """What one shared-mode worker needs to send and receive batch files."""

    address: str
    buffer: SharedSpillBuffer
    registry: PeerRegistry
    #: the shared-memory root and its identity token
    root: str
    token: str
    #: this worker's batch directory, ``<process dir>/p2p/<buffer name>``
    directory: str
    #: ``<root>/dask-shm-<uid>``, what handles' paths are relative to
    user_root: str
    _runs: set[int] = field(default_factory=set)

    def shares_root_with(self, address: str) -> bool:
        """Whether the worker at ``address`` takes our batches as files: it
        shares our root and published that it receives shard files."""
        entry = self.registry.entry(address)
        if entry is None or not entry.p2p:
            return False
        return bool(self.registry.shared_roots(address, self.address, [self.token]))

    def run_directory(self, run_id: int) -> str:
        path = os.path.join(self.directory, str(run_id))
        if run_id not in self._runs:
            os.makedirs(path, mode=0o700, exist_ok=True)
            self._runs.add(run_id)
        return path

    def remove_run(self, run_id: int) -> None:
        self._runs.discard(run_id)
        shutil.rmtree(os.path.join(self.directory, str(run_id)), ignore_errors=True)

    def count(self, name: str, nbytes: int) -> None:
        counters = self.buffer.shm_counters
        counters[f"p2p_{name}_batches"] += 1
        counters[f"p2p_{name}_bytes"] += nbytes


#: worker address -> its files; runs of other workers are left to stock
_workers: dict[str, WorkerFiles] = {}
_originals: dict[str, Callable[..., Any]] = {}


def _batch_nbytes(batch: list | bytes) -> int:
    return len(batch) if isinstance(batch, bytes) else safe_sizeof(batch)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write(files: WorkerFiles, run: ShuffleRun, batch: list | bytes) -> ShardFile:
    """Write ``batch`` as a file for a peer. In the event loop, as stock writes
    a batch to its socket: one ``writev`` of the pickle and the arrays' own
    memory into tmpfs pages costs less than handing the batch to a thread
    and waiting for it (and the GIL) to come back."""
    path = os.path.join(files.run_directory(run.run_id), f"{uuid.uuid4().hex}.p2p")
    # The fine performance metrics stock gives a batch sent over TCP (inside
    # CommShardsBuffer's "send"): pickling it is "serialize"; "compress" is
    # zero here, since a batch file is mapped as written and never compressed,
    # but its key stays, so the breakdown has the same entries as stock's.
    size, nonce = shard_file.write(
        path, batch, serializing=lambda: context_meter.meter("serialize")
    )
    context_meter.digest_metric("compress", 0.0, "seconds")
    return ShardFile(os.path.relpath(path, files.user_root), files.token, size, nonce)


async def _send_by_file(
    original: Callable[..., Awaitable[Any]],
    files: WorkerFiles,
    run: ShuffleRun,
    address: str,
    batch: list | bytes,
) -> Any:
    run.raise_if_closed()
    if not files.shares_root_with(address):
        return await _send_by_tcp(original, files, run, address, batch)
    try:
        handle = _write(files, run, batch)
    except Exception as e:  # disk full, a batch that does not pickle: stock may still send it
        logger.info("dask-shm: shard batch for %s sent as bytes: cannot write it: %r", address, e)
        return await _resend(original, files, run, address, batch)
    path = os.path.join(files.user_root, handle.relpath)
    response = None
    try:
        run.raise_if_closed()
        response = await run.rpc(address).shuffle_receive(
            data={HANDLE_KEY: handle.to_msg()}, shuffle_id=run.id, run_id=run.run_id
        )
    finally:
        # A receiver that answered OK has opened and unlinked the file.
        if not (isinstance(response, dict) and response.get("status") == "OK"):
            _unlink(path)
    if isinstance(response, dict) and response.get(RESEND):
        logger.info(
            "dask-shm: %s could not use a shard file (%s); sending the batch as bytes",
            address,
            response.get("exception_text", ""),
        )
        return await _resend(original, files, run, address, batch)
    files.count("file", handle.size)
    return response


async def _resend(
    original: Callable[..., Awaitable[Any]],
    files: WorkerFiles,
    run: ShuffleRun,
    address: str,
    batch: list | bytes,
) -> Any:
    files.buffer.shm_counters["p2p_file_fallbacks"] += 1
    return await _send_by_tcp(original, files, run, address, batch)


async def _send_by_tcp(
    original: Callable[..., Awaitable[Any]],
    files: WorkerFiles,
    run: ShuffleRun,
    address: str,
    batch: list | bytes,
) -> Any:
    """The stock send, counted as a TCP batch."""
    files.count("tcp", _batch_nbytes(batch))
    return await original(run, address, batch)


def _keeps_shards_in_memory(run: ShuffleRun) -> bool:
    from distributed.shuffle._memory import MemoryShardsBuffer

    return isinstance(getattr(run, "_disk_buffer", None), MemoryShardsBuffer)


def _open(files: WorkerFiles | None, msg: Any, copy: bool) -> list | bytes:
    """The batch a handle names; ShardFileError if this worker cannot use it."""
    if files is None:
        raise ShardFileError("this worker does not receive shard files")
    handle = ShardFile.from_msg(msg)
    if handle.token != files.token:
        raise ShardFileError("the shard file is on a root this worker does not share")
    path = os.path.join(files.user_root, handle.relpath)
    return shard_file.read(path, handle.size, handle.nonce, copy=copy)


def _wrap_send(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(original)
    async def _send(self: ShuffleRun, address: str, shards: list | bytes) -> Any:
        files = _workers.get(self.local_address)
        if files is None:
            return await original(self, address, shards)
        return await _send_by_file(original, files, self, address, shards)

    return _send


def _wrap_receive(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(original)
    async def receive(self: ShuffleRun, data: Any) -> Any:
        if isinstance(data, dict) and HANDLE_KEY in data:
            try:
                files = _workers.get(self.local_address)
                data = _open(files, data[HANDLE_KEY], _keeps_shards_in_memory(self))
            except Exception as e:  # whatever it is, the batch comes again as bytes
                logger.info("dask-shm: %s: %s; asking for bytes", self, e)
                return {**error_message(e), RESEND: True}
            if files is not None:
                files.buffer.shm_counters["p2p_received_file_batches"] += 1
        return await original(self, data)

    return receive


def _wrap_close(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(original)
    async def close(self: ShuffleRun) -> None:
        try:
            await original(self)
        finally:
            files = _workers.get(self.local_address)
            if files is not None:
                files.remove_run(self.run_id)

    return close


_WRAPPERS = {"_send": _wrap_send, "receive": _wrap_receive, "close": _wrap_close}


#: Left wrapped by :func:`uninstall`: a peer that read our registry entry just
#: before we withdrew it may still send a handle (for up to the registry's
#: ``CACHE_SECONDS``). Stock's ``receive`` would take the handle for a batch of
#: shards and fail the run; the wrapper, finding no worker of ours, answers it
#: with a request for bytes.
_KEPT = frozenset({"receive"})


def install() -> None:
    """Wrap ``ShuffleRun._send``, ``receive`` and ``close`` (once per process)."""
    from distributed.shuffle._core import ShuffleRun

    for name, wrap in _WRAPPERS.items():
        if name in _originals:
            continue
        original = getattr(ShuffleRun, name)
        _originals[name] = original
        setattr(ShuffleRun, name, wrap(original))


def uninstall() -> None:
    """Put the stock ``_send`` and ``close`` back (``receive`` stays wrapped:
    see :data:`_KEPT`)."""
    from distributed.shuffle._core import ShuffleRun

    for name in [n for n in _originals if n not in _KEPT]:
        setattr(ShuffleRun, name, _originals.pop(name))


def enable(
    address: str,
    buffer: SharedSpillBuffer,
    registry: PeerRegistry,
    root: str,
    token: str,
) -> bool:
    """Send and receive the P2P batches of the worker at ``address`` by file
    where the peer shares ``root`` (identity ``token``); returns False (and
    leaves P2P stock) when this distributed lacks the methods wrapped (see
    :mod:`dask_shm.compat`). Raises OSError if its directory cannot be made."""
    from dask_shm.compat import shuffle_run_methods_present

    if not shuffle_run_methods_present():
        return False
    directory = os.path.join(paths.subdir(root, "p2p"), os.path.basename(buffer.store.directory))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    _workers[address] = WorkerFiles(
        address, buffer, registry, root, token, directory, paths.user_root(root)
    )
    install()
    return True


def by_file(address: str) -> bool:
    """Whether the worker at ``address`` (in this process) hands its P2P
    batches to same-host peers as files: :func:`enable` succeeded for it."""
    return address in _workers


def disable(address: str) -> None:
    """Stop for ``address``, removing its batch files; the stock methods come
    back when no worker of this process uses them."""
    files = _workers.pop(address, None)
    if files is not None:
        shutil.rmtree(files.directory, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(files.directory))
        except OSError:
            pass
    if not _workers:
        uninstall()
