"""dask-shm's loggers shown like distributed's own.

``distributed.config.initialize_logging`` gives only the loggers named in the
``logging`` config (``distributed`` at INFO by default) a stderr handler with
``distributed.admin.log-format``; any other logger falls through to Python's
last-resort handler (WARNING and above, message only). :func:`initialize_logging`
gives the ``dask_shm`` logger the same treatment, at the level the config
gives ``distributed``, so that a worker's "shared-memory mode on ..." line
sits among distributed's lines, in their format, and is silenced when theirs
are (:class:`AsQuietAsDistributed`).

It follows distributed's "old-style" rules and nothing else: a config that
names ``dask_shm`` itself is left to distributed (which configures it when
imported, and would otherwise add a second handler); a ``logging`` config in
``logging.config`` form (``version: 1``) or a ``logging-file-config`` governs
every logger, ours included; and if the root logger already has handlers
(an application or pytest configured logging) only the level is set and
records propagate to them, as distributed's do.
"""

from __future__ import annotations

import logging
import sys

from dask_shm.config import log_format, logging_config

LOGGER_NAME = "dask_shm"
#: distributed.yaml's ``distributed.admin.log-format``, for a process that has
#: not imported distributed (whose defaults then are not in dask's config).
DEFAULT_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
_done = False


class AsQuietAsDistributed(logging.Filter):
    """Passes a record only at or above the level of the ``distributed``
    logger's own stream handlers. A cluster's ``silence_logs`` (LocalCluster's
    default: WARNING) raises those handlers' levels for its servers' lifetime
    (``distributed.utils.silence_logging_cmgr``) without touching any other
    logger: this makes our handler follow, so that a worker's "shared-memory
    mode on ..." is silenced wherever distributed's "Start worker at ..." is."""

    def filter(self, record: logging.LogRecord) -> bool:
        levels = [
            h.level
            for h in logging.getLogger("distributed").handlers
            if isinstance(h, logging.StreamHandler)
        ]
        return not levels or record.levelno >= max(levels)


def initialize_logging() -> None:
    """Configure the ``dask_shm`` logger as distributed configures its own
    (see the module docstring). Idempotent; never raises on a bad level (the
    logger is then left alone, as distributed fails on it itself)."""
    global _done
    if _done:
        return
    _done = True
    base = logging_config()
    levels = base.get("logging", {})
    if "logging-file-config" in base or not isinstance(levels, dict) or "version" in levels:
        return
    if any(name.replace("-", "_") == LOGGER_NAME for name in levels):
        return
    raw = levels.get("distributed", "info")
    level = logging.getLevelName(raw.upper()) if isinstance(raw, str) else raw
    if not isinstance(level, int):
        return
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(log_format(DEFAULT_FORMAT)))
    handler.addFilter(AsQuietAsDistributed())
    logger.addHandler(handler)
    logger.propagate = False
