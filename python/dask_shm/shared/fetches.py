"""The receiving side of a fetch: what a worker's ``gather_dep`` makes of a
peer's reply in shared-memory mode.

:func:`receive_fetches_into` wraps ``Worker.gather_dep`` so that

- handles deserialized during the fetch go to this worker's buffer
  (:func:`~dask_shm.shared.transfer.receiving_into`);
- a handle that could not be resolved (it deserialized into an
  :class:`~dask_shm.shared.transfer.Unresolved` marker) is a key missing on
  that peer: distributed fetches it elsewhere or asks the scheduler, and the
  peer is asked for bytes for files of that root from now on
  (:meth:`PeerRegistry.refuse <dask_shm.shared.registry.PeerRegistry.refuse>`),
  so a retry succeeds;
- a peer that cannot read a key back (its spilled file vanished or was
  tampered with: :class:`~dask_shm.shared.transfer.PeerReadError` naming
  the key) makes the tasks of this worker waiting for that key fail with
  :class:`~dask_shm.SpillFileError` and that message, as a task reading the
  key on the peer itself would, reported to the scheduler as their own
  failure (stock distributed leaves them waiting forever,
  dask/distributed#6705). The other keys of the same request are taken as
  missing on that peer and fetched again.

The scheduler's ``replicate``/``rebalance`` fetch through the worker's
``gather`` handler, not ``gather_dep``: there an unresolved key is left out
of ``Worker.update_data`` and reported to the scheduler as not acquired
(``partial-fail``: the scheduler retries it), and, the sender being unknown
there, every peer is asked for bytes for files of that root.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from time import time
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.core import error_message
from distributed.protocol import pickle
from distributed.worker_state_machine import (
    GatherDepFailureEvent,
    GatherDepSuccessEvent,
    TaskErredMsg,
)

from dask_shm._core import SpillFileError
from dask_shm.shared import transfer
from dask_shm.shared.registry import ANY

if TYPE_CHECKING:
    from distributed import Worker

    from dask_shm.shared.buffer import SharedSpillBuffer
    from dask_shm.shared.registry import PeerRegistry

logger = logging.getLogger(__name__)


def receive_fetches_into(
    worker: Worker, buffer: SharedSpillBuffer, registry: PeerRegistry, tokens: dict[int, str]
) -> Any:
    """Wrap ``worker.gather_dep`` as described above; returns the original.
    ``tokens`` are the identity tokens of ``buffer``'s linkable tiers, by number."""
    original = worker.gather_dep

    async def gather_dep(peer: str, to_gather: Collection[Key], *args: Any, **kwargs: Any) -> Any:
        with transfer.receiving_into(buffer):
            event = await original(peer, to_gather, *args, **kwargs)
        if isinstance(event, GatherDepSuccessEvent):
            dropped = transfer.drop_unresolved(event.data)
            if dropped:
                _refuse(registry, worker.address, peer, buffer, tokens, dropped)
                logger.warning(
                    "dask-shm: %d handle(s) from %s could not be resolved (%s); "
                    "fetching them again as bytes",
                    len(dropped),
                    peer,
                    ", ".join(map(repr, list(dropped)[:3])),
                )
        elif isinstance(event, GatherDepFailureEvent):
            exc = _exception_of(event)
            if isinstance(exc, transfer.PeerReadError):
                return _fail_waiting_tasks(worker, peer, to_gather, exc, event)
        return event

    worker.gather_dep = gather_dep  # type: ignore[method-assign,assignment]
    return original


def drop_unresolved_updates(
    worker: Worker, buffer: SharedSpillBuffer, registry: PeerRegistry, tokens: dict[int, str]
) -> Any:
    """Make ``worker.update_data`` leave out unresolved handles and the
    ``gather`` handler report them as failed (see above); returns the
    original ``gather`` handler."""
    original = worker.update_data
    original_gather = worker.handlers["gather"]

    async def gather(who_has: dict) -> dict:
        # Into this worker's buffer: with several workers in one process,
        # the process-wide default is another worker's.
        with transfer.receiving_into(buffer):
            result = await original_gather(who_has=who_has)
        lost = [k for k in who_has if k not in worker.data]
        if result.get("status") == "OK" and lost:
            return {"status": "partial-fail", "keys": lost}
        return result

    def update_data(data: dict, *args: Any, **kwargs: Any) -> Any:
        dropped = transfer.drop_unresolved(data)
        if dropped:
            _refuse(registry, worker.address, ANY, buffer, tokens, dropped)
            logger.warning(
                "dask-shm: %d handle(s) could not be resolved (%s); not stored",
                len(dropped),
                ", ".join(map(repr, list(dropped)[:3])),
            )
        return original(data, *args, **kwargs)

    worker.update_data = update_data  # type: ignore[method-assign]
    worker.handlers["gather"] = gather
    return original_gather


def _refuse(
    registry: PeerRegistry,
    address: str,
    sender: str,
    buffer: SharedSpillBuffer,
    tokens: dict[int, str],
    dropped: dict,
) -> None:
    """Count the ``dropped`` handles and ask ``sender`` for bytes for their
    roots. Never raises: it runs where distributed expects an event back
    (a fetch left without one waits forever)."""
    buffer.shm_counters["unresolved_handles"] += len(dropped)
    try:
        for token in {tokens.get(_tier_named(buffer, u.path)) for u in dropped.values()}:
            if token is not None:
                registry.refuse(address, sender, token)
    except Exception as e:  # a handle's path is the peer's word, not ours
        logger.warning("dask-shm: could not ask %s for bytes: %r", sender, e)


def _tier_named(buffer: SharedSpillBuffer, path: str) -> int:
    """The number of the tier whose root a handle's ``path`` claims to be under."""
    files = buffer.store.tiers
    return files.tiers[files.index_named(path)].number


def _exception_of(event: GatherDepFailureEvent) -> BaseException | None:
    """The exception of a failed fetch (pickled in the event), if it loads."""
    if not event.exception_text.startswith(transfer.PeerReadError.__name__):
        return None  # not ours: not worth unpickling
    try:
        exc = pickle.loads(event.exception.data)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def _fail_waiting_tasks(
    worker: Worker,
    peer: str,
    to_gather: Collection[Key],
    exc: transfer.PeerReadError,
    event: GatherDepFailureEvent,
) -> GatherDepSuccessEvent:
    """``peer`` cannot read back the key(s) ``exc`` names (all of the
    request's if it names none of them): fail this worker's tasks waiting
    for them with SpillFileError and take every key of the request as
    missing on ``peer``."""
    text = str(exc)
    broken = [k for k in to_gather if repr(k) in text] or list(to_gather)
    error = error_message(SpillFileError(text))
    stimulus_id = f"shm-unreadable-dependency-{time()}"
    for key in broken:
        ts = worker.state.tasks.get(key)
        if ts is None:
            continue
        for dependent in ts.dependents:
            if dependent.state != "waiting":
                continue
            logger.warning(
                "dask-shm: task %r fails: its dependency %r cannot be read on %s: %s",
                dependent.key,
                key,
                peer,
                exc,
            )
            msg = TaskErredMsg(
                key=dependent.key,
                run_id=dependent.run_id,
                exception=error["exception"],
                traceback=event.traceback,
                exception_text=error["exception_text"],
                traceback_text=event.traceback_text,
                thread=None,
                startstops=[],
                stimulus_id=stimulus_id,
            )
            worker.batched_send(msg.to_dict())
    return GatherDepSuccessEvent(
        worker=peer,
        total_nbytes=event.total_nbytes,
        data={},
        stimulus_id=event.stimulus_id,
    )
