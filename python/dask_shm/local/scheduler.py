"""``dask_shm.local.get``: dask's process-pool scheduler with a shared-memory transport."""

from __future__ import annotations

import multiprocessing.pool
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import CancelledError, Executor, Future
from contextlib import ExitStack
from functools import partial
from types import TracebackType
from typing import Any, cast

from dask.local import MultiprocessingPoolExecutor, get_async
from dask.multiprocessing import _process_get_id, pack_exception, reraise
from dask.optimization import cull, fuse
from dask.system import CPU_COUNT
from dask.typing import Key
from dask.utils import ensure_dict

from dask_shm.config import multiprocessing_defaults
from dask_shm.local import config
from dask_shm.local.directory import ShmDirectory
from dask_shm.local.pool import Lease, private_pool, warm_pool
from dask_shm.local.transport import Transport


class _TrackedSubmit:
    """``submit`` that remembers unfinished futures, so that the files'
    directory is only removed once no pool process can still be using it."""

    def __init__(self, submit: Callable[..., Future[Any]], can_cancel: bool = True):
        self._submit = submit
        self._can_cancel = can_cancel
        self._lock = threading.Lock()
        self.pending: set[Future[Any]] = set()

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        fut = self._submit(fn, *args, **kwargs)
        with self._lock:
            self.pending.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future[Any]) -> None:
        with self._lock:
            self.pending.discard(fut)

    def drain(self) -> None:
        """Cancel what has not started (where the executor can) and wait for
        the rest."""
        with self._lock:
            futures = list(self.pending)
        if self._can_cancel:
            for fut in futures:
                fut.cancel()
        for fut in futures:
            try:
                fut.exception()
            except CancelledError:
                pass


