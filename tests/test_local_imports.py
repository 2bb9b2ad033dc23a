"""The lazy package face: ``import dask_shm`` loads only the Rust core and the
config defaults, every public name still works, and distributed still finds
the preload hooks of ``--preload dask_shm``.

Each check runs in a fresh interpreter, where nothing is imported yet.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

HEAVY = (
    "distributed",
    "zict",
    "dask_shm.spill",
    "dask_shm.shared",
    "dask_shm.amm",
    "dask_shm.spans",
    "dask_shm.worker",
    "dask_shm.preload",
    "dask_shm.local.scheduler",
)


def run_fresh(code: str) -> str:
    """stdout of ``code`` run by a new interpreter; fails the test if it fails."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_loads_no_heavy_module() -> None:
    out = run_fresh(
        f"""
        import sys
        import dask_shm
        import dask_shm.local.transport
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        print(dask_shm.__version__, dask_shm.FileStore.__name__, dask_shm.SpillFileError.__name__)
        """
    )
    loaded, names = out.splitlines()
    assert loaded == "[]"
    assert names.endswith("FileStore SpillFileError")


def test_every_public_name_resolves_to_its_defining_object() -> None:
    out = run_fresh(
        """
        import dask_shm
        from distributed.spill import SpilledSize
        from dask_shm.local.scheduler import get
        from dask_shm.preload import dask_setup, dask_teardown
        from dask_shm.shared import SharedMemoryNannyPlugin, SharedMemoryPlugin
        from dask_shm.spill import SpillBuffer
        from dask_shm.worker import SpillBufferPlugin, spill_buffer_for_worker, worker_data

        expected = dict(
            SpilledSize=SpilledSize, get=get, dask_setup=dask_setup,
            dask_teardown=dask_teardown,
            SharedMemoryNannyPlugin=SharedMemoryNannyPlugin,
            SharedMemoryPlugin=SharedMemoryPlugin, SpillBuffer=SpillBuffer,
            SpillBufferPlugin=SpillBufferPlugin,
            spill_buffer_for_worker=spill_buffer_for_worker, worker_data=worker_data,
        )
        for name, obj in expected.items():
            assert getattr(dask_shm, name) is obj, name
        assert set(dask_shm.__all__) == set(expected) | {"FileStore", "SpillFileError"}
        assert set(dask_shm.__all__) <= set(dir(dask_shm))
        assert dask_shm.amm.__name__ == "dask_shm.amm"
        assert dask_shm.spans.__name__ == "dask_shm.spans"
        ns = {}
        exec("from dask_shm import *", ns)
        assert set(dask_shm.__all__) <= set(ns)
        assert not hasattr(dask_shm, "no_such_name")
        try:
            dask_shm.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("no AttributeError")
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_lazy_names_work_first_touch_in_worker_data() -> None:
    out = run_fresh(
        """
        import tempfile
        import dask_shm
        buf = dask_shm.SpillBuffer(tempfile.mkdtemp(), target=10)
        buf["x"] = b"a" * 100  # above target: spilled
        assert buf["x"] == b"a" * 100
        data = dask_shm.worker_data("1 GiB")
        print(type(buf).__name__, callable(data) or isinstance(data, tuple))
        """
    )
    assert out.split() == ["SpillBuffer", "True"]


def test_preload_hooks_are_found_by_distributed() -> None:
    """``--preload dask_shm`` on a real scheduler, in a process that has not
    imported any of dask_shm's plugins: distributed looks ``dask_setup`` up
    with getattr, which must reach the lazily imported hook."""
    out = run_fresh(
        """
        import asyncio, sys
        import dask
        from distributed import Scheduler

        async def main():
            assert "dask_shm" not in sys.modules
            with dask.config.set({"distributed.scheduler.preload": ["dask_shm"]}):
                async with Scheduler(dashboard_address=":0", port=0) as s:
                    print(type(s.extensions["amm"]).__module__)
                    print("dask_shm.preload" in sys.modules)

        asyncio.run(main())
        """
    )
    module, preloaded = out.split()
    assert module.startswith("dask_shm.amm")
    assert preloaded == "True"
