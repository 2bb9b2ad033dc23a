"""dask-shm as the dask CLI, dask's config and distributed see it: `dask shm ...`,
`dask config get shm`, the schema of our keys, the import-time hook check."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import dask.config
import pytest
import yaml
from clusters import process_cluster
from p2p_workload import shared_config

from dask_shm import compat
from dask_shm.config import (
    DEFAULTS,
    SCHEMA,
    SharedMemorySettings,
    accepted,
    enabled,
    spill_recycle_bytes,
    unknown_keys,
)


def dask_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `dask` command of this environment (python -m dask is its script's body)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DASK_SHM__")}
    return subprocess.run(
        [sys.executable, "-m", "dask", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {}), "PAGER": "cat"},
    )


# --- dask's CLI ---------------------------------------------------------------------


def test_dask_shm_is_a_dask_subcommand():
    proc = dask_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "shm" in proc.stdout.split("Commands:")[1]
    proc = dask_cli("shm", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: ") and "dask shm [OPTIONS]" in proc.stdout
    assert "info" in proc.stdout and "demo" in proc.stdout
    assert "warn" not in proc.stderr.lower(), proc.stderr


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_dask_shm_info_runs_through_dask():
    proc = dask_cli("shm", "info", "--root", "/dev/shm")
    assert proc.returncode == 0, proc.stderr
    assert "Shared-memory root" in proc.stdout and "path:" in proc.stdout


def test_dask_shm_demo_options_through_dask():
    proc = dask_cli("shm", "demo", "--size", "10TB")
    assert proc.returncode == 2
    assert proc.stderr.startswith("Usage: ") and "dask shm demo [OPTIONS]" in proc.stderr
    assert "these sizes do not fit on this host" in proc.stderr


def test_dask_config_sees_our_defaults():
    proc = dask_cli("config", "get", "shm")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == DEFAULTS["shm"]
    proc = dask_cli("config", "get", "shm.shared-memory.root")
    assert proc.returncode == 0 and proc.stdout.strip() == "/dev/shm"
    proc = dask_cli("config", "list")
    assert proc.returncode == 0
    assert yaml.safe_load(proc.stdout)["shm"]["spill-recycle-bytes"] == "256 MiB"


def test_dask_config_shows_environment_overrides():
    # `dask config get` looks keys up verbatim, and dask keeps the environment
    # variable's spelling (shared_memory) of a key set before defaults load, as
    # it does for distributed's keys; Python's dask.config.get accepts both.
    env = {"DASK_SHM__SHARED_MEMORY__ENABLED": "True"}
    proc = dask_cli("config", "get", "shm.shared_memory.enabled", env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "True"
    proc = dask_cli("config", "get", "shm.shared_memory.root", env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "/dev/shm"  # default underneath


def test_dask_shm_script_is_an_alias():
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "dask-shm"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: dask-shm")
    assert "info" in proc.stdout and "demo" in proc.stdout


# --- schema ---------------------------------------------------------------------------


def _leaves(config: dict, schema: dict, prefix: str = "") -> list[tuple[str, object, dict]]:
    out = []
    for key, value in config.items():
        sub = schema["properties"][key]
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(_leaves(value, sub, name + "."))
        else:
            out.append((name, value, sub))
    return out


def _schema_keys(schema: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object":
            out |= _schema_keys(sub, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def test_schema_and_defaults_describe_the_same_keys():
    defaults = {name for name, _, _ in _leaves(DEFAULTS, SCHEMA)}
    assert defaults == _schema_keys(SCHEMA), (
        "dask-shm.yaml and dask-shm-schema.yaml are not in sync: add each new key "
        "to both (first description line: what values are accepted)"
    )
    for name, _, sub in _leaves(DEFAULTS, SCHEMA):
        assert sub.get("description", "").strip(), f"{name} has no description"


def test_defaults_validate_against_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(DEFAULTS, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"shm": {"shared-memory": {"min-shared-fraction": 2}}}, SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"shm": {"spill_buffer": True}}, SCHEMA)  # unknown key


@pytest.mark.parametrize(
    "key, value, check",
    [
        ("shm.amm", "yes", lambda: enabled("amm")),
        ("shm.spill-recycle-bytes", "lots", spill_recycle_bytes),
        ("shm.shared-memory.enabled", 1, SharedMemorySettings.from_config),
        ("shm.shared-memory.root", "relative/dir", SharedMemorySettings.from_config),
        ("shm.shared-memory.min-size", -1, SharedMemorySettings.from_config),
        ("shm.shared-memory.min-shared-fraction", 1.5, SharedMemorySettings.from_config),
    ],
)
def test_validation_messages_say_what_the_schema_accepts(key, value, check):
    with dask.config.set({key: value}), pytest.raises(ValueError) as info:
        check()
    assert str(info.value) == f"config {key} must be {accepted(key)}; got {value!r}"


def test_prometheus_retention_is_validated():
    from dask_shm.spans.prometheus import retention

    assert retention() == 300
    with dask.config.set({"shm.prometheus.span-retention": "2 minutes"}):
        assert retention() == 120
    with dask.config.set({"shm.prometheus.span-retention": "soon"}), pytest.raises(ValueError) as e:
        retention()
    assert "shm.prometheus.span-retention must be a duration" in str(e.value)


def test_unknown_keys_are_found_and_reported_by_info():
    from dask_shm.info import collect_info

    with dask.config.set({"shm.shared-memory.enable": True, "shm.shared_memory.min_size": 1}):
        assert unknown_keys() == ["shm.shared-memory.enable"]
        info = collect_info()
    [problem] = [p for p in info.problems if "shm.shared-memory.enable " in p.message]
    assert "is not a dask-shm setting" in problem.message


# --- distributed internals we hook -----------------------------------------------------


def test_no_hook_is_missing_in_the_supported_distributed():
    assert compat.missing_hooks() == []


def test_a_missing_hook_warns_at_import_naming_it(monkeypatch):
    gone = compat.Hook("distributed.worker.Worker.frobnicate", "something", lambda: False)
    monkeypatch.setattr(compat, "HOOKS", (*compat.HOOKS, gone))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.warn_if_hooks_missing() == [gone]
    [w] = caught
    assert issubclass(w.category, compat.DistributedCompatibilityWarning)
    assert "distributed.worker.Worker.frobnicate (used by something)" in str(w.message)

    from dask_shm.info import collect_info

    [problem] = [p for p in collect_info().problems if p.kind == "distributed-hooks"]
    assert "lacks distributed.worker.Worker.frobnicate" in problem.message


def test_a_hook_check_that_raises_counts_as_missing(monkeypatch):
    def broken() -> bool:
        raise AttributeError("moved")

    hook = compat.Hook("somewhere", "something", broken)
    monkeypatch.setattr(compat, "HOOKS", (hook,))
    assert compat.missing_hooks() == [hook]


def test_first_distributed_facing_use_warns_about_a_missing_hook():
    script = """
