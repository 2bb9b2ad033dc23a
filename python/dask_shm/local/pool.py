"""The warm process pool that :func:`dask_shm.local.get` reuses across computations.

Starting a ``spawn`` pool costs a fresh interpreter per process plus its
imports; a computation that creates its own pool pays that every time. Here one
pool is kept between computations, the way Ray keeps its workers:

- It is sized by ``num_workers`` and started with the same context, initializer
  and ``PYTHONHASHSEED`` as ``dask.multiprocessing.get``. A computation asking
  for another size, context (``multiprocessing.context``), initializer or
  ``PYTHONHASHSEED`` closes the idle pool and starts a new one.
- It is never reused once broken: a computation that fails in any way (task
  error, interrupt, dead pool process) terminates it at once, and a pool one of
  whose processes died between computations is terminated and replaced.
- One computation at a time uses it; a computation started while another holds
  it gets a pool of its own, torn down when it ends (the behaviour of
  ``warm_pool=False``).
- It is shut down at interpreter exit, or by :func:`shutdown_pool`.
- It keeps the directory of the last computation that succeeded on it, with
  the files left there for reuse (see :meth:`Transport.park
  <dask_shm.local.transport.Transport.park>`), for
  ``shm.local.idle-file-timeout`` (5 s): the next computation on the pool
  within that time works in it and overwrites those files. The directory is
  removed when that time passes, when the pool is closed or replaced, and by
  :func:`release_idle_files`.

A new pool starts all its processes at once and has them import the transport
right away, so that this overlaps with the parent's graph preparation.

Threads of native libraries: each pool process starts with ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to ``max(1, cpus //
num_workers)`` (the ones already set in the environment are left as they are),
so that ``num_workers`` processes each running a BLAS call do not oversubscribe
the CPUs. distributed's nanny (``distributed.nanny.pre-spawn-environ``) and Ray
do the same for their worker processes; ``scheduler="processes"`` does not.
"""

from __future__ import annotations

import multiprocessing.util
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any

import psutil
from dask.multiprocessing import get_context, initialize_worker_process
from dask.system import CPU_COUNT

from dask_shm.local import config
from dask_shm.local.directory import ShmDirectory

#: Thread-count variables of OpenMP, OpenBLAS and MKL, read when they load.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_environ_lock = threading.Lock()


