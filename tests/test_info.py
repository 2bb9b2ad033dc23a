"""``dask-shm info`` on the real system: dask_shm.info and the subcommand."""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile

import dask.config
import psutil
import pytest
from distributed import LocalCluster, WorkerPlugin

from dask_shm.cli import main
from dask_shm.info import PLUGIN_NAME, collect_info, filesystem_of, format_info
from dask_shm.info.checks import find_problems, worker_map_budget

ROOT_KINDS = {"root-missing", "root-not-directory", "root-not-tmpfs", "root-not-writable"}
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux")
needs_dev_shm = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def kinds(info):
    return {p.kind for p in info.problems}


def problem(info, kind):
    [found] = [p for p in info.problems if p.kind == kind]
    return found


def run_cli(*args, env=None, preexec_fn=None, timeout=120):
    base = {k: v for k, v in os.environ.items() if not k.startswith("DASK_SHM__")}
    return subprocess.run(
        [sys.executable, "-m", "dask_shm", "info", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
        preexec_fn=preexec_fn,
    )


def fs_type(path):
    """Filesystem type as coreutils' stat sees it (independent of dask_shm)."""
    out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


@pytest.fixture
def disk_dir():
    """A fresh directory on a filesystem that is not a tmpfs."""
    for parent in (tempfile.gettempdir(), "/var/tmp", os.getcwd(), os.path.expanduser("~")):
        kind = fs_type(parent) if os.path.isdir(parent) else None
        if kind and kind != "tmpfs" and os.access(parent, os.W_OK):
            path = tempfile.mkdtemp(prefix="test-info-", dir=parent)
            try:
                yield path
            finally:
                shutil.rmtree(path, ignore_errors=True)
            return
    pytest.skip("no writable directory outside a tmpfs")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@linux_only
@needs_dev_shm
def test_dev_shm_is_a_tmpfs_with_no_root_problem():
    info = collect_info("/dev/shm")
    assert info.is_linux and info.platform == "Linux"
    assert info.root_exists and info.root_is_dir and info.writable is True
    assert info.fs_type == "tmpfs" and info.on_tmpfs and info.mount_point == "/dev/shm"
    assert info.total_bytes and info.free_bytes is not None
    assert info.total_bytes >= info.free_bytes
    assert not kinds(info) & ROOT_KINDS
    assert info.user_dir == f"/dev/shm/dask-shm-{os.geteuid()}"
    limit = info.open_files
    assert limit is not None
    assert limit.soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with open("/proc/sys/vm/max_map_count") as f:
        assert info.max_map_count == int(f.read())
    # Judged by what a worker could map under it: flagged below the kernel's
    # default only (a worker keeps at most an eighth of it in held values).
    assert ("max-map-count" in kinds(info)) == (info.max_map_count < 65530)
    assert info.settings is not None and info.config_errors == []
    text = format_info(info)
    assert "tmpfs (mounted on /dev/shm)" in text
    assert "shm.shared-memory.root" in text


def test_default_root_comes_from_config(shm_dir):
    with dask.config.set({"shm.shared-memory.root": shm_dir}):
        info = collect_info()
    assert info.root == shm_dir and info.on_tmpfs
    assert info.config["shared-memory"]["root"] == shm_dir


@linux_only
def test_directory_not_on_tmpfs_is_reported_with_a_fix(disk_dir):
    info = collect_info(disk_dir)
    assert info.root_exists and not info.on_tmpfs
    assert info.fs_type and info.fs_type != "tmpfs"
    found = problem(info, "root-not-tmpfs")
    assert disk_dir in found.message and "not a tmpfs" in found.message
    assert "mount" not in found.fix and "shm.shared-memory.root" in found.fix
    text = format_info(info)
    assert f"- {found.message}\n  fix: {found.fix}" in text


def test_missing_root_is_reported(shm_dir):
    missing = os.path.join(shm_dir, "no", "such", "dir")
    info = collect_info(missing)
    assert not info.root_exists and info.writable is None
    found = problem(info, "root-missing")
    assert missing in found.message and "does not exist" in found.message
    assert "mkdir -p" in found.fix and "shm.shared-memory.root" in found.fix
    assert not kinds(info) & (ROOT_KINDS - {"root-missing"})
    assert "exists: no" in format_info(info)


def test_root_that_is_a_file_is_reported(shm_dir):
    path = os.path.join(shm_dir, "file")
    open(path, "w").close()
    assert "root-not-directory" in kinds(collect_info(path))


@linux_only
@needs_dev_shm
def test_unusable_per_user_directory_is_reported(shm_dir):
    user_dir = os.path.join(shm_dir, f"dask-shm-{os.geteuid()}")
    os.mkdir(user_dir, 0o755)  # a wrong mode is fixed when the plugin uses it
    info = collect_info(shm_dir)
    assert info.user_dir == user_dir and "user-directory" not in kinds(info)
    assert f"{user_dir}: ok" in format_info(info)
    os.rmdir(user_dir)
    os.symlink("/tmp", user_dir)
    found = problem(collect_info(shm_dir), "user-directory")
    assert user_dir in found.message and "symbolic link" in found.message
    os.unlink(user_dir)
    open(user_dir, "w").close()
    assert "not a directory" in problem(collect_info(shm_dir), "user-directory").message


GiB = 2**30


@linux_only
@needs_dev_shm
@pytest.mark.parametrize(
    "max_map_count, tmpfs, ram, flagged",
    [
        (65530, 12 * GiB, 24 * GiB, False),  # stock Linux, a laptop-sized host
        # many more values than a worker keeps mapped: re-mapped on use, not a problem
        (65530, 128 * GiB, 256 * GiB, False),
        (262144, 128 * GiB, 256 * GiB, False),
        (16384, 12 * GiB, 24 * GiB, True),  # lowered below the kernel's default
    ],
)
def test_max_map_count_is_judged_against_what_a_worker_could_map(
    max_map_count, tmpfs, ram, flagged
):
    facts = collect_info("/dev/shm")
    info = dataclasses.replace(
        facts, max_map_count=max_map_count, total_bytes=tmpfs, memory_total=ram, problems=[]
    )
    problems = [p for p in find_problems(info) if p.kind == "max-map-count"]
    assert bool(problems) == flagged
    if flagged:
        [p] = problems
        assert f"vm.max_map_count is {max_map_count}" in p.message
        assert "at most 2,048 shared values mapped" in p.message
        assert "4,096 born-shared blocks" in p.message
        assert p.fix.startswith("`sysctl -w vm.max_map_count=65530`")
    # the report states the budget: held values, born blocks, and their sum
    budget = worker_map_budget(max_map_count)
    assert budget.total < max_map_count // 2
    text = format_info(info)
    assert f"a worker maps at most {budget.total:,}: {budget.values:,} held values" in text


def test_plugin_name_is_the_shared_memory_plugins():
    from dask_shm.shared.plugin import PLUGIN_NAME as REAL_NAME

    assert PLUGIN_NAME == REAL_NAME


def test_filesystem_of_takes_the_longest_mount_prefix(tmp_path, monkeypatch):
    # psutil reads <PROCFS_PATH>/self/mounts: a mount table of our own
    (tmp_path / "self").mkdir()
    mounts = tmp_path / "self" / "mounts"
    monkeypatch.setattr(psutil, "PROCFS_PATH", str(tmp_path))
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "tmpfs /data/my\\040disk tmpfs rw 0 0\n"
        "/dev/vdb /data ext4 rw 0 0\n"
        "tmpfs /dev/shm ramfs rw 0 0\n"  # mounted on top of the first one
    )
    assert filesystem_of("/dev/shm/x") == ("/dev/shm", "ramfs")
    assert filesystem_of("/dev/shmx") == ("/", "ext4")
    assert filesystem_of("/data/my disk/a") == ("/data/my disk", "tmpfs")
    assert filesystem_of("/data/other") == ("/data", "ext4")
    mounts.unlink()
    assert filesystem_of("/x") is None


