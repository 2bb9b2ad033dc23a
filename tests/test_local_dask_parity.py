"""dask's own tests of its local schedulers, run on :func:`dask_shm.get` and on
``scheduler="processes"``: every test ends the same way on both.

``dask_shm.get`` claims to be the processes scheduler with another transport
and a warm pool. dask ships the tests that pin that scheduler down
(``dask/tests/test_multiprocessing.py``, ``test_local.py`` with its
``GetFunctionTestMixin``, the contract any ``get`` is held to, and
``test_callbacks.py``). They run here unchanged in two pytest processes, with
the :mod:`scheduler_rebind` plugin binding every local scheduler to one
``get``: ``dask.multiprocessing.get`` (the reference) and ``dask_shm.get``.
A test of the in-process schedulers that cannot hold for a process pool
(a task appending to a list of the caller's) fails on both, which is parity.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

DASK_TEST_MODULES = (
    "dask.tests.test_multiprocessing",
    "dask.tests.test_local",
    "dask.tests.test_callbacks",
)

Outcome = tuple[str, str]  # ("passed" | "failed" | "error" | "skipped", exception type)


def outcomes(report: Path) -> dict[str, Outcome]:
    """Each test case of a junit report: how it ended and, if it raised, with
    which exception type (the part of pytest's message before the colon)."""
    cases: dict[str, Outcome] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        ended = ("passed", "")
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                message = element.get("message") or ""
                raised = re.match(r"([\w.]+(?:Error|Exception|Interrupt|Exit)\b)", message)
                ended = (kind, raised.group(1) if raised else "")
                break
        cases[name] = ended
    return cases


def run_dask_tests(scheduler: str, tmp_path: Path) -> dict[str, Outcome]:
    """dask's scheduler tests in a fresh interpreter, every local scheduler
    bound to ``scheduler`` (see :mod:`scheduler_rebind`)."""
    workdir = tmp_path / scheduler
    workdir.mkdir()
    (workdir / "pytest.ini").write_text("[pytest]\n")  # not our pyproject's options
    report = workdir / "report.xml"
    tests_dir = str(Path(__file__).parent)
    env = {
        **os.environ,
        "DASK_SHM_REBIND": scheduler,
        "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "scheduler_rebind",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={report}",
            "--pyargs",
            *DASK_TEST_MODULES,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    # 0: all passed, 1: some failed; anything else is a broken run.
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return outcomes(report)


@pytest.mark.timeout(600)
def test_dask_scheduler_tests_end_as_on_the_processes_scheduler(tmp_path: Path) -> None:
    stock = run_dask_tests("processes", tmp_path)
    ours = run_dask_tests("dask_shm", tmp_path)

    assert ours.keys() == stock.keys()
    differing = {name: (stock[name], ours[name]) for name in stock if stock[name] != ours[name]}
    assert not differing, differing
    # Not vacuous: nearly all of them run and pass.
    passed = [name for name, (ended, _) in ours.items() if ended == "passed"]
    assert len(ours) >= 50 and len(passed) >= 0.8 * len(ours), ours
    assert any("GetFunctionTestMixin" in name or "TestGetAsync" in name for name in passed)
