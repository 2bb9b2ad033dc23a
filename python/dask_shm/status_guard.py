"""A closing worker stays closing: status changes from the scheduler that
arrive once ``Worker.close`` has begun are ignored.

In stock distributed a worker that starts closing while a
``worker-status-change`` message from the scheduler is in flight (for
example ``running``, sent when a ``retire_workers`` call gives up on it) goes
back to ``running``. When its scheduler connection then breaks, as it does
while the worker closes, ``Worker.close`` runs a second time, and the two
closes shut the same thread pools down at once: the second clears the stop
sentinel the first had queued, so the first waits its whole timeout (30 s)
for threads that never see it, and a test or cluster teardown with a shorter
deadline fails. distributed's own ``test_RetireWorker_with_actor`` stalled so
here in 1 of 40 runs in stock, 3 of 40 with ``dask_shm`` preloaded and 1 to
5 of 40 per series in shared-memory mode (more under load; our teardown adds
a few milliseconds inside the close, which widens the window); with the
guard, in none of 80. The preload installs it on every worker, and
:class:`~dask_shm.shared.SharedMemoryPlugin` on the workers it sets up.

:func:`install` replaces the worker's ``worker-status-change`` stream
handler (see :func:`dask_shm.compat.worker_status_change_handler`) with one
that drops a change while the worker is closing, closed or failed, and
passes every other one to stock's handler. It stays for the worker's
lifetime: a plugin's teardown runs inside ``Worker.close``, exactly when the
guard is needed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

HANDLER = "worker-status-change"


def install(worker: Worker) -> bool:
    """Guard ``worker``'s status against changes arriving while it closes;
    returns False (nothing done) when this distributed has no such handler.
    Installing twice is the same as once."""
    from distributed.core import Status

    from dask_shm.compat import worker_status_change_handler

    original = worker.stream_handlers.get(HANDLER)
    if getattr(original, "_dask_shm_guard", False):
        return True
    if original is None or not worker_status_change_handler():
        return False
    ended = (Status.closing, Status.closed, Status.failed)

    def handle_worker_status_change(*args: Any, **kwargs: Any) -> None:
        if worker.status in ended:
            logger.debug(
                "dask-shm: %s is %s; status change %s from the scheduler ignored",
                worker.address_safe,
                worker.status.name,
                kwargs.get("status"),
            )
            return
        original(*args, **kwargs)

    handle_worker_status_change._dask_shm_guard = True  # type: ignore[attr-defined]
    worker.stream_handlers[HANDLER] = handle_worker_status_change
    return True
