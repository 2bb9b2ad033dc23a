"""dask_shm.local.get: parity with dask's synchronous scheduler, errors as with
dask's schedulers, and no shared-memory file left behind whatever happens.

Real process pools (spawn), real files under /dev/shm. Most tests share one
pool passed as ``pool=`` (the path for user-supplied pools); the tests about
failures and interruptions let ``get`` create and tear down its own pool.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import psutil
import pytest
from dask.callbacks import Callback
from dask.multiprocessing import get_context

from dask_shm._core import MappedRange
from dask_shm.local import get, shutdown_pool
from dask_shm.local.directory import ShmDirectory

pytestmark = pytest.mark.timeout(120)

BIG = 200_000  # float64 elements: 1.6 MB, far above the 64 KiB threshold


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPoolExecutor]:
    with ProcessPoolExecutor(2, mp_context=get_context()) as executor:
        yield executor


@pytest.fixture(scope="module", autouse=True)
def no_warm_pool_left() -> Iterator[None]:
    """The warm pool tests here create is shut down when the module is done."""
    yield
    shutdown_pool()


# --- task functions (module level: the pool imports them by reference) ------


def big_array(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(BIG)


def mapped_path(x: object) -> str | None:
    """Path of the shared-memory file ``x``'s memory is mapped from, if any."""
    base = x
    while base is not None:
        if isinstance(base, MappedRange):
            return base.mapping.path
        if isinstance(base, memoryview):
            base = base.obj
        else:
            base = getattr(base, "base", None)
    return None


def describe(x: np.ndarray) -> tuple[str | None, int, bool]:
    return mapped_path(x), os.getpid(), bool(x.flags.writeable)


def increment_in_place(x: np.ndarray) -> np.ndarray:
    x += 1
    return x


def identity(x: object) -> object:
    return x


