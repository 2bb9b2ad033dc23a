"""dask-shm's log lines show by default, among distributed's and in their format."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import dask
import distributed  # noqa: F401  (its config defaults: distributed.admin.log-format)
import pytest

# A newcomer's cluster: shared-memory mode from config (environment), nothing
# about logging configured.
SCRIPT = """
from distributed import Client, LocalCluster

if __name__ == "__main__":
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster, Client(cluster) as client:
        client.run(lambda: None)
"""

TIMESTAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def run_cluster(env: dict[str, str]) -> str:
    """Start and close the cluster of SCRIPT in a fresh interpreter; its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")} | env
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


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
    # The format is distributed's (LocalCluster silences its workers' own INFO
    # lines, so compare with what its handler makes of a record).
    formatter = logging.Formatter(dask.config.get("distributed.admin.log-format"))
    record = logging.makeLogRecord(
        {"name": "distributed.worker", "levelname": "INFO", "msg": "Start worker at"}
    )
    assert re.fullmatch(
        rf"{TIMESTAMP} - distributed\.worker - INFO - Start worker at", formatter.format(record)
    )


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
