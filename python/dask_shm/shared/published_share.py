"""A worker's share of its tmpfs files, published as one number for its nanny.

The nanny's terminate check (:mod:`dask_shm.shared.monitor`) counts a
worker's private memory plus its share of the tmpfs files it holds. Counting
those files from outside (listing and ``stat``-ing each one) is O(files) work
on the nanny's event loop, which in a ``LocalCluster`` is also the
scheduler's and the client's. So the worker does the counting, in O(1):
:meth:`~dask_shm._core.FileStore.total` is kept by the Rust ledger as files
come and go, and a :class:`SharePublisher` thread writes it to
``<process directory>/<buffer directory name>.share`` every ``interval``
seconds (in a worker, :class:`NativeSharePublisher`'s Rust thread, which
takes no GIL), with the two figures of the process's
own mappings the nanny needs to count its shared pages as the worker's own
monitor does (:class:`Published`). The nanny reads those small files
(:func:`read_published`): O(processes + buffers), never O(files).

The same thread corrects the link counts that other processes change (a peer
dropping its hard link makes this worker's share grow), which is O(shared
files): with the GIL released, at most every ``refresh_interval`` seconds and
never more than about 2% of the time (the next refresh waits at least 50 times
as long as the last one took).

Robust to the worker dying: the files live in its process directory, which
is removed with it (or swept as a dead process's); the nanny only reads the
directories of its current worker's pid; a missing, half-written or
unreadable file counts 0 (a file is replaced by rename, so a reader sees the
old number or the new one).

Containers sharing one root often run workers with the same pid (each in a
PID namespace of its own): the nanny reads only directories whose name has
its worker's pid and start time, and a file counts only if the PID
namespace written beside the number is the nanny's own (its worker's).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from dask_shm import _core
from dask_shm.shared.paths import ProcessIdentity, process_start_time
from dask_shm.stop_signal import StopSignal

logger = logging.getLogger(__name__)

#: Suffix of the published files in a process directory.
SUFFIX = ".share"

#: Refreshing link counts may take at most 1/REFRESH_DUTY of the time.
REFRESH_DUTY = 50

_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC

#: How often a :class:`NativeSharePublisher`'s Python thread looks whether
#: its worker is alive and a refresh is due (seconds).
NATIVE_LOOK = 0.5


def share_path(buffer_directory: str) -> str:
    """Where the share of the buffer whose tier-2 files are in
    ``buffer_directory`` (``<process dir>/<name>``) is published."""
    return buffer_directory.rstrip(os.sep) + SUFFIX


def pid_namespace() -> int | None:
    """The identity (inode) of this process's PID namespace, if readable."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class Published(NamedTuple):
    """What a worker process published for its nanny (all in bytes)."""

    #: its share of the tmpfs files its buffers hold, summed over its buffers
    share: int = 0
    #: bytes of its own mappings of shared-memory files whose pages count
    #: elsewhere (:attr:`dask_shm.shared.monitor.SharedPages.mapped`)
    mapped: int = 0
    #: bytes it holds that neither its private memory nor its share shows
    #: (:attr:`dask_shm.shared.monitor.SharedPages.kept`, born blocks only it holds)
    kept: int = 0
    #: ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process
    #: of the host) just before ``mapped`` and ``kept`` were read; None if
    #: not published. A worker publishes every 50 ms while its publisher
    #: gets the GIL and the root has room, so an old stamp means stale figures.
    stamp: float | None = None


def _parse(text: bytes, namespace: int | None) -> Published:
    """The numbers of a published file: ``<share>``, ``<share> <pid
    namespace>`` or ``<share> <pid namespace or -> <mapped> <kept>
    <stamp>``; nothing for another namespace's. ValueError if garbled."""
    parts = text.split()
    if not parts:
        return Published()
    if len(parts) > 1 and parts[1] != b"-" and namespace is not None:
        if int(parts[1]) != namespace:
            return Published()
    if len(parts) >= 5:
        return Published(int(parts[0]), int(parts[2]), int(parts[3]), float(parts[4]))
    return Published(int(parts[0]))


def _process_dirs(root: str, pid: int) -> list[str]:
    base = os.path.join(root, f"dask-shm-{os.geteuid()}")
    start = process_start_time(pid)
    prefix = f"p-{pid}-" if start is None else f"{ProcessIdentity(pid, start).dirname}-"
    try:
        with os.scandir(base) as it:
            return [e.path for e in it if e.name.startswith(prefix)]
    except OSError:
        return []


def read_published(root: str, pid: int) -> Published:
    """What process ``pid`` (of this process's PID namespace) published
    under ``root``: the sum of its buffers' shares, and its mappings'
    figures (process-wide, so the largest any buffer wrote); zeros if it
    published nothing. Lists only the user directory (one entry per
    process) and the process's directories (one entry per buffer), reads
    one small file per buffer. Never raises."""
    share = mapped = kept = 0
    stamp: float | None = None
    namespace = pid_namespace()
    for directory in _process_dirs(root, pid):
        try:
            with os.scandir(directory) as it:
                published = [e.path for e in it if e.name.endswith(SUFFIX)]
        except OSError:
            continue
        for path in published:
            try:
                with open(path, "rb") as f:
                    one = _parse(f.read(128), namespace)
            except (OSError, ValueError):
                continue
            share += one.share
            if one.stamp is not None and (stamp is None or one.stamp > stamp):
                mapped, kept, stamp = one.mapped, one.kept, one.stamp
    return Published(share, mapped, kept, stamp)


