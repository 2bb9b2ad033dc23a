"""The README's snippets run as printed, and what they need can be installed
with an extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client

from dask_shm.spans import span_memory

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_block(containing: str) -> str:
    """The one ```python block of the README that contains ``containing``."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)
    [block] = [b for b in blocks if containing in b]
    return block


def test_metrics_snippet_runs_on_a_shared_memory_cluster(shm_dir, tmp_path):
    code = python_block("shm_metrics")
    config = {
        "distributed.worker.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.root": shm_dir,
        "shm.shared-memory.disk-root": str(tmp_path),
    }
    with process_cluster(2, "1GiB", config) as client:
        x = client.submit(np.ones, 4 << 20, key="ones")
        assert client.submit(np.sum, x).result() == 4 << 20
        namespace: dict = {"client": client}
        exec(code, namespace)
        addresses = worker_addresses(client)
        now, beats = namespace["now"], namespace["beats"]
        assert sorted(now) == sorted(beats) == addresses
        for address in addresses:
            assert now[address]["tier2_budget"] > 0
            assert beats[address] is not None
            assert beats[address]["tier2_budget"] == now[address]["tier2_budget"]


def test_spans_example_runs_as_printed(tmp_path):
    script = tmp_path / "spans_example.py"
    script.write_text(python_block("span_memory(client)"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^etl\s", done.stdout, re.MULTILINE), done.stdout
    assert re.search(r"^etl / load\s", done.stdout, re.MULTILINE), done.stdout


def test_span_memory_without_pandas_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'dask-shm\[spans\]'"):
        span_memory(Client.__new__(Client))


def test_extras_declare_what_optional_features_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in extras[extra]}

    assert "pandas" in names("spans")
    assert "prometheus_client" in names("prometheus")
    assert "matplotlib" in names("demo")
    readme = README.read_text()
    for extra in ("spans", "prometheus"):
        assert f"pip install 'dask-shm[{extra}]'" in readme
