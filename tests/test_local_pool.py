"""dask_shm.local.get's warm pool: reused across computations, replaced when
broken or when its configuration changes, never leaving shared-memory files or
mappings behind, and its processes importing only the transport.

Real spawn pools and real files under /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import psutil
import pytest
from tmpfs import small_tmpfs

from dask_shm.local import get, release_idle_files, shutdown_pool
from dask_shm.local.pool import warm_pool_pids

pytestmark = pytest.mark.timeout(180)

BIG = 200_000  # float64 elements: 1.6 MB, far above the 64 KiB threshold


@pytest.fixture(autouse=True)
def no_warm_pool_left() -> Iterator[None]:
    """Every test starts without a warm pool and shuts down the one it made."""
    shutdown_pool()
    yield
    shutdown_pool()


# --- task functions (module level: the pool imports them by reference) ------


def big_array(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(BIG)


def pid_of(*args: object) -> int:
    return os.getpid()


def total(*xs: np.ndarray) -> float:
    return float(sum(x.sum() for x in xs))


def fail(x: object) -> None:
    raise ValueError("task failed on purpose")


def kill_own_process(x: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def mark_initialized() -> None:
    os.environ["DASK_SHM_TEST_INITIALIZED"] = "yes"


def initialized(x: object) -> str | None:
    return os.environ.get("DASK_SHM_TEST_INITIALIZED")


def pids_used(n: int, num_workers: int = 2) -> set[int]:
    """Pids of the pool processes that ran ``n`` slow-ish independent tasks."""
    dsk = {("p", i): (pid_of, (big_array, i)) for i in range(n)}
    return set(get(dsk, list(dsk), num_workers=num_workers))


def wait_gone(pids: set[int], timeout: float = 20) -> None:
    """Assert every process in ``pids`` has exited within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        assert time.monotonic() < deadline, f"still alive: {pids}"
        time.sleep(0.05)


# --- reuse ---------------------------------------------------------------------


def test_the_pool_is_reused_across_computations(shm_base: Path) -> None:
    first = pids_used(8)
    pool = set(warm_pool_pids())
    assert len(pool) == 2 and first <= pool
    for seed in range(5):
        x = da.random.RandomState(seed).random((600, 600), chunks=(200, 200))
        y = (x @ x.T).sum(axis=0)
        (result,) = dask.compute(y, scheduler=get, num_workers=2)
        np.testing.assert_allclose(result, y.compute(scheduler="sync"))
        assert pids_used(4) <= pool
    assert set(warm_pool_pids()) == pool  # the same two processes all along
    shutdown_pool()
    wait_gone(pool)
    assert warm_pool_pids() == []


def test_warm_false_and_config_give_a_pool_per_computation(shm_base: Path) -> None:
    pids = pids_used(4)
    assert warm_pool_pids() != []
    shutdown_pool()
    with dask.config.set({"shm.local.warm-pool": False}):
        pids = pids_used(4)
    wait_gone(pids)
    assert warm_pool_pids() == []
    dsk = {"x": (pid_of, 1)}
    pid = get(dsk, "x", warm=False)
    wait_gone({pid})
    assert warm_pool_pids() == []
    with dask.config.set({"shm.local.warm-pool": "yes"}):
        with pytest.raises(ValueError, match=r"shm\.local\.warm-pool must be true or false"):
            get(dsk, "x")


def test_a_config_change_closes_the_pool_and_starts_another(shm_base: Path) -> None:
    pids_used(4)
    two = set(warm_pool_pids())
    assert len(two) == 2
    # Another size.
    pids_used(2, num_workers=1)
    one = set(warm_pool_pids())
    assert len(one) == 1 and not one & two
    wait_gone(two)
    # Another initializer (from dask's config, as scheduler="processes" reads it).
    with dask.config.set({"multiprocessing.initializer": mark_initialized}):
        assert get({"x": (initialized, 1)}, "x", num_workers=1) == "yes"
        init = set(warm_pool_pids())
    assert not init & one
    wait_gone(one)
    # Back to no initializer: the initialized processes must not be reused.
    assert get({"x": (initialized, 1)}, "x", num_workers=1) is None
    wait_gone(init)
    # Another multiprocessing context.
    plain = set(warm_pool_pids())
    with dask.config.set({"multiprocessing.context": "forkserver"}):
        assert get({"x": (big_array, 1), "y": (total, "x")}, "y", num_workers=1) == total(
            big_array(1)
        )
        assert not set(warm_pool_pids()) & plain
    wait_gone(plain)