import warnings
import dask_shm, dask_shm.compat as compat
compat.HOOKS = (*compat.HOOKS, compat.Hook("distributed.gone", "a feature", lambda: False))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dask_shm.get  # the local scheduler needs no distributed internals
    assert caught == [], caught
    dask_shm.SpillBuffer
    dask_shm.worker_data  # warned once per process
names = [str(w.message) for w in caught if w.category is compat.DistributedCompatibilityWarning]
assert len(names) == 1 and "distributed.gone (used by a feature)" in names[0], names
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_importing_dask_shm_gives_no_compat_warning():
    code = "import dask_shm; dask_shm.SpillBuffer; dask_shm.dask_setup"
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_a_removed_scheduler_global_is_detected(monkeypatch):
    import distributed.scheduler

    monkeypatch.delattr(distributed.scheduler, "ActiveMemoryManagerExtension")
    [hook] = compat.missing_hooks()
    assert hook.where.startswith("distributed.scheduler.ActiveMemoryManagerExtension")


def test_a_removed_process_memory_hook_is_detected(monkeypatch):
    from distributed.system_monitor import SystemMonitor

    monkeypatch.delattr(SystemMonitor, "get_process_memory")
    [hook] = compat.missing_hooks()
    assert hook.where == "distributed.system_monitor.SystemMonitor.get_process_memory"


def test_first_use_checks_the_dashboard_hook_only_where_the_dashboard_runs():
    """The first-use check skips the dashboard's hook in a process that has
    not imported distributed's dashboard (checking would import bokeh), and
    checks it once the dashboard is imported; ``missing_hooks()`` checks it
    always."""
    script = """
import sys
import dask_shm.compat as compat
import distributed.dashboard.scheduler as dashboard
del sys.modules["distributed.dashboard.core"]
dashboard.template_variables = lambda *a, **k: {}  # the hook is gone
page = ["the dashboard's shared-memory page"]
assert compat.missing_hooks(in_use=True) == []
assert [h.used_by for h in compat.missing_hooks()] == page
import distributed.dashboard.core
assert [h.used_by for h in compat.missing_hooks(in_use=True)] == page
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def _imported_bokeh() -> bool:
    return any(name == "bokeh" or name.startswith("bokeh.") for name in sys.modules)


def test_a_shared_mode_worker_does_not_import_bokeh(shm_dir):
    """Workers serve no dashboard; dask-shm must not load one into each of
    them (bokeh and distributed's dashboard: ~18 MiB of every worker's
    memory, measured on the dev box)."""
    with process_cluster(1, "1 GiB", shared_config(shm_dir)) as client:
        kinds = client.run(lambda dask_worker: type(dask_worker.data).__name__)
        assert list(kinds.values()) == ["SharedSpillBuffer"]
        assert list(client.run(_imported_bokeh).values()) == [False]
