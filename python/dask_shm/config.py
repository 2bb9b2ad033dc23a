"""dask-shm's dask config namespace ``shm``: shipped defaults and validation.

The defaults are ``dask-shm.yaml``; ``dask-shm-schema.yaml`` describes every
key (JSON schema, in the style of distributed's ``distributed-schema.yaml``).
This module is the one place dask's config is read (``shm.*`` and the few
dask and distributed keys dask-shm follows, at the end): :func:`setting` checks a key's
value against the schema (``fastjsonschema``: types, ranges, choices), and the
typed parsers here (:func:`byte_size`, ...) turn what the schema lets through
into numbers, refusing what it cannot express (a string that is not a size).
Validation errors name the key and the value and say what is accepted in the
schema's words (the first line of the key's description)."""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import os
import stat
import string
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import dask.config
import fastjsonschema
import yaml
from dask.utils import parse_bytes, parse_timedelta

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "dask-shm.yaml")
SCHEMA_FILE = os.path.join(os.path.dirname(__file__), "dask-shm-schema.yaml")
SWITCHES = ("spill-buffer", "amm", "spans")


def _read_yaml(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


DEFAULTS: dict = _read_yaml(_DEFAULTS_FILE)
#: The JSON schema of the ``shm`` namespace (``dask-shm-schema.yaml``).
SCHEMA: dict = _read_yaml(SCHEMA_FILE)


def _schema_of(key: str) -> dict:
    node = SCHEMA
    for part in key.split("."):
        node = node["properties"][part]
    return node


def accepted(key: str) -> str:
    """What ``key`` (e.g. ``"shm.shared-memory.min-size"``) accepts, from the
    first line of its schema description. Raises KeyError for a key the
    schema does not describe."""
    return str(_schema_of(key)["description"]).strip().splitlines()[0]


@functools.cache
def _validator(key: str) -> Callable[[object], object]:
    # fastjsonschema rather than jsonschema: every worker, nanny and scheduler
    # validates its config, and jsonschema (with referencing and the bundled
    # metaschemas) cost each of them about 3 MiB of private memory and 0.1 s.
    return fastjsonschema.compile(_schema_of(key))


def shipped_default(key: str) -> object:
    """The value ``dask-shm.yaml`` gives ``key`` (e.g.
    ``"shm.shared-memory.born-threshold"``): the one place defaults live.
    Raises KeyError for a key it does not have."""
    node: object = DEFAULTS
    for part in key.split("."):
        node = node[part]  # type: ignore[index]
    return node


def setting(key: str) -> object:
    """The current value of ``key`` (e.g. ``"shm.shared-memory.root"``), the
    shipped default where unset (a config reset after import, as test
    harnesses do, has lost the registered defaults), checked against the
    key's schema.

    Raises ValueError naming the key and the value and saying what is
    accepted (:func:`invalid`); KeyError for a key the schema does not describe.
    """
    validate = _validator(key)
    _check_sections(key)
    value = dask.config.get(key, default=shipped_default(key))
    raw = _plain_number(value)
    try:
        validate(raw)
    except fastjsonschema.JsonSchemaException:
        raise invalid(key, value) from None
    return raw


def _check_sections(key: str) -> None:
    """ValueError if a section above ``key`` is set to something that is not
    a mapping (``DASK_SHM__SHARED_MEMORY=True``): dask would read every key
    under it as unset, and the shipped defaults would apply without a word."""
    parts = key.split(".")
    for end in range(1, len(parts)):
        section = ".".join(parts[:end])
        value = _scalar_sections.get(section, dask.config.get(section, default=None))
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config {section} must be a mapping of its keys; got {value!r}")


def _plain_number(value: object) -> object:
    """A real number of another type (``numpy.int64(3)``, ``Fraction(1, 2)``)
    as the int or float it holds, as a schema reads numbers; anything else as
    it is."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def invalid(key: str, value: object) -> ValueError:
    """The ValueError for a bad ``value`` of ``key``: names both and says
    what is accepted."""
    return ValueError(f"config {key} must be {accepted(key)}; got {value!r}")


def byte_size(value: object, name: str) -> int:
    """``value`` as a number of bytes >= 0, read as distributed reads sizes:
    an int (or a float with no fractional part) or a string that
    ``dask.utils.parse_bytes`` reads, such as ``"1GiB"`` or ``"64 KiB"``.

    Raises TypeError (any other type, bool included) or ValueError (a string
    that is not a size, a negative or fractional size), whose message names
    ``name`` and says what is accepted.
    """
    n: int | float
    if isinstance(value, str):
        try:
            n = _exact_bytes(value)
        except (ValueError, OverflowError):
            raise ValueError(
                f"{name} must be a byte size such as 1073741824 or '1GiB'; got {value!r}"
            ) from None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        n = float(value) if not isinstance(value, numbers.Integral) else int(value)
    else:
        raise TypeError(
            f"{name} must be a byte size (an int or a string such as '1GiB'); got {value!r}"
        )
    if not math.isfinite(n) or n < 0 or n != int(n):
        raise ValueError(f"{name} must be a whole number of bytes >= 0; got {value!r}")
    return int(n)


def _exact_bytes(text: str) -> float:
    """The size ``text`` states, read as ``dask.utils.parse_bytes`` splits it
    (a number, then a unit) but not rounded down to whole bytes, and with a
    number required: ``parse_bytes`` reads ``""`` as 1 byte, ``"KiB"`` as
    1024 and ``"0.3"`` as 0. ValueError if it is not a size."""
    compact = text.replace(" ", "")
    number = compact.rstrip(string.ascii_letters)
    unit = compact[len(number) :]
    if not any(c.isdigit() for c in number):
        raise ValueError(text)
    return float(number) * parse_bytes(f"1{unit}")


def spill_limit(value: object, name: str = "max_spill") -> int | Literal[False]:
    """A ``max_spill`` argument: False (no limit) or a :func:`byte_size`.
    Raises TypeError or ValueError naming ``name``."""
    if value is False:
        return False
    try:
        return byte_size(value, name)
    except TypeError:
        raise TypeError(
            f"{name} must be False or a byte size (an int or a string such as '10GiB'); "
            f"got {value!r}"
        ) from None


def fraction(value: object, name: str) -> float:
    """``value`` as a fraction in [0, 1]. Raises TypeError (not a number) or
    ValueError (out of range) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number between 0 and 1; got {value!r}")
    result = float(value)
    if not 0 <= result <= 1:  # NaN too
        raise ValueError(f"{name} must be between 0 and 1; got {value!r}")
    return result


def unknown_keys(config: object = None, prefix: str = "shm") -> list[str]:
    """Keys set under ``shm`` (default: the current dask config) that the
    schema does not know, e.g. a typo such as ``shm.shared-memory.enable``;
    dask treats ``_`` and ``-`` alike, so ``min_size`` is known."""
    if config is None:
        config = dask.config.get(prefix, default={})
    if not isinstance(config, dict):
        return []
    node = _schema_of(prefix).get("properties", {})
    out = []
    for key, value in config.items():
        name = str(key).replace("_", "-")
        if name not in node:
            out.append(f"{prefix}.{name}")
        elif node[name].get("type") == "object":
            out.extend(unknown_keys(value, f"{prefix}.{name}"))
    return out


def known_keys(node: dict | None = None, prefix: str = "shm") -> list[str]:
    """Every key the schema describes under ``prefix``, sections included
    (``shm.shared-memory``, ``shm.shared-memory.enabled``, ...)."""
    if node is None:
        node = _schema_of(prefix)
    out = []
    for name, sub in node.get("properties", {}).items():
        key = f"{prefix}.{name}"
        out.append(key)
        out.extend(known_keys(sub, key))
    return out


def closest_known_key(key: str) -> str | None:
    """The known key most like ``key`` (a typo's intended key), or None if
    none is close (difflib's ratio below 0.6)."""
    matches = difflib.get_close_matches(key.replace("_", "-"), known_keys(), n=1)
    return matches[0] if matches else None


#: Sections the user had set to something other than a mapping when the
#: defaults were registered (which replaces such a value by the defaults'
#: mapping): section -> the value, reported by :func:`setting`.
_scalar_sections: dict[str, object] = {}


def _find_scalar_sections(config: object, schema: dict, prefix: str) -> None:
    if not isinstance(config, dict):
        if config is not None:
            _scalar_sections[prefix] = config
        return
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object":
            value = config.get(name, config.get(name.replace("-", "_")))
            _find_scalar_sections(value, sub, f"{prefix}.{name}")


def load_defaults() -> None:
    """Register the shipped defaults with dask's config (idempotent); values
    the user already set take precedence."""
    _find_scalar_sections(dask.config.config.get("shm"), _schema_of("shm"), "shm")
    dask.config.update_defaults(DEFAULTS)


def enabled(switch: str) -> bool:
    """Value of the boolean ``shm.<switch>``.

    Raises ValueError naming the key and the accepted values when it is not a
    boolean (strings such as "yes" from environment variables are refused rather
    than guessed at).
    """
    if switch not in SWITCHES:
        raise KeyError(f"unknown dask-shm switch {switch!r}; known: {', '.join(SWITCHES)}")
    return bool(setting(f"shm.{switch}"))


def setting_bytes(key: str, minimum: int = 0) -> int:
    """:func:`setting` ``key`` as a :func:`byte_size` of at least ``minimum``
    (the schema checks the range of numbers only, this of strings too).

    Raises ValueError naming the key and the accepted values (:func:`invalid`).
    """
    raw = setting(key)
    try:
        n = byte_size(raw, key)
    except (TypeError, ValueError):
        raise invalid(key, raw) from None
    if n < minimum:
        raise invalid(key, raw)
    return n


def setting_duration(key: str) -> float:
    """:func:`setting` ``key`` in seconds >= 0: a number of seconds or a
    string that ``dask.utils.parse_timedelta`` reads, such as ``"5 minutes"``.

    Raises ValueError naming the key and the accepted values (:func:`invalid`).
    """
    raw = setting(key)
    try:
        if isinstance(raw, bool):
            raise TypeError
        seconds = parse_timedelta(cast("str | float", raw), default="seconds")
    except (TypeError, ValueError, KeyError, OverflowError):  # KeyError: an unknown unit
        raise invalid(key, raw) from None
    # a string such as "-1 s" or "1e400 s" (the schema checks numbers)
    if seconds is None or not 0 <= seconds < math.inf:
        raise invalid(key, raw)
    return float(seconds)


def setting_path(key: str, *, absolute: bool = True) -> str | None:
    """:func:`setting` ``key``: a non-empty path (``absolute``: an absolute
    one), or None where the schema allows null.

    Raises ValueError naming the key and the accepted values (:func:`invalid`).
    """
    raw = setting(key)
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw or (absolute and not os.path.isabs(raw)):
        raise invalid(key, raw)
    return raw


def temporary_directory() -> str:
    """dask's ``temporary-directory``, else the system's temporary directory."""
    return dask.config.get("temporary-directory", default=None) or tempfile.gettempdir()


def spill_recycle_bytes() -> int:
    """``shm.spill-recycle-bytes`` in bytes.

    Raises ValueError naming the key and the accepted values.
    """
    return setting_bytes("shm.spill-recycle-bytes")


def default_disk_root(temporary_directory: str) -> str:
    """Tier 3's root when ``shm.shared-memory.disk-root`` is null, chosen the
    way distributed chooses a server's scratch space (``WorkSpace``):
    ``<temporary_directory>/dask-scratch-space`` if this user can make its
    ``dask-shm-<uid>`` there (or has it already), else this user's own
    ``dask-scratch-space-<uid>`` next to it (made 0700 when first used). So
    every user of a host gets a tier 3, and the same one in every process."""
    shared = os.path.join(temporary_directory, "dask-scratch-space")
    if not hasattr(os, "geteuid"):
        return shared  # no shared-memory mode off POSIX: any answer will do
    uid = os.geteuid()
    try:
        mine = os.lstat(os.path.join(shared, f"dask-shm-{uid}"))
        if stat.S_ISDIR(mine.st_mode) and mine.st_uid == uid:
            return shared
    except OSError:
        pass
    if not os.path.lexists(shared) or os.access(shared, os.W_OK | os.X_OK):
        return shared
    return f"{shared}-{uid}"


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
    #: is made under it); null in config: :func:`default_disk_root`.
    disk_root: str = ""
    #: Values still in private memory go to a same-host peer as a file
    #: only from this size (smaller ones as bytes).
    transfer_min_size: int = 2**20
    #: Write fresh values of ``transfer_min_size`` or more to their file as
    #: soon as they are stored when their task prefix usually goes to a peer.
    write_ahead: bool = True

    @classmethod
    def from_config(cls) -> SharedMemorySettings:
        """Read and validate the current config.

        Raises ValueError naming the key and the accepted values.
        """

        def get(name: str) -> object:
            return setting(f"shm.shared-memory.{name}")

        enabled = bool(get("enabled"))
        root = setting_path("shm.shared-memory.root")
        if root is None:  # the schema allows only strings: never
            raise invalid("shm.shared-memory.root", root)
        min_size = setting_bytes("shm.shared-memory.min-size")
        min_shared_fraction = float(cast(float, get("min-shared-fraction")))
        raw_max = get("max-bytes")
        max_bytes: int | float | None
        if raw_max is None or raw_max == "auto":
            max_bytes = None
        elif isinstance(raw_max, float) and 0 < raw_max <= 1:
            max_bytes = raw_max  # the schema lets other numbers through only if whole
        else:
            max_bytes = setting_bytes("shm.shared-memory.max-bytes")
        disk_root = setting_path("shm.shared-memory.disk-root")
        if disk_root is None:
            disk_root = default_disk_root(temporary_directory())
        transfer_min_size = setting_bytes("shm.shared-memory.transfer-min-size")
        return cls(
            enabled,
            root,
            min_size,
            min_shared_fraction,
            max_bytes,
            disk_root,
            transfer_min_size,
            write_ahead=bool(get("write-ahead")),
        )


# -- dask's and distributed's own keys that dask-shm follows ------------------------


def configured(key: str, default: object = None) -> object:
    """The value set for ``key`` as it is, unvalidated (``dask shm info``
    reports a configuration even where it is invalid), else ``default``."""
    return dask.config.get(key, default=default)


def configured_namespace() -> dict:
    """``shm`` as set, over the shipped defaults (a config reset after import,
    as test harnesses do, drops the registered defaults but not their effect)."""
    return dask.config.merge(DEFAULTS["shm"], dask.config.get("shm", default={}))


def prometheus_namespace() -> str:
    """``distributed.dashboard.prometheus.namespace``, which prefixes every
    series name (dask's default "dask" where distributed's defaults are absent)."""
    return str(dask.config.get("distributed.dashboard.prometheus.namespace", default="dask"))


def prometheus_series_name(subsystem: str, name: str) -> str:
    """``<namespace>_shm_<subsystem>_<name>``, the name of every Prometheus
    series of ours: built as distributed's collectors build theirs (an empty
    namespace gives ``shm_<subsystem>_<name>``), under our own ``shm``
    prefix so that distributed's ``<namespace>_worker_*`` and
    ``<namespace>_scheduler_*`` families stay exactly stock's.
    prometheus_client appends the unit and ``_total``."""
    return "_".join(p for p in (prometheus_namespace(), "shm", subsystem, name) if p)


def worker_max_spill() -> int | Literal[False]:
    """``distributed.worker.memory.max-spill``: False or bytes.

    Raises ValueError naming the key and the accepted values.
    """
    key = "distributed.worker.memory.max-spill"
    raw = dask.config.get(key)
    try:
        return spill_limit(raw, key)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{key} must be False or a byte size such as '10 GiB'; got {raw!r}") from e


def worker_memory_fractions() -> tuple[float | Literal[False], float | Literal[False]]:
    """``distributed.worker.memory.target`` and ``.spill``: each False or a
    fraction of the memory limit (a number >= 0).

    Raises ValueError naming the key and the accepted values.
    """
    values = []
    for name in ("target", "spill"):
        value = dask.config.get(f"distributed.worker.memory.{name}")
        if value is not False and not (isinstance(value, (int, float)) and 0 <= value):
            raise ValueError(
                f"distributed.worker.memory.{name} must be False or a fraction "
                f"of the memory limit such as 0.6; got {value!r}"
            )
        values.append(value)
    return values[0], values[1]


def comm_offload_bytes() -> int | None:
    """``distributed.comm.offload``: the message size above which distributed
    serializes a message in its offload thread rather than on the event loop
    (None: it never does). An unreadable value counts as None, as that
    setting's own readers would fail first."""
    value = dask.config.get("distributed.comm.offload", default=False)
    if value is False or value is None:
        return None
    try:
        return int(parse_bytes(value)) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        return None


def spill_compression() -> str | None:
    """``distributed.worker.memory.spill-compression`` as distributed resolves
    it (``auto`` becomes the best codec installed here; None or False: none).

    Raises ValueError naming the key and the accepted values.
    """
    from distributed.protocol.compression import get_compression_settings

    return get_compression_settings("distributed.worker.memory.spill-compression")


def multiprocessing_defaults() -> dict[str, object]:
    """What ``dask.multiprocessing.get`` reads from dask's config when not
    given: ``chunksize`` (1), ``pool``, ``multiprocessing.initializer`` and
    ``num_workers`` (None where unset)."""
    return {
        "chunksize": dask.config.get("chunksize", 1),
        "pool": dask.config.get("pool", None),
        "initializer": dask.config.get("multiprocessing.initializer", None),
        "num_workers": dask.config.get("num_workers", None),
    }


def logging_config() -> dict:
    """Where distributed looks for its logging config: ``distributed.logging*``
    first, else the top level of dask's config."""
    config = dask.config.config
    keys = {"logging-file-config", "logging"}
    distributed = config.get("distributed", {})
    if isinstance(distributed, dict) and keys & distributed.keys():
        return distributed
    return config


def log_format(default: str) -> str:
    """``distributed.admin.log-format``, else ``default``."""
    return str(dask.config.get("distributed.admin.log-format", default=default))