@linux_only
@needs_dev_shm
def test_low_open_files_limit_is_reported():
    def lower_limit():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    proc = run_cli("--root", "/dev/shm", preexec_fn=lower_limit)
    assert proc.returncode == 1, proc.stderr  # a problem reported
    out = proc.stdout
    assert "open files (RLIMIT_NOFILE): soft 256," in out
    assert "soft limit on open files (RLIMIT_NOFILE) is 256" in out
    assert "fix: raise it in the shell or service that starts the workers: `ulimit -n 65536`" in out


def test_invalid_config_is_reported_naming_the_key():
    proc = run_cli(env={"DASK_SHM__SHARED_MEMORY__MIN_SIZE": "abc"})
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert "- invalid config: config shm.shared-memory.min-size must be a byte size" in out
    assert "got 'abc'" in out
    assert (
        "fix: correct shm.shared-memory.min-size; the environment variable "
        "DASK_SHM__SHARED_MEMORY__MIN_SIZE is set to 'abc'"
    ) in out
    assert "validated shared-memory settings" not in out


def test_invalid_config_in_process():
    with dask.config.set({"shm.shared-memory.min-shared-fraction": 2, "shm.spans": "yes"}):
        info = collect_info()
    assert info.settings is None and len(info.config_errors) == 2
    fixes = [p.fix for p in info.problems if p.kind == "config"]
    assert any(f.startswith("correct shm.shared-memory.min-shared-fraction;") for f in fixes)
    assert any(f.startswith("correct shm.spans;") for f in fixes)
    assert info.root == "/dev/shm"  # the root is still inspected


