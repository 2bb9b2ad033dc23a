"""An invalid ``shm.*`` value stops a LocalCluster from starting, at once and
naming the key, the value and what is accepted: whichever server preloads
dask_shm, with worker processes or without. Registering a shared-memory
plugin on a running cluster fails the same way.

Each cluster runs in a process of its own (``bad_config_cluster.py``) under a
timeout: before the fix a bad value made LocalCluster() hang (a SystemExit
raised by the preload took the cluster's event loop down), which would hang
the test run instead of failing a test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: Seconds a cluster of one worker may take to fail to start (it takes a few
#: on an idle host; a hang is what this catches).
STARTUP_LIMIT = 120

BAD_ENABLED = {"DASK_SHM__SHARED_MEMORY__ENABLED": "yes"}
BAD_MAX_BYTES = {
    "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
    "DASK_SHM__SHARED_MEMORY__MAX_BYTES": "1.5",
}
ENABLED_MESSAGE = "config shm.shared-memory.enabled must be true or false; got 'yes'"
MAX_BYTES_MESSAGE = (
    "config shm.shared-memory.max-bytes must be 'auto', a byte size such as '2 GiB' "
    "(0: everything spills to disk), or a fraction of the worker's memory limit in "
    "(0, 1] such as 0.3; got 1.5"
)


def run_cluster(env: dict[str, str], **options: object) -> dict:
    """``bad_config_cluster.py`` with ``env`` added to the environment; its
    JSON result, with its stderr as ``"stderr"``. Fails the test if it does
    not finish within STARTUP_LIMIT (its process group is killed, worker
    processes included)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "bad_config_cluster.py"), json.dumps(options)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=STARTUP_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"LocalCluster did not finish in {STARTUP_LIMIT} s; stderr:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return {**json.loads(out.strip().splitlines()[-1]), "stderr": err}


@pytest.mark.parametrize("processes", [True, False], ids=["processes", "threads"])
@pytest.mark.parametrize("server", ["worker", "scheduler"])
def test_bad_value_stops_a_local_cluster_preloading_dask_shm(server: str, processes: bool) -> None:
    env = {
        f"DASK_DISTRIBUTED__{server.upper()}__PRELOAD": '["dask_shm"]',
        **(BAD_ENABLED if server == "worker" else {"DASK_SHM__AMM": "maybe"}),
    }
    result = run_cluster(env, processes=processes)
    assert not result["started"]
    assert result["errors"][0].startswith("RuntimeError")
    message = ENABLED_MESSAGE if server == "worker" else "config shm.amm must be true or false"
    assert any(e.startswith("InvalidConfig") and message in e for e in result["errors"]), result


def test_bad_value_stops_a_local_cluster_whose_nannies_preload_dask_shm() -> None:
    result = run_cluster(
        {"DASK_DISTRIBUTED__NANNY__PRELOAD": '["dask_shm"]', **BAD_MAX_BYTES}, processes=True
    )
    assert not result["started"]
    assert result["errors"][:1] == ["RuntimeError: Nanny failed to start."]
    cause = f"InvalidConfig: dask-shm: invalid configuration: {MAX_BYTES_MESSAGE}"
    assert result["errors"][1:] == [cause]


@pytest.mark.parametrize("processes", [True, False], ids=["processes", "threads"])
def test_bad_value_in_nanny_and_worker_preload_config(processes: bool) -> None:
    """As the issue's reporter configured it: both preloads."""
    env = {
        "DASK_DISTRIBUTED__NANNY__PRELOAD": '["dask_shm"]',
        "DASK_DISTRIBUTED__WORKER__PRELOAD": '["dask_shm"]',
        **BAD_MAX_BYTES,
    }
    result = run_cluster(env, processes=processes)
    assert not result["started"]
    assert any(MAX_BYTES_MESSAGE in e for e in result["errors"]), result


@pytest.mark.parametrize(
    "plugin, processes",
    [("worker", True), ("worker", False), ("nanny", True)],
    ids=["worker-processes", "worker-threads", "nanny"],
)
def test_registering_a_plugin_under_a_bad_value_raises_naming_it(
    plugin: str, processes: bool
) -> None:
    result = run_cluster(BAD_MAX_BYTES, processes=processes, register=plugin)
    assert result["started"] and not result["registered"]
    assert result["errors"] == [f"ValueError: {MAX_BYTES_MESSAGE}"]
    # a plugin whose setup failed on the config does not fail again on close
    assert "failed to teardown" not in result["stderr"]