# --- broken pools are replaced, never reused ------------------------------------


def test_a_pool_process_killed_between_computations_is_replaced(shm_base: Path) -> None:
    pids_used(4)
    pool = set(warm_pool_pids())
    kept = set(shm_base.iterdir())
    assert len(kept) == 1  # the directory kept for the next computation
    victim, survivor = sorted(pool)
    os.kill(victim, signal.SIGKILL)
    wait_gone({victim})
    # The next computation does not see BrokenProcessPool: it gets a new pool.
    assert get({"x": (big_array, 2), "y": (total, "x")}, "y", num_workers=2) == total(big_array(2))
    fresh = set(warm_pool_pids())
    assert len(fresh) == 2 and not fresh & pool
    wait_gone({survivor})  # the broken pool's other process was stopped
    assert not kept & set(shm_base.iterdir())  # its files went with it


def test_a_pool_process_killed_during_a_computation_breaks_only_that_one(
    shm_base: Path,
) -> None:
    pids_used(4)
    pool = set(warm_pool_pids())
    dsk = {"x": (big_array, 9), "die": (kill_own_process, "x"), "z": (total, "die")}
    with pytest.raises(BrokenProcessPool):
        get(dsk, "z", num_workers=2)
    wait_gone(pool)
    assert warm_pool_pids() == []
    assert pids_used(4) <= set(warm_pool_pids())
    assert not set(warm_pool_pids()) & pool


def test_a_task_error_replaces_the_pool(shm_base: Path) -> None:
    """Tasks still running when a task fails are not waited for: the pool is
    terminated at once, and the next computation gets a fresh one."""
    pids_used(4)
    pool = set(warm_pool_pids())
    dsk = {"x": (big_array, 3), "bad": (fail, "x"), "ok": (total, "x"), "all": (total, "bad", "ok")}
    with pytest.raises(ValueError, match="task failed on purpose"):
        get(dsk, "all", num_workers=2)
    wait_gone(pool)
    assert get({"x": (big_array, 4), "y": (total, "x")}, "y", num_workers=2) == total(big_array(4))
    assert not set(warm_pool_pids()) & pool