def test_invalid_born_shared_value_is_a_problem_not_a_guess():
    # A worker refuses to start with it: info must not say "no problems".
    with dask.config.set({"shm.shared-memory.born-budget": "lots"}):
        info = collect_info()
    assert info.born_shared is None
    [problem] = [p for p in info.problems if p.kind == "config"]
    assert "shm.shared-memory.born-budget" in problem.message
    assert problem.fix.startswith("correct shm.shared-memory.born-budget;")


class _NamedLikeTheSharedMemoryPlugin(WorkerPlugin):
    name = PLUGIN_NAME


def test_scheduler_reports_workers_and_the_plugin(shm_dir):
    with LocalCluster(
        n_workers=1,
        processes=False,
        protocol="tcp",  # reachable from another process
        dashboard_address=":0",
        silence_logs=logging.ERROR,
    ) as cluster:
        [worker] = cluster.workers.values()
        proc = run_cli("--root", shm_dir, "--scheduler", cluster.scheduler_address)
        out = proc.stdout
        assert f"Scheduler {cluster.scheduler_address}" in out
        # Nothing asked for the plugin (shm.shared-memory.enabled: false).
        assert f"{worker.address}: shared-memory plugin off" in out
        assert PLUGIN_NAME not in out.split("Problems:")[-1]

        # Whatever the real plugin does, a plugin under that name counts.
        worker.plugins[PLUGIN_NAME] = _NamedLikeTheSharedMemoryPlugin()
        info = collect_info(scheduler_address=cluster.scheduler_address)
        assert info.scheduler_error is None
        [w] = info.workers
        assert w.address == worker.address and w.plugin_active is True
        assert w.data_class == f"{type(worker.data).__module__}.{type(worker.data).__qualname__}"
        assert not kinds(info) & {"plugin", "scheduler", "no-workers", "worker-check"}


def test_unreachable_scheduler_is_a_problem_not_a_crash():
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = run_cli("--scheduler", address, "--timeout", "1")
    assert proc.returncode == 1, proc.stderr
    assert f"- could not reach the scheduler at {address}" in proc.stdout
    info = collect_info(scheduler_address="not an address", timeout=1)
    assert "scheduler" in kinds(info) and info.workers == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["info", "--bogus"], "No such option '--bogus'"),
        (
            ["info", "--timeout", "soon"],
            "'soon' is not a valid float",
        ),
        (["info", "--timeout", "0"], "Invalid value for '--timeout'"),
        (["info", "--root"], "Option '--root' requires an argument"),
    ],
)
def test_bad_options_give_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err  # click shows the usage line too, except for a missing value