def kill_pool(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now: cancel queued work and terminate its processes.

    Python 3.14 has ``ProcessPoolExecutor.terminate_workers``; before that the
    processes are only reachable through ``_processes``.
    """
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def is_healthy(pool: ProcessPoolExecutor) -> bool:
    """False if the pool is broken, shut down, or one of its processes has exited."""
    if getattr(pool, "_broken", False) or getattr(pool, "_shutdown_thread", False):
        return False
    processes = (getattr(pool, "_processes", None) or {}).values()
    return all(_running(proc) for proc in processes)


def _running(proc: Any) -> bool:
    """Whether a pool process is alive, as the kernel says (gone or a zombie:
    dead). ``exitcode`` was seen None for a process killed moments before,
    while the pool's own thread had not noticed either: the next computation
    then ran on a pool one process short, or failed with BrokenProcessPool."""
    if proc.exitcode is not None:
        return False
    try:
        return psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _warm_up() -> int:
    """Runs in each new pool process: import what every task message needs."""
    import dask_shm.local.transport  # noqa: F401

    return os.getpid()


def _hash_seed() -> str:
    # As dask.multiprocessing.get: consistent hashing in the pool.
    if os.environ.get("PYTHONHASHSEED") in (None, "0"):
        os.environ["PYTHONHASHSEED"] = "6640"
    return os.environ["PYTHONHASHSEED"]


@contextmanager
def _thread_limits(num_workers: int) -> Iterator[None]:
    """Set the unset :data:`THREAD_VARIABLES` in ``os.environ`` (inherited by
    processes started meanwhile), and remove them again afterwards."""
    threads = str(max(1, CPU_COUNT // num_workers))
    with _environ_lock:
        added = [name for name in THREAD_VARIABLES if name not in os.environ]
        for name in added:
            os.environ[name] = threads
        try:
            yield
        finally:
            for name in added:
                os.environ.pop(name, None)


def new_pool(num_workers: int, initializer: Callable[[], None] | None) -> ProcessPoolExecutor:
    """A spawn (or ``multiprocessing.context``) pool as ``dask.multiprocessing.get``
    makes it, with all ``num_workers`` processes started (with the thread
    limits of the module docstring) and importing the transport."""
    _hash_seed()
    pool = ProcessPoolExecutor(
        num_workers,
        mp_context=get_context(),
        initializer=partial(initialize_worker_process, user_initializer=initializer),
    )
    # Each submit while no process is idle starts one more process, at once
    # (spawn and forkserver; fork starts them all on the first submit).
    with _thread_limits(num_workers):
        for _ in range(num_workers):
            pool.submit(_warm_up)
    return pool


def _key(num_workers: int, initializer: Callable[[], None] | None) -> tuple[Any, ...]:
    # Under the lock: a pool starting in another thread has its thread
    # limits in os.environ meanwhile, and they are not this caller's.
    with _environ_lock:
        threads = tuple(os.environ.get(name) for name in THREAD_VARIABLES)
    return (num_workers, get_context().get_start_method(), initializer, _hash_seed(), threads)


class Lease:
    """What one computation gets: a pool and the directory for its files.

    ``files`` lists files of ``directory`` left by the previous computation
    for reuse (``name -> size``). Set ``kept`` (with
    :meth:`Transport.park <dask_shm.local.transport.Transport.park>`) before
    the block ends to have the warm pool keep the directory with those files;
    otherwise the directory is removed once the pool is stopped or given back.
    ``can_keep`` says whether the pool would keep it.
    """

    def __init__(
        self,
        executor: ProcessPoolExecutor,
        directory: ShmDirectory,
        files: dict[str, int] | None = None,
        can_keep: bool = False,
    ):
        self.executor = executor
        self.directory = directory
        self.files = files or {}
        self.can_keep = can_keep
        self.kept: dict[str, int] | None = None


class _WarmPool:
    def __init__(self) -> None:
        self._start_afresh()

    def _start_afresh(self) -> None:
        self.lock = threading.Lock()  # held by the computation using the pool
        self.guard = threading.Lock()  # protects the fields below
        self.pool: ProcessPoolExecutor | None = None
        self.key: tuple[Any, ...] | None = None
        #: The last computation's directory and the files kept in it for reuse.
        self.parked: tuple[ShmDirectory, dict[str, int]] | None = None
        self.timer: threading.Timer | None = None
        #: The process that has registered :meth:`_shut_down_at_exit`'s hook.
        self.exit_hook_pid: int | None = None

    def _shut_down_at_exit(self) -> None:
        """Have this process shut the pool down when it exits, the main process
        or a multiprocessing child (a task of dask_shm.get or of the processes
        scheduler, a user's Process, a distributed worker that is not daemonic).

        A child leaves by ``os._exit``, so atexit handlers do not run in it, and
        multiprocessing joins the child's own processes (the pool's) before
        concurrent.futures' exit hook would stop them: without this the child,
        and a parent waiting for it, would never exit. multiprocessing's exit
        finalizers run in both; they are registered per process because a
        forked child starts with none. Priority 20 runs this one before
        multiprocessing closes the pool's queues (priority 10).
        """
        if self.exit_hook_pid != os.getpid():
            multiprocessing.util.Finalize(None, self.shutdown, exitpriority=20)
            self.exit_hook_pid = os.getpid()

    def _unpark(self) -> tuple[ShmDirectory, dict[str, int]] | None:
        """Take the parked directory, if any (caller holds ``guard``)."""
        parked, self.parked = self.parked, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return parked

    def _take(
        self, key: tuple[Any, ...]
    ) -> tuple[ProcessPoolExecutor | None, tuple[ShmDirectory, dict[str, int]] | None]:
        """The pool and its parked directory if it matches ``key`` and is
        healthy; else close both (the pool is idle) and return Nones."""
        with self.guard:
            pool, self.pool = self.pool, None
            same = self.key == key
            self.key = None
            parked = self._unpark()
        if pool is not None and same and is_healthy(pool):
            return pool, parked
        if parked is not None:
            parked[0].close()
        if pool is None:
            return None, None
        if is_healthy(pool):
            pool.shutdown(wait=True)
        else:
            kill_pool(pool)
        return None, None

    def _give_back(
        self,
        pool: ProcessPoolExecutor,
        key: tuple[Any, ...],
        parked: tuple[ShmDirectory, dict[str, int]] | None,
        timeout: float,
    ) -> None:
        with self.guard:
            self.pool, self.key = pool, key
            self.parked = parked
            if parked is not None:
                self.timer = threading.Timer(timeout, self._expire, args=(parked[0],))
                self.timer.daemon = True
                self.timer.start()

    def _expire(self, directory: ShmDirectory) -> None:
        """The idle time of a parked directory is over: remove it, unless a
        computation has taken it meanwhile."""
        with self.guard:
            if self.parked is None or self.parked[0] is not directory:
                return
            self.parked = None
            self.timer = None
        directory.close()

    def release_files(self) -> None:
        with self.guard:
            parked = self._unpark()
        if parked is not None:
            parked[0].close()

    @contextmanager
    def use(
        self,
        num_workers: int,
        initializer: Callable[[], None] | None,
        idle_file_timeout: float,
    ) -> Iterator[Lease]:
        """The warm pool for one computation; if it is in use by another
        computation, a private pool closed at the end. If the block raises, the
        pool is killed and not kept, and the directory removed. Files kept for
        reuse stay ``idle_file_timeout`` seconds after the block (0: none)."""
        if not self.lock.acquire(blocking=False):
            with private_pool(num_workers, initializer) as lease:
                yield lease
            return
        try:
            self._shut_down_at_exit()
            key = _key(num_workers, initializer)
            timeout = idle_file_timeout
            pool, parked = self._take(key)
            if parked is not None and parked[0].base != config.shm_directory_base():
                parked[0].close()  # shm.local.shm-directory changed meanwhile
                parked = None
            if parked is None:
                try:
                    parked = (ShmDirectory(), {})
                except BaseException:
                    if pool is not None:
                        self._give_back(pool, key, None, timeout)
                    raise
            if pool is None:
                try:
                    pool = new_pool(num_workers, initializer)
                except BaseException:
                    parked[0].close()
                    raise
            lease = Lease(pool, parked[0], parked[1], can_keep=timeout > 0)
            try:
                yield lease
            except BaseException:
                kill_pool(pool)
                lease.directory.close()
                raise
            if is_healthy(pool):
                kept = None if lease.kept is None else (lease.directory, lease.kept)
                self._give_back(pool, key, kept, timeout)
                if kept is None:
                    lease.directory.close()
            else:
                kill_pool(pool)
                lease.directory.close()
        finally:
            self.lock.release()

    def shutdown(self) -> None:
        with self.guard:
            pool, self.pool, self.key = self.pool, None, None
            parked = self._unpark()
        if pool is not None:
            if is_healthy(pool):
                pool.shutdown(wait=True, cancel_futures=True)
            else:
                kill_pool(pool)
        if parked is not None:
            parked[0].close()

    def forget(self) -> None:
        """In a child made by fork: the pool, its processes and the parked
        directory are the parent's, and the locks may have been held by a thread
        that does not exist here. Start without a pool, touching none of them."""
        self._start_afresh()

    def processes(self) -> list[int]:
        with self.guard:
            pool = self.pool
        procs = (getattr(pool, "_processes", None) or {}).values() if pool else ()
        return sorted(p.pid for p in procs if p.pid is not None)


@contextmanager
def private_pool(num_workers: int, initializer: Callable[[], None] | None) -> Iterator[Lease]:
    """A pool and a directory for one computation: the pool is shut down when
    the block ends (killed at once if it raises), then the directory removed."""
    directory = ShmDirectory()
    try:
        pool = new_pool(num_workers, initializer)
        try:
            yield Lease(pool, directory)
        except BaseException:
            kill_pool(pool)
            raise
        pool.shutdown(wait=True)
    finally:
        directory.close()


_WARM = _WarmPool()
os.register_at_fork(after_in_child=_WARM.forget)

warm_pool = _WARM.use


def shutdown_pool() -> None:
    """Shut down the warm pool of :func:`dask_shm.local.get`, if there is one
    (waiting for its processes to exit). The next computation starts a new
    one. Safe to call at any time; a computation running on it keeps its pool
    and gives it back when it ends."""
    _WARM.shutdown()


def release_idle_files() -> None:
    """Remove now the directory and files the idle warm pool keeps for the
    next computation (``shm.local.idle-file-timeout``), freeing their
    shared memory; the pool itself stays. Safe to call at any time: a
    computation running on the pool is not affected."""
    _WARM.release_files()


def warm_pool_pids() -> list[int]:
    """Process ids of the idle warm pool (empty if there is none or it is in use)."""
    return _WARM.processes()
