"""dask-shm's log lines show where distributed's do, among them and in their format."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# A newcomer's cluster: shared-memory mode from config (environment), nothing
# about logging configured but LocalCluster's ``silence_logs`` (its default,
# WARNING, hides its servers' INFO lines; False shows them).
SCRIPT = """
import logging
from distributed import Client, LocalCluster

if __name__ == "__main__":
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
        silence_logs={silence_logs},
    ) as cluster, Client(cluster) as client:
        client.run(lambda: None)
"""

# distributed's test_client.py::client_script: the cluster is closed by the
# interpreter's exit, after the loop's default executor has shut down.
SCRIPT_LEFT_OPEN = """
from distributed import Client

if __name__ == "__main__":
    client = Client(processes=True, n_workers=1, scheduler_port=0, dashboard_address=":0")
"""

TIMESTAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def run_cluster(env: dict[str, str], silence_logs: str = "False", script: str = SCRIPT) -> str:
    """Start and close the cluster of ``script`` in a fresh interpreter; its
    stderr (stdout too: distributed's test reads both)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")} | env
    done = subprocess.run(
        [sys.executable, "-c", script.format(silence_logs=silence_logs)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_shared_mode_worker_logs_one_info_line_like_distributed(shm_dir, tmp_path):
    stderr = run_cluster(
        {
            "DASK_DISTRIBUTED__WORKER__PRELOAD": '["dask_shm"]',
            "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
            "DASK_SHM__SHARED_MEMORY__ROOT": shm_dir,
            "DASK_SHM__SHARED_MEMORY__DISK_ROOT": str(tmp_path),
        }
    )
    ours = re.findall(r"^.* - dask_shm[\w.]* - INFO - .*$", stderr, re.MULTILINE)
    assert len(ours) == 1, stderr
    line = ours[0]
    pattern = (
        rf"{TIMESTAMP} - dask_shm\.shared\.plugin - INFO - dask-shm: shared-memory mode on "
        rf"tcp://127\.0\.0\.1:\d+: root {re.escape(shm_dir)}, budget [\d.]+ [KMGT]?i?B \(.+\); "
        rf"tier 2 {re.escape(shm_dir)}/dask-shm-\d+/\S+, tier 3 {re.escape(str(tmp_path))}/\S+; "
        r"arrays (born shared off: .+|of \d+ bytes or more born shared \(.+\))"
    )
    assert re.fullmatch(pattern, line), line
    # Beside distributed's own INFO lines, in their format.
    assert re.search(rf"^{TIMESTAMP} - distributed\.worker - INFO - ", stderr, re.MULTILINE), stderr


@pytest.mark.parametrize("script", [SCRIPT, SCRIPT_LEFT_OPEN], ids=["closed", "left-open"])
def test_a_silenced_cluster_prints_nothing_of_ours(shm_dir, tmp_path, script):
    # LocalCluster's default silence_logs=WARNING hides distributed's INFO
    # lines, and ours with them; a nanny's teardown at the interpreter's exit
    # logs no error. distributed's test_client.py::test_quiet_close_process
    # asserts that such a cluster prints nothing.
    stderr = run_cluster(
        {
            "DASK_DISTRIBUTED__WORKER__PRELOAD": '["dask_shm"]',
            "DASK_DISTRIBUTED__NANNY__PRELOAD": '["dask_shm"]',
            "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
            "DASK_SHM__SHARED_MEMORY__ROOT": shm_dir,
            "DASK_SHM__SHARED_MEMORY__DISK_ROOT": str(tmp_path),
        },
        silence_logs="logging.WARNING",
        script=script,
    )
    assert stderr.strip() == "", stderr


@pytest.mark.parametrize(
    "env",
    [
        {"DASK_LOGGING__DISTRIBUTED": "warning"},  # ours follow distributed's level
        {"DASK_LOGGING__DASK_SHM": "warning"},  # or their own, when named
    ],
)
def test_info_lines_follow_the_configured_level(shm_dir, tmp_path, env):
    stderr = run_cluster(
        {
            "DASK_DISTRIBUTED__WORKER__PRELOAD": '["dask_shm"]',
            "DASK_SHM__SHARED_MEMORY__ENABLED": "True",
            "DASK_SHM__SHARED_MEMORY__ROOT": shm_dir,
            "DASK_SHM__SHARED_MEMORY__DISK_ROOT": str(tmp_path),
            **env,
        }
    )
    assert "shared-memory mode on" not in stderr
