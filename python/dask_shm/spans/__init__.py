"""Spans with per-span memory accounting: drop-ins for ``distributed.spans``.

- :class:`SpansSchedulerExtension`, :class:`SpansWorkerExtension`, :class:`Span`:
  behave like stock's, with O(1) ``Span.done`` / ``states`` / ``nbytes_total`` and
  the memory each span holds on the cluster (:attr:`Span.held`, :class:`SpanMemory`)
  and the spilling it caused (:attr:`Span.spill_metrics`);
- :func:`install_scheduler_extension`, :func:`install_worker_extension`: put them in
  a running scheduler / worker; :class:`SpansSchedulerPlugin`,
  :class:`SpansWorkerPlugin` and the preload (``--preload dask_shm.spans`` on
  ``dask scheduler`` / ``dask worker``, :func:`dask_setup`) do it for you;
- :func:`span_memory`: per-span memory and spilling as a pandas DataFrame, from a
  client;
- :func:`span`: the stock context manager, re-exported.
"""

from __future__ import annotations

from distributed.spans import span

from dask_shm.spans.client import span_memory
from dask_shm.spans.plugins import SpansSchedulerPlugin, SpansWorkerPlugin, dask_setup
from dask_shm.spans.scheduler import SpansSchedulerExtension, install_scheduler_extension
from dask_shm.spans.span import Span, SpanMemory
from dask_shm.spans.worker import SpansWorkerExtension, install_worker_extension

__all__ = [
    "Span",
    "SpanMemory",
    "SpansSchedulerExtension",
    "SpansSchedulerPlugin",
    "SpansWorkerExtension",
    "SpansWorkerPlugin",
    "dask_setup",
    "install_scheduler_extension",
    "install_worker_extension",
    "span",
    "span_memory",
]