def first_half(x: np.ndarray) -> np.ndarray:
    return x[: len(x) // 2]


def total(*xs: np.ndarray) -> float:
    return float(sum(x.sum() for x in xs))


def fail_with_value_error(x: object) -> None:
    raise ValueError(f"bad input of type {type(x).__name__}")


def fail_with_pid(x: object) -> None:
    raise RuntimeError(f"failed in pid {os.getpid()}")


def sleep_then_return(x: object, seconds: float) -> object:
    time.sleep(seconds)
    return x


def kill_own_process(x: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# --- parity with the synchronous scheduler ---------------------------------


def test_array_workloads_match_sync(pool: ProcessPoolExecutor, shm_base: Path) -> None:
    x = da.random.RandomState(42).random((1200, 900), chunks=(300, 300))
    i = da.arange(1200 * 900, chunks=300 * 300).reshape((1200, 900)).rechunk((300, 300))
    exprs = {
        "elementwise+reduction": (da.sin(x) * 2 + 1).sum(axis=0),
        "all-to-all": (x[:900, :900] + x[:900, :900].T).mean(axis=1),
        "rechunk": x.rechunk((1200, 100)).rechunk((100, 900)) * 3,
        "matmul": x[:600] @ x[:600].T,
        "non-contiguous views": x[:, ::3] + x.T[::3, :].T,
        "integers": (i % 7).astype("int16").cumsum(axis=1),
        "masking": x[x > 0.5],
        "argmax": x.argmax(axis=1),
    }
    expected = dask.compute(exprs, scheduler="sync")[0]
    actual = dask.compute(exprs, scheduler=get, pool=pool)[0]
    assert actual.keys() == expected.keys()
    for name in exprs:
        if name == "matmul":
            # BLAS blocks a product by its thread count and the operands'
            # alignment, so the last bits differ between processes; the rest
            # of the graph is bit-for-bit.
            np.testing.assert_allclose(actual[name], expected[name], rtol=1e-13, err_msg=name)
        else:
            np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)
        assert actual[name].dtype == expected[name].dtype, name


def test_dataframe_workloads_match_sync(pool: ProcessPoolExecutor, shm_base: Path) -> None:
    rng = np.random.default_rng(0)
    n = 40_000
    pdf = pd.DataFrame(
        {
            "k": rng.integers(0, 50, n),
            "v": rng.random(n),
            "s": pd.array([f"name-{j % 97}" for j in range(n)], dtype="string[pyarrow]"),
            "o": np.array([f"obj-{j % 13}" for j in range(n)], dtype=object),
        }
    )
    ddf = dd.from_pandas(pdf, npartitions=4)
    other = dd.from_pandas(pdf[["k"]].drop_duplicates().assign(w=lambda d: d.k * 10), 2)
    exprs = {
        "groupby": ddf.groupby("k").v.agg(["sum", "mean", "count"]),
        "string groupby": ddf.groupby("s").v.sum(),
        "merge": ddf.merge(other, on="k").w.sum(),
        "assign+filter": ddf.assign(z=ddf.v * 2)[ddf.o == "obj-3"],
        "value_counts": ddf.o.value_counts(),
    }
    expected = dask.compute(exprs, scheduler="sync")[0]
    actual = dask.compute(exprs, scheduler=get, pool=pool)[0]
    for name in exprs:
        a, e = actual[name], expected[name]
        if isinstance(e, pd.DataFrame | pd.Series):
            if isinstance(e, pd.DataFrame):
                pd.testing.assert_frame_equal(a.sort_index(), e.sort_index(), obj=name)
            else:
                pd.testing.assert_series_equal(a.sort_index(), e.sort_index(), obj=name)
        else:
            assert a == e, name


def test_plain_graph_matches_sync(pool: ProcessPoolExecutor, shm_base: Path) -> None:
    dsk = {
        ("a", 0): (big_array, 0),
        ("a", 1): (big_array, 1),
        "small": (sum, [1, 2, 3]),
        "blob": (bytes, 300_000),
        "bytearray": (bytearray, b"\x07" * 200_000),
        "pair": (tuple, [[("a", 0), ("a", 1)]]),
        "half": (first_half, ("a", 0)),
        "same": (identity, ("a", 1)),
        "dict": (dict, [["x", ("a", 0)], ["n", "small"]]),
        "sum": (total, ("a", 0), ("a", 1), "half"),
    }
    keys = [["sum", ("a", 1)], "blob", "bytearray", "pair", "dict", "same", "small"]
    expected = dask.get(dsk, keys)
    actual = get(dsk, keys, pool=pool)
    (e_sum, e_a1), e_blob, e_ba, e_pair, e_dict, e_same, e_small = expected
    (a_sum, a_a1), a_blob, a_ba, a_pair, a_dict, a_same, a_small = actual
    # numpy's SIMD sum peels differently for differently aligned data: the
    # last bit of a float sum depends on where the allocator put the array.
    assert a_sum == pytest.approx(e_sum, rel=1e-14)
    np.testing.assert_array_equal(a_a1, e_a1)
    assert a_blob == e_blob and type(a_blob) is bytes
    assert a_ba == e_ba and type(a_ba) is bytearray
    assert all(np.array_equal(p, q) for p, q in zip(a_pair, e_pair, strict=True))
    assert a_dict.keys() == e_dict.keys() and a_dict["n"] == e_dict["n"] == 6
    np.testing.assert_array_equal(a_dict["x"], e_dict["x"])
    np.testing.assert_array_equal(a_same, e_same)
    assert a_small == e_small


def test_results_are_ordinary_writable_objects(pool: ProcessPoolExecutor, shm_base: Path) -> None:
    x = da.ones((400, 400), chunks=(200, 400)) * 2
    with dask.config.set(scheduler=get, pool=pool):  # the config route, pool included
        (result,) = dask.compute(x)
    assert type(result) is np.ndarray and result.flags.writeable
    result[0, 0] = 5  # private mapping: the write stays here
    assert result.sum() == 2 * 400 * 400 + 3
    assert os.listdir(shm_base) == []  # the files are gone; the mapping remains


# --- the transport: written once, mapped by readers ------------------------


def test_big_buffers_are_written_once_and_mapped_by_readers(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    dsk = {
        "x": (big_array, 3),
        "r1": (describe, "x"),
        "r2": (describe, "x"),
        "r3": (describe, "x"),
        "small": (np.arange, 10),
        "r_small": (describe, "small"),
    }
    results = get(dsk, ["r1", "r2", "r3", "r_small"], pool=pool, optimize_graph=False)
    paths = {path for path, _, _ in results[:3]}
    assert len(paths) == 1, paths  # every reader mapped the very file "x" was written to
    (path,) = paths
    assert path is not None and path.startswith(str(shm_base))
    assert all(writeable for _, _, writeable in results[:3])
    assert {pid for _, pid, _ in results} <= {p.pid for p in pool._processes.values()}
    assert results[3][0] is None  # small objects go through the pipe


def test_in_place_writes_by_a_task_stay_in_its_process(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    """A task that mutates its input and returns it sends the new values; the
    other readers of the same input still see the original (as with stock
    processes, where every task gets its own copy)."""
    dsk = {
        "x": (big_array, 4),
        "bumped": (increment_in_place, "x"),
        "same": (identity, "x"),
        "half": (first_half, "x"),
    }
    original = big_array(4)
    x, bumped, same, half = get(
        dsk, ["x", "bumped", "same", "half"], pool=pool, optimize_graph=False
    )
    np.testing.assert_array_equal(x, original)
    np.testing.assert_array_equal(bumped, original + 1)
    np.testing.assert_array_equal(same, original)
    np.testing.assert_array_equal(half, original[: BIG // 2])
    # Unmodified outputs that are inputs or views of them are not written
    # again: they come back as references to the file "x" was written to.
    assert mapped_path(same) == mapped_path(half) == mapped_path(x) is not None
    assert mapped_path(bumped) not in (None, mapped_path(x))


def test_threshold_decides_what_goes_through_files(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    dsk = {"x": (big_array, 11), "r": (describe, "x")}
    path, _, _ = get(dsk, "r", pool=pool, optimize_graph=False, shm_threshold="4 MiB")
    assert path is None  # 1.6 MB is below 4 MiB: pickled through the pipe
    with dask.config.set({"shm.local.shm-threshold": 1_000_000}):
        path, _, _ = get(dsk, "r", pool=pool, optimize_graph=False)
    assert path is not None


def _run_chain(pool: Executor, shm_base: Path) -> tuple[list[int], set[int]]:
    """A chain of 30 big intermediates, each written by a pool process: the
    number of files after each task, and every file (inode) ever seen."""
    dsk: dict[object, object] = {("c", 0): (big_array, 0)}
    for i in range(1, 30):
        dsk[("c", i)] = (increment_in_place, ("c", i - 1))
    seen: list[int] = []
    inodes: set[int] = set()

    def count_files(key: object, result: object, dsk: object, state: object, wid: object) -> None:
        files = [p for p in shm_base.rglob("*") if p.is_file()]
        seen.append(len(files))
        inodes.update(p.stat().st_ino for p in files)

    with Callback(posttask=count_files):
        result = get(dsk, ("c", 29), pool=pool, optimize_graph=False)
    expected = big_array(0)
    for _ in range(29):
        expected += 1
    np.testing.assert_array_equal(result, expected)
    assert len(seen) == 30
    return seen, inodes


def test_files_are_released_during_the_computation(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    """A file lives as long as its data is needed, not until the end: along a
    chain of 30 big intermediates, only a few files ever exist at once."""
    with dask.config.set({"shm.local.recycle-bytes": 0}):
        seen, inodes = _run_chain(pool, shm_base)
    assert max(seen) <= 3, seen
    assert len(inodes) >= 30, "without reuse, every result is a new file"


def test_freed_files_are_overwritten_by_later_results(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    """With reuse (the default), the pool processes overwrite files of
    intermediates nobody needs any more instead of creating new ones, and the
    files kept for that stay within shm.local.recycle-bytes."""
    with dask.config.set({"shm.local.recycle-bytes": "4 MB"}):  # two 1.6 MB results
        seen, inodes = _run_chain(pool, shm_base)
    assert len(inodes) <= 12, f"{len(inodes)} files for 30 results"
    # live results, plus per process at most what 4 MB holds, plus the inputs
    # each process still maps
    assert max(seen) <= 3 + 3 * 2 + 2, seen


class _InFlight(Callback):
    """Counts the tasks the parent has sent and not yet seen finish."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.most = 0

    def _pretask(self, key: object, dsk: object, state: object) -> None:
        self.now += 1
        self.most = max(self.most, self.now)

    def _posttask(self, *args: object) -> None:
        self.now -= 1


@pytest.mark.parametrize(("queued", "expected"), [(None, 4), (0, 2), (2, 6)])
def test_tasks_are_queued_ahead_for_each_pool_process(
    pool: ProcessPoolExecutor, shm_base: Path, queued: int | None, expected: int
) -> None:
    """With 2 pool processes, 2 x (1 + queued) tasks are in flight at most
    (default 1 queued per process; 0 is stock's one per process), and the
    results are those of the sync scheduler."""
    dsk = {("t", i): (sleep_then_return, i, 0.2) for i in range(10)}
    counter = _InFlight()
    with counter:
        result = get(dsk, list(dsk), pool=pool, queued_tasks=queued)
    assert result == tuple(range(10))
    assert counter.most == expected


def test_a_thread_pool_in_the_parent_keeps_results_intact(shm_base: Path) -> None:
    """With a user's thread pool, tasks run in the parent itself: files handed
    out for reuse come back to the parent's list, and results stay right."""
    with ThreadPoolExecutor(2) as threads:
        seen, _ = _run_chain(threads, shm_base)
    assert max(seen) <= 3 + 2, seen


#: Arrays a task kept beyond its end (a cache in user code), per pool process.
_KEPT: list[np.ndarray] = []


def keep_forever(x: np.ndarray) -> float:
    _KEPT.append(x)
    return float(x.sum())


def sums_of_kept(*_: object) -> list[float]:
    return [float(x.sum()) for x in _KEPT]


def test_a_file_still_mapped_by_a_task_s_leftovers_is_never_overwritten(
    shm_base: Path,
) -> None:
    """Reuse never overwrites a file that a pool process still maps, even when
    the parent is done with it: arrays kept by user code keep their values."""
    n = 12
    dsk: dict[object, object] = {("x", i): (big_array, 100 + i) for i in range(n)}
    dsk.update({("s", i): (keep_forever, ("x", i)) for i in range(n)})
    # fresh results after every input has been released, reusing their files
    dsk.update({("y", i): (increment_in_place, (big_array, 200 + i)) for i in range(n)})
    dsk["check"] = (sums_of_kept, [("s", i) for i in range(n)], [("y", i) for i in range(n)])
    sums = get(dsk, "check", num_workers=1, optimize_graph=False, warm=False)
    assert sorted(sums) == sorted(float(big_array(100 + i).sum()) for i in range(n))


def limit_file_size() -> None:
    """Pool initializer: no file this process writes may exceed 64 KiB."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_results_fall_back_to_the_pipe_when_files_cannot_be_written(shm_base: Path) -> None:
    dsk = {"x": (big_array, 12), "y": (first_half, "x"), "z": (total, "x", "y")}
    x, z = get(dsk, ["x", "z"], num_workers=2, initializer=limit_file_size)
    np.testing.assert_array_equal(x, big_array(12))
    assert z == total(big_array(12), big_array(12)[: BIG // 2])
    assert mapped_path(x) is None  # came through the pipe


# --- errors ------------------------------------------------------------------


def test_task_errors_surface_as_with_the_sync_scheduler(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    dsk = {"x": (big_array, 5), "y": (fail_with_value_error, "x"), "z": (total, "y")}
    with pytest.raises(ValueError) as sync_info:
        dask.get(dsk, "z")
    with pytest.raises(ValueError) as ours_info:
        get(dsk, "z", pool=pool)
    assert type(ours_info.value) is type(sync_info.value)
    assert str(ours_info.value) == str(sync_info.value) == "bad input of type ndarray"
    frames = [f.name for f in traceback.extract_tb(ours_info.value.__traceback__)]
    assert "fail_with_value_error" in frames  # the remote traceback is kept


def test_rerun_exceptions_locally_raises_in_the_caller(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    dsk = {"x": (big_array, 6), "y": (fail_with_pid, "x")}
    with pytest.raises(RuntimeError) as remote:
        get(dsk, "y", pool=pool)
    assert str(remote.value) != f"failed in pid {os.getpid()}"
    with pytest.raises(RuntimeError, match=f"failed in pid {os.getpid()}$"):
        get(dsk, "y", pool=pool, rerun_exceptions_locally=True)
    with dask.config.set(rerun_exceptions_locally=True):
        with pytest.raises(RuntimeError, match=f"failed in pid {os.getpid()}$"):
            get(dsk, "y", pool=pool)


def test_bad_arguments_and_config_are_named(shm_base: Path) -> None:
    dsk = {"x": 1}
    with pytest.raises(TypeError, match="func_dumps"):
        get(dsk, "x", func_dumps=repr)
    with pytest.raises(ValueError, match=r"shm_threshold must be a positive number of bytes"):
        get(dsk, "x", shm_threshold=-1)
    with dask.config.set({"shm.local.shm-threshold": "lots"}):
        with pytest.raises(ValueError, match=r"shm\.local\.shm-threshold .*'lots'"):
            get(dsk, "x")
    with dask.config.set({"shm.local.memory-target": 1.5}):
        with pytest.raises(ValueError, match=r"shm\.local\.memory-target .*fraction"):
            get(dsk, "x")
    with dask.config.set({"shm.local.recycle-bytes": "-1 MiB"}):
        with pytest.raises(ValueError, match=r"shm\.local\.recycle-bytes .*'-1 MiB'"):
            get(dsk, "x")
    for bad in (-1, "two", True, 1.5):
        with dask.config.set({"shm.local.queued-tasks": bad}):
            with pytest.raises(ValueError, match=r"shm\.local\.queued-tasks must be an integer"):
                get(dsk, "x")
    with pytest.raises(ValueError, match=r"queued_tasks must be an integer >= 0; got -1"):
        get(dsk, "x", queued_tasks=-1)


def test_fallback_when_dev_shm_is_unusable(
    pool: ProcessPoolExecutor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import tempfile

    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp_without_dev_shm(prefix: str, dir: str) -> str:
        if dir == "/dev/shm":
            raise PermissionError(13, "Permission denied", dir)
        return real_mkdtemp(prefix=prefix, dir=dir)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_without_dev_shm)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    with pytest.warns(RuntimeWarning, match="/dev/shm is not usable"):
        result = get({"x": (big_array, 7), "y": (first_half, "x")}, "y", pool=pool)
    np.testing.assert_array_equal(result, big_array(7)[: BIG // 2])
    assert list(tmp_path.iterdir()) == []


# --- cleanup on failure, killed process, interruption -------------------------


def test_files_removed_and_pool_stopped_after_a_task_error(shm_base: Path) -> None:
    dsk = {
        "x": (big_array, 8),
        "slow": (sleep_then_return, "x", 0.5),
        "bad": (fail_with_value_error, "x"),
        "both": (total, "slow", "bad"),
    }
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="bad input"):
        get(dsk, "both", num_workers=2)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_files_removed_when_a_pool_process_is_killed(shm_base: Path) -> None:
    dsk = {
        "x": (big_array, 9),
        "y": (big_array, 10),
        "die": (kill_own_process, "x"),
        "z": (total, "die", "y"),
    }
    with pytest.raises(BrokenProcessPool):
        get(dsk, "z", num_workers=2)


@pytest.mark.parametrize("whom", ["parent", "process group"])
def test_files_removed_on_keyboard_interrupt(shm_base: Path, tmp_path: Path, whom: str) -> None:
    """SIGINT to the computing process only, or to its whole process group as
    Ctrl-C in a terminal does (then the pool processes are interrupted too)."""
    marker = tmp_path / "running"
    script = textwrap.dedent(
        f"""
        import pathlib, signal, time
        import dask, numpy as np
        from dask_shm.local import get, shutdown_pool

        def big(seed):
            return np.random.default_rng(seed).random(500_000)

        def wait_forever(a, b, marker):
            pathlib.Path(marker).write_text("1")
            time.sleep(600)

        if __name__ == "__main__":
            # As in a terminal. Started in the background by a non-interactive
            # shell (`.ci/run &`), this process would inherit SIGINT ignored,
            # and Python then raises no KeyboardInterrupt.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            dsk = {{"a": (big, 1), "b": (big, 2), "w": (wait_forever, "a", "b", {str(marker)!r})}}
            with dask.config.set({{"shm.local.shm-directory": {str(shm_base)!r}}}):
                try:
                    get(dsk, "w", num_workers=2)
                except KeyboardInterrupt:
                    print("interrupted", flush=True)
                    raise
        """
    )
    path = tmp_path / "interrupt_me.py"
    path.write_text(script)
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the task never started"
            time.sleep(0.05)
        # While the task runs, its inputs sit in shared-memory files.
        assert any(p.is_file() for p in shm_base.rglob("*"))
        workers = psutil.Process(proc.pid).children(recursive=True)
        if whom == "parent":
            proc.send_signal(signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted" in out, err
    assert "KeyboardInterrupt" in err
    assert proc.returncode != 0
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []


def _unlink_orphaned_semaphores(candidates: set[Path]) -> None:
    """Remove the named semaphores that multiprocessing made for a process
    group this test SIGKILLed (its resource tracker died with it), unless a
    live process still maps them."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.rsplit(" ", 1)[-1].strip() for line in maps.open())
        except OSError:
            continue
    for sem in candidates:
        if str(sem) not in mapped:
            sem.unlink(missing_ok=True)


def test_directories_of_killed_computations_are_removed_by_the_next(
    pool: ProcessPoolExecutor, shm_base: Path, tmp_path: Path
) -> None:
    """A computation killed with SIGKILL cannot clean up; the next computation
    under the same parent directory removes what it left, and nothing else."""
    marker = tmp_path / "running"
    script = textwrap.dedent(
        f"""
        import pathlib, time
        import dask, numpy as np
        from dask_shm.local import get, shutdown_pool

        def big(seed):
            return np.random.default_rng(seed).random(500_000)

        def wait_forever(a, marker):
            pathlib.Path(marker).write_text("1")
            time.sleep(600)

        if __name__ == "__main__":
            dsk = {{"a": (big, 1), "w": (wait_forever, "a", {str(marker)!r})}}
            with dask.config.set({{"shm.local.shm-directory": {str(shm_base)!r}}}):
                get(dsk, "w", num_workers=1)
        """
    )
    path = tmp_path / "kill_me.py"
    path.write_text(script)
    semaphores_before = set(Path("/dev/shm").glob("sem.mp-*"))
    proc = subprocess.Popen([sys.executable, str(path)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None
            assert time.monotonic() < deadline, "the task never started"
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the orphaned pool, too
        except ProcessLookupError:
            pass
    psutil.wait_procs(workers, timeout=10)
    _unlink_orphaned_semaphores(set(Path("/dev/shm").glob("sem.mp-*")) - semaphores_before)
    (stale,) = shm_base.iterdir()
    assert any(p.is_file() for p in stale.iterdir())

    unlocked = shm_base / "dask-shm-local-not-a-computation"  # no lock file: left alone
    unlocked.mkdir()
    with ShmDirectory() as live:  # a computation still running
        assert get({"x": (big_array, 1)}, "x", pool=pool).shape == (BIG,)
        assert sorted(shm_base.iterdir()) == sorted([unlocked, Path(live.path)])
    unlocked.rmdir()


# --- found by review (stop 59): aliasing, names, concurrency, pools -------


def write_first_read_second(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    before = float(b[0])
    a[0] = -1.0
    return before, float(b[0])


def head_part(x: np.ndarray) -> np.ndarray:
    return x[: BIG * 3 // 4]


def tail_part(x: np.ndarray) -> np.ndarray:
    return x[BIG // 4 :]


def write_head_read_tail(head: np.ndarray, tail: np.ndarray) -> float:
    head[BIG // 2] = -1.0  # element BIG // 4 of tail, in the same file
    return float(tail[BIG // 4])


def test_two_inputs_from_one_file_never_share_memory(
    pool: ProcessPoolExecutor, shm_base: Path
) -> None:
    # Both inputs are the same array handed on unchanged (or overlapping
    # views of it): they travel as references to one file, and a task that
    # writes one must not see the other change, as with unpickled copies.
    x = dask.delayed(big_array)(3)
    same = dask.delayed(write_first_read_second)(
        dask.delayed(identity)(x), dask.delayed(identity)(x)
    )
    overlapping = dask.delayed(write_head_read_tail)(
        dask.delayed(head_part)(x), dask.delayed(tail_part)(x)
    )
    expected = dask.compute(same, overlapping, scheduler="processes")
    assert dask.compute(same, overlapping, scheduler=get, pool=pool) == expected
    first = float(big_array(3)[0])
    assert expected[0] == (first, first)


_kept_across_computations: dict[str, np.ndarray] = {}


def keep_in_process(x: np.ndarray) -> int:
    _kept_across_computations["x"] = x
    return os.getpid()


def kept_or(x: np.ndarray) -> np.ndarray:
    return _kept_across_computations.get("x", x)


def test_a_value_a_pool_process_kept_is_read_right_by_the_next_computation(
    shm_base: Path,
) -> None:
    # The warm pool's process maps a file of the first computation; the next
    # one (same directory) writes new files, and their names once repeated
    # the first's, so the kept array was sent back as the new file's bytes.
    ones, twos = np.full(BIG, 1.0), np.full(BIG, 2.0)
    pids = {dask.delayed(keep_in_process)(ones).compute(scheduler=get, num_workers=1)}
    for _ in range(2):
        got = dask.delayed(kept_or)(twos).compute(scheduler=get, num_workers=1)
        np.testing.assert_array_equal(got, ones)
        pids.add(dask.delayed(os.getpid)().compute(scheduler=get, num_workers=1))
    assert len(pids) == 1, "the warm pool was not reused: the test proves nothing"


def slow_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    time.sleep(0.05)
    return a + b


def test_many_concurrent_computations_on_the_warm_pool(shm_base: Path) -> None:
    # More computations at once than the parent once kept endpoints for: an
    # evicted endpoint lost the counts that keep its files alive.
    import threading

    def graph(seed: int) -> list[object]:
        xs = [dask.delayed(big_array)(seed * 10 + i) for i in range(6)]
        for _ in range(3):
            xs = [dask.delayed(slow_add)(xs[i], xs[(i + 1) % 6]) for i in range(6)]
        return [dask.delayed(total)(x) for x in xs]

    threads = 6
    expected = {s: dask.compute(*graph(s), scheduler="sync") for s in range(threads)}
    outcomes: dict[int, object] = {}

    def run(seed: int) -> None:
        try:
            for _ in range(3):
                outcomes[seed] = dask.compute(*graph(seed), scheduler=get, num_workers=1)
                assert outcomes[seed] == expected[seed]
        except BaseException as e:  # reported below, with the seed
            outcomes[seed] = e

    workers = [threading.Thread(target=run, args=(s,)) for s in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(100)
    assert outcomes == expected


def fail_after(x: object, seconds: float) -> None:
    time.sleep(seconds)
    raise ValueError("failed on purpose")


def test_a_failed_computation_leaves_a_multiprocessing_pool_usable(shm_base: Path) -> None:
    # On failure get waits for the tasks still running; cancelling the
    # futures dask wraps a multiprocessing.Pool's results in killed the
    # pool's result-handler thread, and the pool never answered again.
    with get_context().Pool(2) as mp_pool:
        tasks = [dask.delayed(sleep_then_return)(i, 1.0) for i in range(5)]
        with pytest.raises(ValueError, match="failed on purpose"):
            dask.compute(*tasks, dask.delayed(fail_after)(0, 0), scheduler=get, pool=mp_pool)
        time.sleep(2.5)  # the tasks still queued or running end and report to the pool
        assert mp_pool._result_handler.is_alive()  # type: ignore[attr-defined]
        again = dask.delayed(total)(dask.delayed(big_array)(1))
        assert again.compute(scheduler=get, pool=mp_pool) == float(big_array(1).sum())


def small_array(i: int) -> np.ndarray:
    return np.full(10, float(i))


def medium_array(i: int) -> np.ndarray:
    return np.full(20_000, float(i))


def slow_total(x: np.ndarray) -> float:
    time.sleep(0.3)
    return float(x.sum())


def test_a_forked_pool_process_is_not_the_owner_of_the_files(shm_base: Path) -> None:
    # A pool that forks its processes during a computation (here: one task
    # per process) gave them the parent's state: they deleted files as their
    # owner, and later tasks found their inputs gone.
    import multiprocessing

    warm_up = [dask.delayed(total)(dask.delayed(small_array)(i)) for i in range(4)]
    x = dask.delayed(medium_array)(5)  # under MIN_RECYCLE: deleted when freed
    sums = warm_up + [dask.delayed(slow_total)(x) for _ in range(6)]
    expected = dask.compute(*sums, scheduler="sync")
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as fork_pool:
        assert dask.compute(*sums, scheduler=get, pool=fork_pool) == expected


def test_a_reference_outside_its_file_is_refused_and_keeps_nothing_mapped(
    shm_base: Path,
) -> None:
    # A message naming a range its file does not have: loads raises
    # ValueError, and no mapping made for it stays behind.
    from dask_shm.local.transport import Transport

    directory = ShmDirectory()
    try:
        transport = Transport(directory.path, threshold=1024)
        payload, refs, msg_id, reply_to, pid, files = transport.dumps([big_array(1), big_array(2)])
        assert len({r[0] for r in refs}) == 1 and len(refs) == 2
        name, frame, start, stop = refs[1]
        for bad in [(name, frame, start, stop + 8), (name, frame + 5, 0, 8)]:
            for named in [(refs[0], bad), (bad, refs[0])]:
                message = (payload, named, 0, 0, pid, ())
                with pytest.raises(ValueError, match="outside frame"):
                    transport.loads(message)
        assert transport._ep.mapped_names() == ()
        assert transport._ep.mappings == {}
        transport.close(remove=False)
    finally:
        directory.close()
