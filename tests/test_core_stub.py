"""``python/dask_shm/_core.pyi`` matches the compiled ``dask_shm._core``.

mypy's stubtest imports the extension the tests run against and compares every
name, signature and class in the stub with it; a Rust change that adds,
renames or re-signs something without updating the stub fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dask_shm

#: Entries for Python 3.11 only: stubtest fails on an allowlist entry it does
#: not need, and 3.12 gives the classes the attribute the entries excuse.
ALLOWLIST = Path(__file__).with_name("core_stub_allowlist.txt")
#: follow_imports = skip: the stub's own imports are all that stubtest needs
MYPY_CONFIG = Path(__file__).with_name("core_stub_mypy.ini")


# stubtest analyses the stub without a cache: past the suite's default
# per-test timeout on a loaded machine.
@pytest.mark.timeout(900)
def test_stub_matches_compiled_module() -> None:
    package_root = Path(dask_shm.__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(package_root), env.get("PYTHONPATH", "")) if p
    )
    allowlist = ["--allowlist", str(ALLOWLIST)] if sys.version_info < (3, 12) else []
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "dask_shm._core",
            *allowlist,
            "--mypy-config-file",
            str(MYPY_CONFIG),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=840,
    )
    assert result.returncode == 0, result.stdout + result.stderr