def read_published_share(root: str, pid: int) -> int:
    """The sum of the shares process ``pid`` published under ``root``
    (:attr:`Published.share` of :func:`read_published`). Never raises."""
    return read_published(root, pid).share


class SharePublisher:
    """A daemon thread that publishes ``share()`` at ``path``, with
    ``pages()`` (``(mapped, kept)``, see :class:`Published`; zeros if not
    given) and the time they were read, every ``interval`` seconds, and
    calls ``refresh()``
    (the link-count correction, O(shared files), expected to release the
    GIL) at most every ``refresh_interval`` seconds and at most
    1/:data:`REFRESH_DUTY` of the time. It ends, removing the file, on
    :meth:`stop` or once ``alive()`` is false (its worker closed)."""

    def __init__(
        self,
        path: str,
        share: Callable[[], int],
        refresh: Callable[[], object],
        *,
        interval: float = 0.1,
        refresh_interval: float = 2.0,
        alive: Callable[[], bool] = lambda: True,
        pages: Callable[[], tuple[int, int]] | None = None,
    ):
        self.path = path
        self._share = share
        self._pages = pages
        self._refresh = refresh
        self._alive = alive
        self.interval = interval
        self.refresh_interval = refresh_interval
        self._stop = StopSignal()
        namespace = pid_namespace()
        self._namespace = b"-" if namespace is None else str(namespace).encode()
        self._thread = threading.Thread(
            target=self._run, name=f"dask-shm share {os.path.basename(path)}", daemon=True
        )
        #: refreshes done, and the seconds they took in all
        self.refreshes = 0
        self.refresh_seconds = 0.0

    def start(self) -> None:
        self.publish()
        self._thread.start()

    def publish(self) -> None:
        """Write the current figures, stamped (a reader tells stale figures
        by their stamp: the file is written even when they did not change)."""
        stamp = time.monotonic()
        # The pages first: a mapping made meanwhile then shows in neither.
        mapped, kept = (0, 0) if self._pages is None else self._pages()
        share = self._share()
        tmp = f"{self.path}.tmp"
        try:
            # os-level calls: this runs 20 times a second in every worker
            fd = os.open(tmp, _WRITE, 0o644)
            try:
                os.write(fd, b"%d %s %d %d %.6f" % (share, self._namespace, mapped, kept, stamp))
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as e:
            # A full root, say: the last figures stay, and age.
            logger.debug("dask-shm: cannot publish the share at %s: %s", self.path, e)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._remove_files()

    def _loop(self) -> None:
        next_refresh = time.monotonic() + self.refresh_interval
        while not self._stop.wait(self._look_interval()) and self._alive():
            try:
                now = time.monotonic()
                if now >= next_refresh:
                    self._refresh()
                    took = time.monotonic() - now
                    self.refreshes += 1
                    self.refresh_seconds += took
                    next_refresh = now + max(self.refresh_interval, REFRESH_DUTY * took)
                self._publish_round()
            except Exception:  # a closed store, a vanished directory
                logger.debug("dask-shm: share publisher %s", self.path, exc_info=True)

    def _look_interval(self) -> float:
        """Seconds between the thread's rounds."""
        return self.interval

    def _publish_round(self) -> None:
        """A round's publishing, after the refresh if one was due."""
        self.publish()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._remove_files()

    def _remove_files(self) -> None:
        for path in (self.path, f"{self.path}.tmp"):
            try:
                os.unlink(path)
            except OSError:
                pass


class NativeSharePublisher(SharePublisher):
    """A :class:`SharePublisher` whose publishing every ``interval`` seconds
    runs in a Rust thread (:class:`dask_shm._core.SharePublishing`), from
    ``stores``' totals and this process's mapping counters, without the GIL:
    a worker publishes 20 times a second all its life, and a Python thread
    doing so took the GIL from the task threads each time (3 ms of CPU a
    second per worker under load on the 2-core dev box). The Python thread
    wakes every :data:`NATIVE_LOOK` seconds only, to refresh link counts
    when due and to end both threads and remove the file once ``alive()``
    is false.

    ``share`` and ``pages`` must give what the Rust thread computes
    (``SharePublishing.figures_of(stores)``; the worker's monitor passes
    ``TieredFiles.ram_bytes`` and its published pages): they serve
    :meth:`publish`, called from Python at :meth:`start`."""

    def __init__(
        self,
        path: str,
        stores: Sequence[_core.FileStore],
        refresh: Callable[[], object],
        *,
        share: Callable[[], int],
        pages: Callable[[], tuple[int, int]],
        interval: float = 0.1,
        refresh_interval: float = 2.0,
        alive: Callable[[], bool] = lambda: True,
    ):
        super().__init__(
            path,
            share,
            refresh,
            interval=interval,
            refresh_interval=refresh_interval,
            alive=alive,
            pages=pages,
        )
        self._stores = list(stores)
        self._native: _core.SharePublishing | None = None

    def start(self) -> None:
        self.publish()
        self._native = _core.SharePublishing(
            self.path, self._stores, pid_namespace(), self.interval
        )
        self._thread.start()

    def _look_interval(self) -> float:
        return min(NATIVE_LOOK, self.refresh_interval)

    def _publish_round(self) -> None:
        pass  # the Rust thread publishes

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._stop_native()
            self._remove_files()

    def _stop_native(self) -> None:
        native = self._native
        if native is not None:
            native.stop()

    def running(self) -> bool:
        """Whether the Rust thread still publishes."""
        return self._native is not None and self._native.running()

    def stop(self) -> None:
        self._stop_native()
        super().stop()