def _end_transport(
    transport: Transport,
    lease: Lease | None,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Leave the computation's transport: with a pool of our own, its files
    are kept for the next computation (success, warm pool) or removed with the
    directory once the pool is stopped; with the caller's pool, whose tasks
    have been waited for, they are removed now."""
    if lease is None:
        transport.close()
    elif exc_type is None and lease.can_keep:
        lease.kept = transport.park()
    else:
        transport.close(remove=False)


def get(
    dsk: Mapping[Key, Any],
    keys: Sequence[Key] | Key,
    num_workers: int | None = None,
    *,
    pool: Executor | multiprocessing.pool.Pool | None = None,
    initializer: Callable[[], None] | None = None,
    chunksize: int | None = None,
    optimize_graph: bool = True,
    cache: MutableMapping[Key, Any] | None = None,
    memory_target: int | float | str | None = None,
    shm_threshold: int | str | None = None,
    warm: bool | None = None,
    queued_tasks: int | None = None,
    **kwargs: Any,
) -> Any:
    """Run a dask graph on a process pool, moving large buffers through
    shared-memory files instead of pipes.

    Use as ``dask.compute(x, scheduler=dask_shm.get)`` or
    ``dask.config.set(scheduler=dask_shm.get)``. Built on
    ``dask.local.get_async`` exactly like ``dask.multiprocessing.get`` (same
    pool, ``spawn`` context by default, graph culling and fusion), but the
    pool is kept warm between computations and what crosses to the pool
    differs: objects are pickled with
    protocol 5 and every buffer of at least ``shm_threshold`` bytes is written
    once into a file of this computation's 0700 directory under ``/dev/shm``
    and mapped by whoever reads it (see :mod:`dask_shm.local.transport`).

    Guarantees
    ----------
    - Results are ordinary Python objects. Their large buffers (e.g. numpy
      arrays) are *mapped*, not copied: private, writable, copy-on-write
      mappings of files that are already deleted; the memory is freed when the
      objects are garbage collected.
    - A result that already lives in a file (every intermediate in the parent,
      an unmodified input or view of one in a pool process) is passed on as a
      reference to that file, never written again.
    - Files of intermediates nobody needs any more are kept (up to
      ``shm.local.recycle-bytes``, 256 MiB, in the parent and in each pool
      process) and overwritten by later results instead of being deleted and
      allocated anew; a file is never overwritten while the parent or a pool
      process still maps it.
    - The pool ``get`` creates is kept warm for the next computation (unless
      ``warm=False`` or ``shm.local.warm-pool`` is false) and reused only if
      healthy and started for the same ``num_workers``, context, initializer
      and ``PYTHONHASHSEED``; otherwise it is closed and a new one started. It
      is shut down at exit or by :func:`dask_shm.local.shutdown_pool`.
    - When ``get`` raises (a task error, KeyboardInterrupt, a pool process
      that died, which raises ``BrokenProcessPool`` as with
      ``scheduler="processes"``), the directory and all its files are gone,
      and the pool ``get`` created (warm or not) has been terminated at once
      (stock waits for the tasks still running) and is never reused.
    - When it returns, the same holds, except on the warm pool: there the
      directory stays with only the files kept for reuse (at most
      ``recycle-bytes`` in the parent plus as much per pool process), which
      no process maps, for ``shm.local.idle-file-timeout`` (5 s; 0: not
      kept). The next computation on the pool within that time overwrites
      them instead of allocating new pages; then, or when the pool is closed
      or replaced, or on :func:`dask_shm.local.release_idle_files`, the
      directory is removed.
    - A directory left by a process killed outright (SIGKILL) is removed by
      the next computation.
    - A task error is raised in the caller with the task's exception type,
      message and remote traceback, as with ``scheduler="processes"``;
      ``rerun_exceptions_locally=True`` re-runs the failing task in the
      caller's process to raise it there.

    Parameters
    ----------
    num_workers:
        Pool size; default ``dask.config`` ``num_workers``, else the CPU count.
    pool:
        An existing ``concurrent.futures.Executor`` or ``multiprocessing.Pool``
        (also read from ``dask.config`` ``pool``). It is not shut down; on
        failure, running tasks are waited for before the files are removed.
    initializer, optimize_graph:
        As for ``dask.multiprocessing.get``.
    chunksize:
        Tasks sent to a pool process at once; default ``dask.config``
        ``chunksize``, else 1 (stock's default, 6, amortizes pickling through
        the pipe, which references to files do not need; batches of 6 leave a
        process idle while the other works through its batch).
    cache:
        Mapping for intermediate results, e.g. a :class:`SpillCache`.
    memory_target:
        If given (or ``shm.local.memory-target`` is set) and ``cache`` is
        not, intermediates go to a :class:`SpillCache` with this target,
        created for this computation and deleted at its end.
    shm_threshold:
        Smallest buffer, in bytes, that travels through a file (default
        ``shm.local.shm-threshold``, 64 KiB).
    warm:
        Use (and keep) the warm pool; default ``shm.local.warm-pool`` (True).
        Ignored when ``pool`` is given.
    queued_tasks:
        Tasks sent ahead for each pool process beyond the one it runs (in
        batches of ``chunksize``); default ``shm.local.queued-tasks`` (1). A
        process that finishes a task then starts the next at once instead of
        idling while the parent handles its result and sends another; 0 keeps
        one task (batch) in flight per process, as ``scheduler="processes"``.
    **kwargs:
        Passed to ``dask.local.get_async`` (``callbacks``,
        ``rerun_exceptions_locally``, ...).

    Raises
    ------
    TypeError
        ``func_dumps``/``func_loads`` were given: this scheduler serializes
        with its own transport.
    ValueError
        A bad ``memory_target``, ``shm_threshold``, ``queued_tasks`` or
        ``shm.local.*`` config value (the message names it and the accepted values).
    """
    for name in ("func_dumps", "func_loads"):
        if kwargs.pop(name, None) is not None:
            raise TypeError(f"dask_shm.get does its own serialization; {name} is not supported")
    threshold = config.shm_threshold(shm_threshold)
    recycle_bytes = config.recycle_bytes()
    queued = config.queued_tasks(queued_tasks)
    idle_file_timeout = config.idle_file_timeout()
    target = config.memory_target(memory_target) if cache is None else None
    defaults = multiprocessing_defaults()
    chunksize = chunksize or cast(int, defaults["chunksize"])
    pool = pool or cast(Any, defaults["pool"])
    initializer = initializer or cast(Any, defaults["initializer"])
    num_workers = num_workers or cast("int | None", defaults["num_workers"]) or CPU_COUNT

    if hasattr(dsk, "__dask_graph__"):
        dsk = dsk.__dask_graph__()
    dsk = ensure_dict(dsk)
    dsk2, dependencies = cull(dsk, keys)
    if optimize_graph:
        dsk3, dependencies = fuse(dsk2, keys, dependencies)
    else:
        dsk3 = dsk2

    with ExitStack() as stack:
        if target is not None:
            from dask_shm.local.cache import SpillCache  # imports distributed

            cache = stack.enter_context(SpillCache(target))
        executor: Executor
        lease: Lease | None = None
        if pool is None:
            use_warm = config.warm_pool() if warm is None else warm
            # Entered first, so left last: the pool is stopped (killed on
            # failure) before its directory is removed or kept.
            lease = stack.enter_context(
                warm_pool(num_workers, initializer, idle_file_timeout)
                if use_warm
                else private_pool(num_workers, initializer)
            )
            executor = lease.executor
            directory = lease.directory.path
        else:
            shm = ShmDirectory()
            stack.callback(shm.close)
            directory = shm.path
            if isinstance(pool, multiprocessing.pool.Pool):
                executor = MultiprocessingPoolExecutor(pool)
            else:
                executor = pool
        transport = Transport(directory, threshold, recycle_bytes=recycle_bytes)
        stack.push(partial(_end_transport, transport, lease))
        if lease is not None:
            transport.seed(lease.files)
        # dask's wrapper of a multiprocessing.Pool sets its futures' results
        # from the pool's result-handler thread, which dies on a cancelled
        # one (InvalidStateError): the pool would never answer again.
        submit = _TrackedSubmit(
            executor.submit, can_cancel=not isinstance(executor, MultiprocessingPoolExecutor)
        )
        if pool is not None:
            # Not ours to stop: on failure, wait for what is still running.
            stack.callback(submit.drain)

        # get_async keeps at most this many tasks (batches) in flight.
        in_flight = executor._max_workers * (1 + queued)  # type: ignore[attr-defined]
        result = get_async(
            submit,
            in_flight,
            dsk3,
            keys,
            cache=cache,
            get_id=_process_get_id,
            dumps=transport.dumps,
            loads=transport.loads,
            pack_exception=pack_exception,
            raise_exception=reraise,
            chunksize=chunksize,
            **kwargs,
        )
    return result
