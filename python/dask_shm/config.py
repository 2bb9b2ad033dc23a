"""dask-shm's dask config namespace ``shm``: shipped defaults and validation."""

from __future__ import annotations

import os

import dask.config
import yaml

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "dask-shm.yaml")
SWITCHES = ("spill-buffer", "amm", "spans")


def _read_defaults() -> dict:
    with open(_DEFAULTS_FILE) as f:
        return yaml.safe_load(f)


DEFAULTS: dict = _read_defaults()


def load_defaults() -> None:
    """Register the shipped defaults with dask's config (idempotent); values
    the user already set take precedence."""
    dask.config.update_defaults(DEFAULTS)


def enabled(switch: str) -> bool:
    """Value of the boolean ``shm.<switch>``.

    Raises ValueError naming the key and the accepted values when it is not a
    boolean (strings such as "yes" from environment variables are refused rather
    than guessed at).
    """
    if switch not in SWITCHES:
        raise KeyError(f"unknown dask-shm switch {switch!r}; known: {', '.join(SWITCHES)}")
    # The shipped default also covers configs that were reset after import
    # (e.g. by test harnesses) and so lost the registered defaults.
    value = dask.config.get(f"shm.{switch}", default=DEFAULTS["shm"][switch])
    if not isinstance(value, bool):
        raise ValueError(f"config shm.{switch} must be true or false; got {value!r}")
    return value
