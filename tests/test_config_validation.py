"""``shm.*`` values are checked against dask-shm-schema.yaml where they are
read, and refused with a message naming the key, the value and what the
schema accepts; unknown keys get the closest known key."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import dask
import numpy as np
import pytest

from dask_shm.config import (
    SCHEMA,
    SharedMemorySettings,
    accepted,
    closest_known_key,
    enabled,
    known_keys,
    setting,
    spill_recycle_bytes,
)
from dask_shm.shared.born_worker import BornSettings
from dask_shm.spans.prometheus import retention

shared = SharedMemorySettings.from_config
#: every key that holds a value (sections such as ``shm.shared-memory`` left out)
LEAF_KEYS = [k for k in known_keys() if not any(o.startswith(k + ".") for o in known_keys())]


@pytest.mark.parametrize(
    "key, value, read",
    [
        ("shm.spans", "yes", lambda: enabled("spans")),
        ("shm.spill-recycle-bytes", -5, spill_recycle_bytes),
        ("shm.spill-recycle-bytes", 1.5, spill_recycle_bytes),
        ("shm.shared-memory.enabled", "yes", shared),
        ("shm.shared-memory.root", 5, shared),
        ("shm.shared-memory.min-size", "-1 MiB", shared),
        ("shm.shared-memory.transfer-min-size", "small", shared),
        ("shm.shared-memory.write-ahead", "sometimes", shared),
        ("shm.shared-memory.min-shared-fraction", "half", shared),
        ("shm.shared-memory.max-bytes", 1.5, shared),
        ("shm.shared-memory.max-bytes", -1, shared),
        ("shm.shared-memory.max-bytes", True, shared),
        ("shm.shared-memory.max-bytes", "lots", shared),
        ("shm.shared-memory.disk-root", ["/tmp"], shared),
        ("shm.shared-memory.born-shared", "maybe", BornSettings.from_config),
        ("shm.shared-memory.born-threshold", 0, BornSettings.from_config),
        ("shm.shared-memory.born-threshold", "0 B", BornSettings.from_config),
        ("shm.shared-memory.born-budget", -1, BornSettings.from_config),
        ("shm.prometheus.span-retention", -1, retention),
        ("shm.prometheus.span-retention", "-1 s", retention),
        # what dask's parse_bytes reads as 1 byte, 1024 bytes and 0 bytes,
        # or fails on with OverflowError
        ("shm.shared-memory.max-bytes", "", shared),
        ("shm.shared-memory.min-size", "KiB", shared),
        ("shm.shared-memory.max-bytes", "0.3", shared),
        ("shm.shared-memory.min-size", "1e400KiB", shared),
        ("shm.shared-memory.born-budget", "1.5 B", BornSettings.from_config),
        ("shm.prometheus.span-retention", "1e400 s", retention),
    ],
)
def test_bad_values_are_refused_naming_key_value_and_what_is_accepted(
    key: str, value: object, read: Callable[[], object]
) -> None:
    with dask.config.set({key: value}), pytest.raises(ValueError) as info:
        read()
    assert str(info.value) == f"config {key} must be {accepted(key)}; got {value!r}"


def test_a_section_set_to_a_value_is_refused_naming_it() -> None:
    # dask reads every key under such a section as unset: the shipped
    # defaults applied without a word (DASK_SHM__SHARED_MEMORY=True).
    with dask.config.set({"shm.shared-memory": True}), pytest.raises(ValueError) as info:
        shared()
    assert str(info.value) == "config shm.shared-memory must be a mapping of its keys; got True"


def test_a_section_set_to_a_value_by_environment_is_refused_naming_it() -> None:
    # Set before dask-shm is imported, the value is replaced by the
    # defaults' mapping when they are registered; it is remembered.
    import subprocess
    import sys

    code = (
        "from dask_shm.config import SharedMemorySettings\n"
        "try:\n    SharedMemorySettings.from_config()\n"
        "except ValueError as e:\n    print(e)\n"
    )
    env = {"DASK_SHM__SHARED_MEMORY": "True", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "config shm.shared-memory must be a mapping of its keys; got True"


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("shm.shared-memory.max-bytes", None, None),  # as 'auto'
        ("shm.shared-memory.max-bytes", 1.0, 1.0),  # a fraction
        ("shm.shared-memory.max-bytes", 1, 1),  # a byte
        ("shm.shared-memory.max-bytes", "1 KiB", 1024),
        ("shm.shared-memory.min-size", "1 KiB", 1024),
        ("shm.shared-memory.transfer-min-size", "256 KiB", 256 * 1024),
        ("shm.shared-memory.min-shared-fraction", 1, 1.0),
        ("shm.shared-memory.write-ahead", False, False),
    ],
)
def test_good_values_are_read(key: str, value: object, expected: object) -> None:
    with dask.config.set({key: value}):
        assert getattr(shared(), key.rsplit(".", 1)[1].replace("-", "_")) == expected


def test_every_shipped_default_passes_its_schema() -> None:
    assert len(LEAF_KEYS) == 24
    for key in LEAF_KEYS:
        setting(key)


def test_setting_refuses_what_jsonschema_refuses_and_nothing_else() -> None:
    """The validator (fastjsonschema, light enough for every worker) gives the
    reference implementation's verdict on every key for values of every type;
    real numbers of other types (numpy's, Fraction) are read as the int or
    float they hold."""
    jsonschema = pytest.importorskip("jsonschema")
    values = [True, False, None, 0, 1, -1, 2, 0.5, 1.0, 2.0, -0.5, 1e30, 10**20]
    values += [float("nan"), float("inf"), -float("inf"), "", "1 GiB", "auto", "1s", "x"]
    values += [[], [1], {}, {"a": 1}, b"x", (1,), object(), 1j]
    values += [np.int64(3), np.int64(-1), np.float64(0.5), np.bool_(True), Fraction(1, 2)]
    checked = 0
    for key in LEAF_KEYS:
        node = SCHEMA
        for part in key.split("."):
            node = node["properties"][part]
        reference = jsonschema.Draft202012Validator(node)
        for value in values + list(node.get("enum", [])):
            with dask.config.set({key: value}):
                try:
                    setting(key)
                    refused = False
                except ValueError:
                    refused = True
            plain = float(value) if isinstance(value, (np.floating, Fraction)) else value
            plain = int(plain) if isinstance(plain, np.integer) else plain
            # JSON has no complex numbers; jsonschema calls 1j a number.
            valid = not isinstance(plain, complex) and reference.is_valid(plain)
            assert refused == (not valid), (key, value)
            checked += 1
    assert checked > 500


def test_born_shared_accepts_its_three_values() -> None:
    for mode in (True, False, "auto"):
        with dask.config.set({"shm.shared-memory.born-shared": mode}):
            assert BornSettings.from_config().mode == mode


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("shm.shared-memory.enable", "shm.shared-memory.enabled"),
        ("shm.shared_memory.min_sise", "shm.shared-memory.min-size"),
        ("shm.shared-mem", "shm.shared-memory"),
        ("shm.spill-bufer", "shm.spill-buffer"),
        ("shm.zzz", None),
    ],
)
def test_closest_known_key(typo: str, meant: str | None) -> None:
    assert closest_known_key(typo) == meant
