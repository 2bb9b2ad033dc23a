"""Putting our Active Memory Manager in place of the stock one on a scheduler."""

from __future__ import annotations

from typing import Any

import distributed.active_memory_manager as stock
import distributed.scheduler as scheduler_module

from dask_shm.amm.extension import ActiveMemoryManagerExtension


def install_scheduler_extension(scheduler: Any) -> ActiveMemoryManagerExtension:
    """Make ``scheduler.extensions["amm"]`` one of ours and return it.

    If the scheduler already has ours, it is returned unchanged. Otherwise the current
    manager (normally the stock one) is stopped and replaced by ours with the same
    measure, interval, registered policies (so a retirement in progress carries on)
    and running state; without a current manager, ours is configured from
    ``distributed.scheduler.active-memory-manager.*``. ``amm_handler`` then points at
    ours, so ``client.amm.*`` drive it.

    ``Scheduler.retire_workers`` uses ``scheduler.extensions["amm"]`` when it is
    running; when it is not, stock builds a temporary manager. We route that
    construction to our class for schedulers whose ``"amm"`` extension is ours (other
    schedulers in the process keep getting the stock class).

    Raises whatever our constructor raises for bad configuration (ValueError naming
    the ``measure`` key and its accepted values).
    """
    current = scheduler.extensions.get("amm")
    if isinstance(current, ActiveMemoryManagerExtension):
        return current
    _route_ad_hoc_managers()
    if current is None:
        ours = ActiveMemoryManagerExtension(scheduler)
    else:
        was_running = bool(current.running)
        current.stop()
        ours = ActiveMemoryManagerExtension(
            scheduler,
            policies=set(current.policies),
            measure=current.measure,
            start=False,
            interval=current.interval,
        )
        if was_running:
            ours.start()
    scheduler.extensions["amm"] = ours
    return ours


def _ad_hoc_manager(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Build the temporary manager ``retire_workers`` asks for: ours if the
    scheduler's installed manager is ours, else stock's."""
    if isinstance(scheduler.extensions.get("amm"), ActiveMemoryManagerExtension):
        return ActiveMemoryManagerExtension(scheduler, *args, **kwargs)
    return stock.ActiveMemoryManagerExtension(scheduler, *args, **kwargs)


def _route_ad_hoc_managers() -> None:
    # ``Scheduler.retire_workers`` looks the class up as a module global at call time.
    # Only that call site uses the name (DEFAULT_EXTENSIONS captured the class at
    # import), so replacing the global with a dispatching factory is transparent.
    setattr(scheduler_module, "ActiveMemoryManagerExtension", _ad_hoc_manager)  # noqa: B010
