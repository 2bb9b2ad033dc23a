"""distributed's messages packed with a small starting buffer in shared mode.

``msgpack.dumps`` starts every call with a 256 KiB buffer. glibc serves that
from the heap when a free chunk fits, else by ``mmap``; in a worker the nanny
sets ``MALLOC_TRIM_THRESHOLD_``, which keeps the mmap threshold at 128 KiB and
the heap's top trimmed. A stock worker holds its values in the heap, and the
holes they leave take these buffers. In shared mode values live in files, the
heap stays small, and each message distributed packs (a task's
``task-finished``, each ``get_data`` request and reply) costs an ``mmap``, a
page fault and a ``munmap``, slower still while other threads map files: at
30,000 keys on the dev box, ``packb`` took 10x the CPU it took in stock.

:func:`install` hands distributed's protocol modules a copy of ``msgpack``
whose ``dumps``/``packb`` start at 4 KiB (growing as needed): the same bytes,
no quarter-MiB mapping per message. Process-wide and idempotent.
"""

from __future__ import annotations

import importlib
import types

import msgpack

from dask_shm.spill_store import pack_small_first

#: distributed's modules that pack messages with ``msgpack.dumps``.
PROTOCOL_MODULES = ("distributed.protocol.core", "distributed.protocol.serialize")


def protocol_modules() -> list[types.ModuleType]:
    """The modules of :data:`PROTOCOL_MODULES` (imported by name: the
    package attribute ``distributed.protocol.serialize`` is the function of
    that name, not the module)."""
    return [importlib.import_module(name) for name in PROTOCOL_MODULES]


def _small_buffer_msgpack() -> types.ModuleType:
    module = types.ModuleType(msgpack.__name__, msgpack.__doc__)
    module.__dict__.update(
        {k: v for k, v in vars(msgpack).items() if k not in ("__name__", "__doc__")}
    )
    module.packb = pack_small_first  # type: ignore[attr-defined]
    module.dumps = pack_small_first  # type: ignore[attr-defined]
    return module


SMALL_BUFFER_MSGPACK = _small_buffer_msgpack()


def install() -> None:
    """Point distributed's protocol modules at :data:`SMALL_BUFFER_MSGPACK`
    (a module without a ``msgpack`` global is left alone: compat reports it)."""
    for module in protocol_modules():
        if getattr(module, "msgpack", None) is msgpack:
            module.msgpack = SMALL_BUFFER_MSGPACK  # type: ignore[attr-defined]


def installed() -> bool:
    """Whether every protocol module packs with the small buffer."""
    return all(
        getattr(module, "msgpack", None) is SMALL_BUFFER_MSGPACK for module in protocol_modules()
    )
