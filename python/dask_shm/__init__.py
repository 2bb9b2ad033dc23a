"""dask-shm: Rust-accelerated spilling and shared memory for Dask workers.

Public API:

- :class:`SpillBuffer`: drop-in for ``distributed.spill.SpillBuffer``.
- :func:`worker_data`, :func:`spill_buffer_for_worker`, :class:`SpillBufferPlugin`:
  ways to give workers a :class:`SpillBuffer`.
- :class:`SharedMemoryPlugin`, :class:`SharedMemoryNannyPlugin`: shared-memory
  mode (tmpfs spill files, zero-copy unspill, same-host hard-link transfers).
- :class:`SpillFileError`: a spill file could not be read back.
- :func:`get`: dask's local scheduler on a process pool passing large buffers
  through shared-memory files (``dask.compute(x, scheduler=dask_shm.get)``).
- ``dask_shm.amm``, ``dask_shm.spans``: Active Memory Manager and span extensions.
- :func:`dask_setup`, :func:`dask_teardown`: make ``--preload dask_shm``
  install everything the ``shm.*`` config switches enable, and remove it when
  the server closes.

Importing the package loads only the Rust core and the ``shm`` config
defaults, and shows the ``dask_shm`` loggers the way distributed shows its
own (:mod:`dask_shm.logs`). Every other name is imported on first access (PEP 562 module
``__getattr__``), so that a process that needs one part, such as a pool
process of :func:`get` that needs only the transport, does not import
``distributed``, ``zict`` and every plugin. ``getattr(dask_shm, "dask_setup")``
(how distributed's preload finds the hooks) and ``from dask_shm import X``
work for every public name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dask_shm._core import FileStore, ForgedHandleError, SpillFileError
from dask_shm._core import __version__ as __version__
from dask_shm.config import load_defaults
from dask_shm.logs import initialize_logging

load_defaults()
initialize_logging()
# PyO3 names the extension's exceptions' module "_core", which nothing can
# import: they would print as ``_core.SpillFileError`` and, pickled (a task's
# error, a peer's reply), reach another process as a look-alike class that
# `except SpillFileError` does not catch. Both are attributes of this package.
for _exception in (SpillFileError, ForgedHandleError):
    _exception.__module__ = __name__

if TYPE_CHECKING:
    from distributed.spill import SpilledSize

    from dask_shm.local import get
    from dask_shm.preload import dask_setup, dask_teardown
    from dask_shm.shared import SharedMemoryNannyPlugin, SharedMemoryPlugin
    from dask_shm.spill import SpillBuffer
    from dask_shm.worker import SpillBufferPlugin, spill_buffer_for_worker, worker_data

__all__ = [
    "FileStore",
    "SharedMemoryNannyPlugin",
    "SharedMemoryPlugin",
    "SpillBuffer",
    "SpillBufferPlugin",
    "SpillFileError",
    "SpilledSize",
    "dask_setup",
    "dask_teardown",
    "get",
    "spill_buffer_for_worker",
    "worker_data",
]

#: Public name -> module defining it.
_LAZY = {
    "SharedMemoryNannyPlugin": "dask_shm.shared",
    "SharedMemoryPlugin": "dask_shm.shared",
    "SpillBuffer": "dask_shm.spill",
    "SpillBufferPlugin": "dask_shm.worker",
    "SpilledSize": "distributed.spill",
    "dask_setup": "dask_shm.preload",
    "dask_teardown": "dask_shm.preload",
    "get": "dask_shm.local",
    "spill_buffer_for_worker": "dask_shm.worker",
    "worker_data": "dask_shm.worker",
}
#: Subpackages reachable as attributes without importing them first.
_SUBPACKAGES = frozenset({"amm", "demo", "local", "shared", "spans"})
#: What works without distributed's internals (the local scheduler): the hook
#: check (which imports distributed) is not run for these.
_WITHOUT_DISTRIBUTED = frozenset({"get", "local"})
_hooks_checked = False


def _check_hooks_once() -> None:
    """Warn (DistributedCompatibilityWarning) once per process if a
    distributed internal that dask-shm hooks is missing: run when the first
    distributed-facing name is used, not at import, so that processes that
    need only the local scheduler's transport never import distributed."""
    global _hooks_checked
    if not _hooks_checked:
        _hooks_checked = True
        from dask_shm.compat import warn_if_hooks_missing

        warn_if_hooks_missing()


def __getattr__(name: str) -> Any:
    """Import a public name (or subpackage) on first access and cache it.

    Raises AttributeError for any other name, so ``getattr(dask_shm, name,
    default)`` and ``hasattr`` behave as for an eager module (distributed's
    preload looks up ``dask_teardown`` that way).
    """
    if (name in _SUBPACKAGES or name in _LAZY) and name not in _WITHOUT_DISTRIBUTED:
        _check_hooks_once()
    if name in _SUBPACKAGES:
        value: Any = importlib.import_module(f"{__name__}.{name}")
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBPACKAGES)
