"""A worker's share of its tmpfs files, published as one number for its nanny.

The nanny's terminate check (:mod:`dask_shm.shared.monitor`) counts a
worker's private memory plus its share of the tmpfs files it holds. Counting
those files from outside (listing and ``stat``-ing each one) is O(files) work
on the nanny's event loop, which in a ``LocalCluster`` is also the
scheduler's and the client's. So the worker does the counting, in O(1):
:meth:`~dask_shm._core.FileStore.total` is kept by the Rust ledger as files
come and go, and a :class:`SharePublisher` thread writes it to
``<process directory>/<buffer directory name>.share`` whenever it changes
(checked every ``interval`` seconds). The nanny reads those small files
(:func:`read_published_share`): O(processes + buffers), never O(files).

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
from collections.abc import Callable

from dask_shm.shared.paths import ProcessIdentity, process_start_time

logger = logging.getLogger(__name__)

#: Suffix of the published files in a process directory.
SUFFIX = ".share"

#: Refreshing link counts may take at most 1/REFRESH_DUTY of the time.
REFRESH_DUTY = 50


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


def _parse(text: bytes, namespace: int | None) -> int:
    """The number of a published file: ``<bytes>`` or ``<bytes> <pid
    namespace>``; 0 for another namespace's. ValueError if garbled."""
    parts = text.split()
    if not parts:
        return 0
    if len(parts) > 1 and namespace is not None and int(parts[1]) != namespace:
        return 0
    return int(parts[0])


def _process_dirs(root: str, pid: int) -> list[str]:
    base = os.path.join(root, f"dask-shm-{os.geteuid()}")
    start = process_start_time(pid)
    prefix = f"p-{pid}-" if start is None else f"{ProcessIdentity(pid, start).dirname}-"
    try:
        with os.scandir(base) as it:
            return [e.path for e in it if e.name.startswith(prefix)]
    except OSError:
        return []


def read_published_share(root: str, pid: int) -> int:
    """Sum of the shares published by process ``pid`` (of this process's
    PID namespace) under ``root``; 0 if there are none. Lists only the user
    directory (one entry per process) and the process's directories (one
    entry per buffer), reads one small file per buffer. Never raises."""
    total, namespace = 0, pid_namespace()
    for directory in _process_dirs(root, pid):
        try:
            with os.scandir(directory) as it:
                published = [e.path for e in it if e.name.endswith(SUFFIX)]
        except OSError:
            continue
        for path in published:
            try:
                with open(path, "rb") as f:
                    total += _parse(f.read(64), namespace)
            except (OSError, ValueError):
                continue
    return total


class SharePublisher:
    """A daemon thread that publishes ``share()`` at ``path`` whenever it
    changes (checked every ``interval`` seconds) and calls ``refresh()``
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
    ):
        self.path = path
        self._share = share
        self._refresh = refresh
        self._alive = alive
        self.interval = interval
        self.refresh_interval = refresh_interval
        self._stop = threading.Event()
        self._published: int | None = None
        namespace = pid_namespace()
        self._suffix = "" if namespace is None else f" {namespace}"
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
        """Write the current share if it differs from the last one written."""
        value = self._share()
        if value == self._published:
            return
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{value}{self._suffix}")
            os.replace(tmp, self.path)
        except OSError as e:
            logger.debug("dask-shm: cannot publish the share at %s: %s", self.path, e)
            return
        self._published = value

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._remove_files()

    def _loop(self) -> None:
        next_refresh = time.monotonic() + self.refresh_interval
        while not self._stop.wait(self.interval) and self._alive():
            try:
                now = time.monotonic()
                if now >= next_refresh:
                    self._refresh()
                    took = time.monotonic() - now
                    self.refreshes += 1
                    self.refresh_seconds += took
                    next_refresh = now + max(self.refresh_interval, REFRESH_DUTY * took)
                self.publish()
            except Exception:  # a closed store, a vanished directory
                logger.debug("dask-shm: share publisher %s", self.path, exc_info=True)

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
