"""dask-shm's dask config namespace ``shm``: shipped defaults and validation."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import dask.config
import yaml
from dask.utils import parse_bytes

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


def spill_recycle_bytes() -> int:
    """``shm.spill-recycle-bytes`` in bytes.

    Raises ValueError naming the key and the accepted values.
    """
    raw = dask.config.get("shm.spill-recycle-bytes", default=DEFAULTS["shm"]["spill-recycle-bytes"])
    try:
        if isinstance(raw, bool):
            raise TypeError
        value = parse_bytes(raw)
        if value < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(
            "config shm.spill-recycle-bytes must be a byte size such as '256 MiB' or 0 "
            f"(no recycling); got {raw!r}"
        ) from None
    return int(value)


@dataclass(frozen=True)
class SharedMemorySettings:
    """Validated ``shm.shared-memory.*`` config."""

    enabled: bool
    #: Directory on a tmpfs under which each user gets ``dask-shm-<uid>/``.
    root: str
    #: Values whose spill file is smaller than this stay private.
    min_size: int
    #: Values whose payload is less than this fraction of out-of-band buffers
    #: (i.e. mostly pickled Python objects) stay private.
    min_shared_fraction: float
    #: Tier-2 budget per worker: None (auto), bytes (int) or a fraction of the
    #: worker's memory limit (float in (0, 1]); see shared/limits.py.
    max_bytes: int | float | None = None
    #: Directory on a real file system for tier-3 files (``dask-shm-<uid>/``
    #: is made under it).
    disk_root: str = ""

    @classmethod
    def from_config(cls) -> SharedMemorySettings:
        """Read and validate the current config.

        Raises ValueError naming the key and the accepted values.
        """
        defaults = DEFAULTS["shm"]["shared-memory"]

        def get(name: str) -> object:
            return dask.config.get(f"shm.shared-memory.{name}", default=defaults[name])

        enabled = get("enabled")
        if not isinstance(enabled, bool):
            raise ValueError(
                f"config shm.shared-memory.enabled must be true or false; got {enabled!r}"
            )
        root = get("root")
        if not isinstance(root, str) or not os.path.isabs(root):
            raise ValueError(
                "config shm.shared-memory.root must be an absolute path to a directory "
                f"on a tmpfs such as /dev/shm; got {root!r}"
            )
        raw_min_size = get("min-size")
        try:
            if isinstance(raw_min_size, bool):
                raise TypeError
            min_size = parse_bytes(raw_min_size)  # type: ignore[arg-type]
            if min_size < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(
                "config shm.shared-memory.min-size must be a byte size such as '64 KiB' "
                f"or a number of bytes >= 0; got {raw_min_size!r}"
            ) from None
        fraction = get("min-shared-fraction")
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not 0 <= fraction <= 1
        ):
            raise ValueError(
                "config shm.shared-memory.min-shared-fraction must be a number between "
                f"0 and 1; got {fraction!r}"
            )
        raw_max = get("max-bytes")
        max_bytes: int | float | None
        if raw_max is None or raw_max == "auto":
            max_bytes = None
        elif isinstance(raw_max, float) and 0 < raw_max <= 1:
            max_bytes = raw_max
        else:
            try:
                if isinstance(raw_max, (bool, float)):
                    raise TypeError
                max_bytes = int(parse_bytes(raw_max))  # type: ignore[arg-type]
                if max_bytes < 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise ValueError(
                    "config shm.shared-memory.max-bytes must be 'auto', a byte size such "
                    "as '2 GiB' (0: everything spills to disk), or a fraction of the "
                    f"worker's memory limit in (0, 1] such as 0.3; got {raw_max!r}"
                ) from None
        disk_root = get("disk-root")
        if disk_root is None:
            base = dask.config.get("temporary-directory", default=None) or tempfile.gettempdir()
            disk_root = os.path.join(base, "dask-scratch-space")
        if not isinstance(disk_root, str) or not os.path.isabs(disk_root):
            raise ValueError(
                "config shm.shared-memory.disk-root must be null (dask's temporary "
                "directory) or an absolute path on a real file system; "
                f"got {disk_root!r}"
            )
        return cls(enabled, root, int(min_size), float(fraction), max_bytes, disk_root)