def test_a_busy_pool_is_not_shared_by_concurrent_computations(shm_base: Path) -> None:
    pids_used(4)
    pool = set(warm_pool_pids())
    results: dict[str, set[int]] = {}

    def compute(name: str) -> None:
        dsk = {("p", i): (pid_of, (big_array, i), (time.sleep, 0.3)) for i in range(4)}
        results[name] = set(get(dsk, list(dsk), num_workers=2))

    threads = [threading.Thread(target=compute, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    warm = [n for n, pids in results.items() if pids <= pool]
    private = [n for n, pids in results.items() if not pids & pool]
    assert len(warm) == 1 and len(private) == 1, results
    wait_gone(results[private[0]])  # the private pool was shut down
    assert set(warm_pool_pids()) == pool


# --- no files or mappings left behind ------------------------------------------------


def mapped_files_under(pid: int, base: Path) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if str(base) in line]


def files_under(base: Path) -> list[Path]:
    return sorted(p for p in base.rglob("*") if p.is_file())


def assert_nothing_mapped_or_open(base: Path) -> None:
    # Files deleted but still mapped or open would hold RAM invisibly.
    for pid in [os.getpid(), *warm_pool_pids()]:
        assert mapped_files_under(pid, base) == [], pid
    for pid in warm_pool_pids():
        open_files = [f.path for f in psutil.Process(pid).open_files()]
        assert not [f for f in open_files if f.startswith(str(base))], open_files


def matmul_sum_graph(seed: int) -> da.Array:
    x = da.random.RandomState(seed).random((800, 800), chunks=(400, 400))
    y = (x + x.T) * 2
    return (y @ y.T).sum(axis=0)


def matmul_sum(seed: int) -> np.ndarray:
    (result,) = dask.compute(matmul_sum_graph(seed), scheduler=get, num_workers=2)
    return result


def test_many_computations_keep_only_unmapped_files_for_reuse(shm_base: Path) -> None:
    """Between computations the warm pool keeps one directory with files for
    the next computation to overwrite: within the reuse budgets, mapped by no
    process; the next computation works in the same directory. Releasing it
    leaves nothing, and the pool goes on."""
    recycle = 4 * 2**20
    directories = set()
    with dask.config.set({"shm.local.recycle-bytes": recycle}):
        for i in range(40):
            result = matmul_sum(i)
            assert result.shape == (800,)
            del result
            directories |= {p for p in shm_base.iterdir()}
            kept = [p for p in files_under(shm_base) if p.name != ".lock"]
            # the parent's budget plus each of the two pool processes' own
            assert sum(p.stat().st_size for p in kept) <= 3 * recycle, kept
            assert_nothing_mapped_or_open(shm_base)
        assert len(directories) == 1, directories
        assert kept, "files are kept for the next computation"
    pool = warm_pool_pids()
    assert len(pool) == 2
    release_idle_files()
    assert list(shm_base.iterdir()) == []
    assert_nothing_mapped_or_open(shm_base)
    assert warm_pool_pids() == pool
    assert matmul_sum(0).shape == (800,)  # a fresh directory


def test_kept_files_are_removed_after_the_idle_timeout(shm_base: Path) -> None:
    with dask.config.set({"shm.local.idle-file-timeout": "0.3 s"}):
        matmul_sum(1)
        assert list(shm_base.iterdir()) != []
        deadline = time.monotonic() + 10
        while list(shm_base.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(shm_base.iterdir()) == []
        assert len(warm_pool_pids()) == 2


def test_no_files_kept_with_a_zero_idle_timeout_or_a_failure(shm_base: Path) -> None:
    with dask.config.set({"shm.local.idle-file-timeout": 0}):
        for i in range(3):
            matmul_sum(i)
            assert list(shm_base.iterdir()) == []
    matmul_sum(3)
    assert list(shm_base.iterdir()) != []
    dsk = {"x": (big_array, 0), "y": (fail, "x")}
    with pytest.raises(ValueError, match="on purpose"):
        get(dsk, "y", num_workers=2)
    assert list(shm_base.iterdir()) == []  # the failed computation removed it
    assert_nothing_mapped_or_open(shm_base)


def test_kept_files_follow_the_configured_directory(shm_base: Path, tmp_path: Path) -> None:
    """A computation after a change of shm.local.shm-directory works under
    the new base; the directory kept under the old one is removed."""
    matmul_sum(0)
    assert list(shm_base.iterdir()) != []
    other = Path("/dev/shm") / f"{shm_base.name}-other"
    other.mkdir(mode=0o700)
    try:
        with dask.config.set({"shm.local.shm-directory": str(other)}):
            matmul_sum(1)
            assert list(shm_base.iterdir()) == []
            assert list(other.iterdir()) != []
            release_idle_files()
            assert list(other.iterdir()) == []
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_releasing_files_while_computations_run(shm_base: Path) -> None:
    """release_idle_files() called over and over from another thread never
    touches the directory of a running computation."""
    stop = threading.Event()

    def release_often() -> None:
        while not stop.is_set():
            release_idle_files()
            time.sleep(0.001)

    thread = threading.Thread(target=release_often)
    thread.start()
    try:
        for seed in range(15):
            expected = total(big_array(seed), big_array(seed + 1))
            dsk = {"a": (big_array, seed), "b": (big_array, seed + 1), "t": (total, "a", "b")}
            assert get(dsk, "t", num_workers=2) == expected
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("tamper", ["delete", "symlink", "hard link", "truncate"])
def test_kept_files_tampered_with_between_computations(
    shm_base: Path, shm_dir: str, tmp_path: Path, tamper: str
) -> None:
    """Whatever happens to the kept files while the pool idles, the next
    computations are right and write nothing through them to elsewhere: a
    symlink's target and a file with another name stay as they were."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    matmul_sum(0)
    kept = [p for p in files_under(shm_base) if p.name != ".lock"]
    assert kept
    linked: dict[Path, bytes] = {}
    for i, path in enumerate(kept):
        if tamper == "delete":
            path.unlink()
        elif tamper == "symlink":
            path.unlink()
            path.symlink_to(victim)
        elif tamper == "hard link":
            other = Path(shm_dir) / f"other-name-{i}"
            os.link(path, other)
            linked[other] = other.read_bytes()
        else:
            os.truncate(path, 100)
    for seed in (1, 2):
        expected = matmul_sum_graph(seed).compute(scheduler="sync")
        np.testing.assert_allclose(matmul_sum(seed), expected)
    assert victim.read_bytes() == b"precious" * 1000
    for other, content in linked.items():
        assert other.read_bytes() == content


def test_a_container_sized_tmpfs_across_computations() -> None:
    """On a 64 MiB tmpfs (a container's /dev/shm) as shm.local.shm-directory,
    graphs with twice that in flight are right one after the other while the
    kept files fill part of it (what does not fit goes through the pipes),
    and releasing them leaves the tmpfs empty."""
    with small_tmpfs("64m") as base, dask.config.set({"shm.local.shm-directory": base}):
        try:
            for seed in range(3):
                x = da.random.RandomState(seed).random((4000, 4000), chunks=(1000, 1000))
                y = ((x + x.T) * 2).sum(axis=0)  # 128 MB of data in 8 MB chunks
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # the pipe fallback
                    (result,) = dask.compute(y, scheduler=get, num_workers=2)
                np.testing.assert_allclose(result, y.compute(scheduler="sync"))
                assert os.listdir(base), "files kept for the next computation"
        finally:
            release_idle_files()
        assert os.listdir(base) == []
        assert os.statvfs(base).f_bfree == os.statvfs(base).f_blocks


def test_bad_idle_file_timeout_is_named(shm_base: Path) -> None:
    with dask.config.set({"shm.local.idle-file-timeout": "soon"}):
        with pytest.raises(ValueError, match=r"shm\.local\.idle-file-timeout must be a duration"):
            get({"x": 1}, "x")


# --- what a pool process imports, and exit ---------------------------------------------


def test_pool_processes_import_only_the_transport(tmp_path: Path) -> None:
    script = tmp_path / "imports.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import numpy as np
            from dask_shm.local import get

            HEAVY = ("distributed", "zict", "dask_shm.spill", "dask_shm.shared",
                     "dask_shm.amm", "dask_shm.spans", "dask_shm.worker")

            def heavy_modules(x):
                return sorted(m for m in HEAVY if m in sys.modules)

            if __name__ == "__main__":
                dsk = {"x": (np.ones, 100_000), "y": (heavy_modules, "x")}
                print("pool:", get(dsk, "y", num_workers=1))
                print("parent:", heavy_modules(None))
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pool: []" in out.stdout, out.stdout
    assert "parent: []" in out.stdout, out.stdout


def test_the_warm_pool_is_shut_down_at_exit(tmp_path: Path, shm_base: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import dask
            import numpy as np
            from dask_shm.local import get
            from dask_shm.local.pool import warm_pool_pids

            if __name__ == "__main__":
                dask.config.set({"shm.local.shm-directory": sys.argv[1]})
                dsk = {"x": (np.ones, 10**6), "y": (np.sum, "x")}
                assert get(dsk, "y", num_workers=2) == 10**6
                assert os.listdir(sys.argv[1]), "a directory is kept for the next computation"
                print(*warm_pool_pids(), flush=True)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script), str(shm_base)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    pids = {int(p) for p in out.stdout.split()}
    assert len(pids) >= 1
    wait_gone(pids)
    assert list(shm_base.iterdir()) == []  # the kept directory went at exit


EXITS_SCRIPT = """
import multiprocessing, os, sys
import dask
import numpy as np
from dask_shm.local import get
from dask_shm.local.pool import warm_pool_pids

def total_in_pool(n):
    # A computation on a warm pool of this process's own.
    dsk = {"x": (np.ones, n), "y": (np.sum, "x")}
    return int(get(dsk, "y", num_workers=2)), warm_pool_pids()

def in_child(base, queue):
    dask.config.set({"shm.local.shm-directory": base})
    queue.put(total_in_pool(10**6))

if __name__ == "__main__":
    how, base = sys.argv[1], sys.argv[2]
    dask.config.set({"shm.local.shm-directory": base})
    if how == "process":
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=in_child, args=(base, queue))
        child.start()
        result, pids = queue.get(timeout=60)
        child.join(timeout=30)
        print("exitcode", child.exitcode)
    else:  # a task of dask_shm.get that calls dask_shm.get
        result, pids = get({"r": (total_in_pool, 10**6)}, "r", num_workers=1)
    print("result", result)
    print("pids", *pids, flush=True)
"""


@pytest.mark.parametrize("how", ["process", "task"])
def test_a_warm_pool_made_in_a_child_process_lets_it_exit(
    how: str, tmp_path: Path, shm_base: Path
) -> None:
    """A multiprocessing child runs no atexit handlers and joins its own
    processes before concurrent.futures stops them: a warm pool left there
    would keep the child, and its parent's exit, waiting for ever. Both a
    user's Process and a task of dask_shm.get (nested computations, as
    ``scheduler="processes"`` allows) exit, their pool processes with them,
    and leave no files."""
    script = tmp_path / "child.py"
    script.write_text(EXITS_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), how, str(shm_base)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    assert "result 1000000" in out.stdout, out.stdout
    if how == "process":
        assert "exitcode 0" in out.stdout, out.stdout
    pids = {int(p) for p in out.stdout.split("pids")[1].split()}
    assert len(pids) == 2
    wait_gone(pids)
    assert list(shm_base.iterdir()) == []


def test_a_forked_child_starts_its_own_pool_and_leaves_the_parents(shm_base: Path) -> None:
    """After fork the warm pool, its processes and its kept files are the
    parent's: the child computes on a pool of its own and exits without
    stopping the parent's, which serves the next computation."""
    parent_pids = pids_used(4)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        child = ctx.Process(target=child_computation, args=(results,))
        child.start()
    total_in_child, child_pool = results.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert total_in_child == BIG
    assert child_pool and not set(child_pool) & parent_pids
    wait_gone(set(child_pool))
    assert pids_used(4) == parent_pids
    assert set(warm_pool_pids()) == parent_pids


def child_computation(results: multiprocessing.queues.Queue[tuple[float, list[int]]]) -> None:
    """In a forked child: a computation on the warm pool, left for exit to stop."""
    dsk = {"x": (np.ones, BIG), "y": (np.sum, "x")}
    results.put((float(get(dsk, "y", num_workers=2)), warm_pool_pids()))


def thread_variables(x: object) -> list[str | None]:
    from dask_shm.local.pool import THREAD_VARIABLES

    return [os.environ.get(name) for name in THREAD_VARIABLES]


def test_pool_processes_share_the_cpus_between_their_blas_threads(
    shm_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """num_workers processes each running BLAS must not oversubscribe the
    CPUs: unset thread variables get cpus // num_workers (at least 1) in the
    pool only; a value the user set is kept."""
    from dask.system import CPU_COUNT

    from dask_shm.local.pool import THREAD_VARIABLES

    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    share = str(max(1, CPU_COUNT // 2))
    assert get({"x": (thread_variables, 1)}, "x", num_workers=2) == [share] * 3
    assert [os.environ.get(name) for name in THREAD_VARIABLES] == [None] * 3
    monkeypatch.setenv("MKL_NUM_THREADS", "7")  # a change starts another pool
    assert get({"x": (thread_variables, 1)}, "x", num_workers=2) == [share, share, "7"]
    assert get({"x": (thread_variables, 1)}, "x", num_workers=1) == [str(CPU_COUNT)] * 2 + ["7"]
