"""Issue 12: shared-memory mode loses or corrupts nothing (in-process workers,
PID namespaces, accounting, tampering, in-place writes, foreign roots).
Real clusters, real processes, real /dev/shm files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import dask
import numpy as np
import pytest
from clusters import process_cluster, worker_addresses
from distributed import Client, LocalCluster, wait

from dask_shm import SharedMemoryPlugin
from dask_shm.shared import SharedSpillBuffer, paths
from dask_shm.shared.registry import PeerRegistry

MB = 2**20


@pytest.fixture
def root(shm_dir):
    with dask.config.set({"shm.shared-memory.root": shm_dir}):
        yield shm_dir


# Every test uses a private root (a fresh directory on /dev/shm): other
# programs' directories under /dev/shm are never swept by these tests.


def _array_results(client: Client) -> tuple[float, float]:
    import dask.array as da

    x = da.random.RandomState(42).random((1200, 1200), chunks=(300, 300))
    matmul = client.compute((x @ x.T).sum()).result()
    rechunked = client.compute(x.rechunk((600, 200)).sum()).result()
    return float(matmul), float(rechunked)


def _expected() -> tuple[float, float]:
    import dask
    import dask.array as da

    x = da.random.RandomState(42).random((1200, 1200), chunks=(300, 300))
    with dask.config.set(scheduler="sync"):
        return float((x @ x.T).sum().compute()), float(x.rechunk((600, 200)).sum().compute())


@pytest.mark.parametrize("protocol", ["inproc", "tcp"])
def test_in_process_workers_get_values_not_handles(root, protocol: str) -> None:
    """processes=False: values between workers of one process are never
    handles over inproc:// (messages are not serialized there); over tcp://
    they may be, and come back as values."""
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=False,
            protocol=f"{protocol}://",
            dashboard_address=":0",
            memory_limit="2 GiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(SharedMemoryPlugin(root=root))
        assert all(client.run(lambda dask_worker: dask_worker.data.shared).values())
        assert _array_results(client) == pytest.approx(_expected(), rel=1e-12)
        a, b = cluster.workers.values()
        x = client.submit(np.full, MB, 1.0, workers=[a.address], key="x")
        got = client.submit(lambda v: type(v).__name__, x, workers=[b.address]).result()
        assert got == "ndarray"
        assert type(x.result()) is np.ndarray
        links = sum(w.data.shm_counters["link_transfers"] for w in cluster.workers.values())
        if protocol == "inproc":
            assert links == 0
        else:
            assert links > 0


def test_a_handle_never_enters_a_buffer(root) -> None:
    """The loud check at the boundary: a handle offered as a value to the
    shared-memory buffer (the only one whose peers send handles) is refused
    with an error naming the key, and nothing is stored."""
    from distributed.protocol.serialize import to_serialize

    from dask_shm.shared.guard import HandleLeakError
    from dask_shm.shared.store import Handle

    handle = Handle("/dev/shm/nowhere", 100, 100, 100)
    buffer = SharedSpillBuffer.from_config(10 * MB)
    for value in (handle, to_serialize(handle)):
        with pytest.raises(HandleLeakError, match="'leaked'"):
            buffer["leaked"] = value
        assert "leaked" not in buffer
    buffer["fine"] = np.ones(10)
    assert (buffer["fine"] == 1).all()
    buffer.close()


# -- item 2: liveness by lock, across PID namespaces; clean close ---------------------


_NAMESPACED_WORKER = r"""
import json, os, sys
import numpy as np
import dask.config
root = sys.argv[1]
dask.config.set({"shm.shared-memory.root": root})
from dask_shm.shared import SharedSpillBuffer, paths
from dask_shm.shared.registry import PeerRegistry
buf = SharedSpillBuffer.from_config(2**30)
buf["x"] = np.arange(2**17, dtype=float)
buf.evict()
PeerRegistry(root).register("tcp://10.1.2.3:4567")
print(json.dumps([os.getpid(), paths.process_dir(root)]), flush=True)
for line in sys.stdin:
    if line.strip() == "sweep":
        print(json.dumps(paths.sweep_dead_processes(root)), flush=True)
    elif line.strip() == "read":
        print(json.dumps(float(buf["x"].sum())), flush=True)
"""


UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _unshare_available() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare failed: {probe.stderr.decode()}"


def test_sweeps_spare_live_data_across_pid_namespaces(root) -> None:
    """A process in another PID namespace sharing the root keeps its files and
    its peer entry through our sweeps, and ours through its sweeps; once it is
    killed, a sweep removes both."""
    why = _unshare_available()
    if why:
        pytest.skip(why)
    mine = SharedSpillBuffer.from_config(2**30)
    mine["y"] = np.ones(2**17)
    mine.evict()
    my_dir = paths.process_dir(root)
    registry = PeerRegistry(root)
    registry.register("tcp://10.9.9.9:1")
    child = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            _NAMESPACED_WORKER,
            root,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        pid_inside, their_dir = json.loads(child.stdout.readline())
        assert pid_inside != child.pid  # it really is another PID namespace
        assert paths.sweep_dead_processes(root) == []
        assert os.path.isdir(their_dir)
        assert registry.accepts_handles("tcp://10.1.2.3:4567")
        child.stdin.write("sweep\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == []
        assert os.path.isdir(my_dir) and (mine["y"] == 1).all()
        assert PeerRegistry(root).accepts_handles("tcp://10.9.9.9:1")
        child.stdin.write("read\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline()) == float(np.arange(2**17).sum())
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    # Its init process may still be exiting (dropping its locks) for a moment.
    deadline = time.monotonic() + 30
    while (swept := paths.sweep_dead_processes(root)) == [] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert swept == [their_dir]
    assert not PeerRegistry(root).accepts_handles("tcp://10.1.2.3:4567")
    assert os.listdir(registry.directory) == ["tcp%3A%2F%2F10.9.9.9%3A1"]
    registry.unregister("tcp://10.9.9.9:1")
    mine.close()


def test_a_clean_close_leaves_nothing_behind(root) -> None:
    """Real worker processes (one killed and restarted on the way): after the
    cluster closes, no process directory and no peer entry is left."""
    from dask_shm import SharedMemoryNannyPlugin

    user_root = paths.user_root(root)
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            memory_limit="1 GiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(SharedMemoryNannyPlugin(root=root))
        client.register_plugin(SharedMemoryPlugin(root=root))
        a, b = worker_addresses(client)
        x = client.submit(np.full, 2 * MB, 1.0, workers=[a], key="x")
        assert client.submit(lambda v: float(v.sum()), x, workers=[b]).result() == 2 * MB
        assert (
            client.run(lambda dask_worker: dask_worker.data.shm_counters["link_transfers"])[a] == 1
        )
        assert len(os.listdir(os.path.join(user_root, "peers"))) == 2
        os.kill(client.run(os.getpid, workers=[a])[a], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while a in (workers := worker_addresses(client)) or len(workers) < 2:
            assert time.monotonic() < deadline, "the nanny did not restart the worker"
            time.sleep(0.2)
        client.wait_for_workers(2)
        assert all(client.run(lambda dask_worker: dask_worker.data.shared).values())
        # the killed worker's entry is gone (swept when its successor started)
        assert len(os.listdir(os.path.join(user_root, "peers"))) == 2
    # (the root's identity token stays: see dask_shm.shared.root_id)
    left = [n for n in os.listdir(user_root) if n not in ("peers", "root-id")]
    assert left == []
    assert os.listdir(os.path.join(user_root, "peers")) == []


# -- item 4: accounting by what is actually mapped ------------------------------------


def _fast_bytes(dask_worker) -> tuple[int, int]:
    """(private bytes of the bytes values in memory, the buffer's target)."""
    fast = dask_worker.data.fast
    held = sum(len(v) for v in fast.values() if isinstance(v, (bytes, bytearray)))
    return held, dask_worker.data.n


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_bytes_values_weigh_their_full_size(root, kind) -> None:
    """A worker holding many bytes values read back from its files still
    spills at its target: they come back as private copies, not mappings."""
    config = {
        "distributed.worker.memory.target": 0.5,
        "distributed.worker.memory.spill": False,
        "distributed.worker.memory.pause": False,
        "distributed.worker.memory.terminate": False,
    }
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            memory_limit="128 MiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(SharedMemoryPlugin(root=root))
        values = [client.submit(kind, 4 * MB, key=f"b-{i}") for i in range(40)]
        client.gather(values)  # 160 MiB made, the target is 64 MiB: most spilled
        total = client.submit(lambda *vs: sum(len(v) for v in vs), *values).result()
        assert total == 160 * MB  # every value was read back
        held, target = client.run(_fast_bytes).popitem()[1]
        assert 0 < held <= target


# -- item 5: truncating or overwriting a file behind a value ----------------------------

#: Run as the same uid without the capabilities that bypass file permissions:
#: what a worker of an ordinary user is.
UNPRIVILEGED = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]

_HOLDER = r"""
import json, os, sys
import numpy as np
import dask.config
dask.config.set({"shm.shared-memory.root": sys.argv[1]})
from dask_shm.shared import SharedSpillBuffer
buf = SharedSpillBuffer.from_config(2**30)
buf["x"] = np.arange(2**20, dtype=float)
buf.evict()
value = buf["x"]  # mapped from its file, which is kept
store = buf.store
assert "x" in store.retained
print(json.dumps(store.path("x")), flush=True)
sys.stdin.readline()
print(json.dumps(float(value.sum())), flush=True)
"""

_TAMPER = r"""
import json, os, sys
path = sys.argv[1]
out = {}
try:
    os.truncate(path, 0)
    out["truncate"] = "done"
except OSError as e:
    out["truncate"] = type(e).__name__
try:
    with open(path, "r+b") as f:
        f.seek(4096 * 64)
        f.write(b"\xff" * 4096)
    out["overwrite"] = "done"
except OSError as e:
    out["overwrite"] = type(e).__name__
print(json.dumps(out))
"""


def test_same_user_cannot_truncate_or_overwrite_a_mapped_value(root) -> None:
    """A worker's mapped value survives another process of the same
    (unprivileged) user trying to truncate and overwrite its file: refused,
    the worker lives on (no SIGBUS) and reads the original value."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv command")
    holder = subprocess.Popen(
        [*UNPRIVILEGED, sys.executable, "-c", _HOLDER, root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        path = json.loads(holder.stdout.readline())
        tamper = subprocess.run(
            [*UNPRIVILEGED, sys.executable, "-c", _TAMPER, path],
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(tamper.stdout) == {
            "truncate": "PermissionError",
            "overwrite": "PermissionError",
        }
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert json.loads(holder.stdout.readline()) == float(np.arange(2**20).sum())
    finally:
        holder.stdin.close()  # type: ignore[union-attr]
        rc = holder.wait(timeout=60)
    assert rc == 0


def _overwrite_payload(path: str) -> None:
    """What a privileged process can still do: same size, other bytes."""
    os.chmod(path, 0o600)
    time.sleep(0.02)  # beyond the file system's timestamp granularity
    with open(path, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(b"\xff" * 4096)


def test_an_overwritten_spilled_file_is_an_error_naming_the_key(root) -> None:
    """Where a file can still be changed (by root), reading it back, handing
    it to a peer or evicting a value it backs raises an error naming the key
    instead of silently returning other data."""
    from dask_shm import SpillFileError

    buf = SharedSpillBuffer.from_config(2**30)
    buf["spilled"] = np.arange(2**17, dtype=float)
    buf.evict()
    store = buf.store
    _overwrite_payload(store.path("spilled"))
    with pytest.raises(SpillFileError, match="'spilled'.*overwritten"):
        buf["spilled"]
    assert buf.export("spilled") is None  # refused: the peer gets bytes or an error
    del buf["spilled"]  # the key can still be deleted

    buf["held"] = np.arange(2**17, dtype=float)
    buf.evict()
    value = buf["held"]
    assert "held" in store.retained
    with open(store.path("held"), "r+b") as f:  # root: truncation goes through
        os.chmod(store.path("held"), 0o600)
        time.sleep(0.02)
        f.truncate(os.fstat(f.fileno()).st_size - 4096 * 2)
    del value  # (touching its last pages now would SIGBUS: the residual risk)
    assert buf.evict() == -1  # refused, logged with the key; nothing written
    with pytest.raises(SpillFileError, match="'held'.*truncated"):
        store.release("held", buf.fast["held"])
    buf.close()


# -- item 6: foreign user directory, peer files outside it, in-place writes -------------


def test_a_user_directory_that_is_not_ours_means_private_spilling(root, capfd) -> None:
    """``<root>/dask-shm-<uid>`` made by another user: worker processes with the
    preload log one warning naming the directory and the fix, then spill
    privately with dask-shm's SpillBuffer (not a traceback and stock)."""
    from dask_shm import SpillBuffer

    foreign = os.path.join(root, f"dask-shm-{os.geteuid()}")
    os.mkdir(foreign, 0o777)
    os.chown(foreign, 65534, 65534)
    config = {
        "distributed.worker.preload": ["dask_shm"],
        "distributed.nanny.preload": ["dask_shm"],
        "shm.shared-memory.enabled": True,
        "shm.shared-memory.root": root,
    }
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=1, processes=True, memory_limit="1GiB", dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        kinds = client.run(
            lambda dask_worker: (
                isinstance(dask_worker.data, SpillBuffer),
                isinstance(dask_worker.data, SharedSpillBuffer),
            )
        )
        assert list(kinds.values()) == [(True, False)]
        assert client.submit(lambda: 21 * 2).result() == 42
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "uid 65534" in line]
    assert len(warnings) == 1, err
    assert foreign in warnings[0] and "shm.shared-memory.root" in warnings[0]
    assert "Traceback" not in err
    assert os.listdir(foreign) == []  # nothing of ours went there


def test_peer_files_are_accepted_only_under_our_user_directory(root) -> None:
    """A valid spill file of our uid under the root, but outside
    ``<root>/dask-shm-<uid>``, is refused as a handle."""
    from dask_shm._core import ForgedHandleError
    from dask_shm.shared import transfer
    from dask_shm.shared.store import Handle

    buf = SharedSpillBuffer.from_config(2**30)
    buf["x"] = np.ones(2**17)
    handle = buf.export("x")
    assert handle is not None
    beside = os.path.join(root, "beside")
    os.mkdir(beside, 0o700)
    moved = os.path.join(beside, "x")
    os.link(handle.path, moved)
    os.unlink(handle.path)
    other = SharedSpillBuffer.from_config(2**30)
    with transfer.receiving_into(other):
        with pytest.raises(ForgedHandleError, match="outside"):
            transfer.receive(Handle(moved, handle.size, handle.memory, handle.shareable))
    with pytest.raises(ForgedHandleError, match="outside"):
        other.store.adopt(Handle(moved, handle.size, 0, 0, handle.stem))
    assert other.pending_arrivals() == 0
    buf.close()
    other.close()


def test_tier3_peer_files_are_accepted_only_under_the_disk_user_directory(root, tmp_path) -> None:
    """Tier-3 files live under ``<disk root>/dask-shm-<uid>``: a peer's handle
    there is linked in (same checks as on the tmpfs); the same file moved
    elsewhere on the disk root is refused."""
    from dask_shm._core import ForgedHandleError
    from dask_shm.shared.store import Handle

    disk_root = str(tmp_path / "disk")
    os.mkdir(disk_root)

    def tier3_only() -> SharedSpillBuffer:
        return SharedSpillBuffer.create(
            0,
            root=root,
            disk_root=disk_root,
            budget=0,
            min_size=0,
            min_shared_fraction=0.5,
        )

    sender, receiver = tier3_only(), tier3_only()
    sender["x"] = np.arange(2**17, dtype=float)
    handle = sender.export("x")
    assert handle is not None
    assert handle.path.startswith(paths.user_dir_path(disk_root) + os.sep)
    value = receiver.receive(handle)
    receiver["x"] = value
    assert (receiver["x"] == np.arange(2**17)).all()
    os.unlink(handle.path)

    handle = sender.export("x")
    assert handle is not None
    moved = os.path.join(disk_root, "beside-x")
    os.link(handle.path, moved)
    os.unlink(handle.path)
    with pytest.raises(ForgedHandleError, match="outside"):
        receiver.receive(Handle(moved, handle.size, handle.memory, handle.shareable, "x"))
    sender.close()
    receiver.close()


def _write_in_place(v: np.ndarray) -> None:
    v[:] = 7.0


def _evict_all(dask_worker) -> None:
    while dask_worker.data.fast:
        if dask_worker.data.evict() == -1:
            raise AssertionError("eviction failed")


def test_a_value_written_in_place_survives_eviction_and_transfer(root) -> None:
    """As in stock: a task that writes to its input in place changes the
    value held by the worker; evicting it (back to its file) and sending it to
    another worker keep the change instead of reverting to the file."""
    with process_cluster(2, "1 GiB") as client:
        client.register_plugin(SharedMemoryPlugin(root=root))
        a, b = worker_addresses(client)
        x = client.submit(np.ones, MB, key="x", workers=[a])
        wait(x)
        client.run(_evict_all, workers=[a])
        # x comes back mapped from its file, then is written to in place
        client.submit(_write_in_place, x, workers=[a], pure=False).result()
        retained = client.run(lambda dask_worker: "x" in dask_worker.data.store.retained)
        assert retained[a]
        seen_by_b = client.submit(lambda v: float(v.sum()), x, workers=[b]).result()
        assert seen_by_b == 7.0 * MB
        client.run(_evict_all, workers=[a])
        assert float(client.submit(lambda v: v.sum(), x, workers=[a]).result()) == 7.0 * MB
        assert float(x.result().sum()) == 7.0 * MB


def test_moved_and_born_files_are_sealed_and_checked(root, tmp_path) -> None:
    """Files that change inode under the store keep being checked against
    what they are now: a tier-2 file moved to tier 3 and a born-shared array's
    file adopted by the store are read-only (0400), read back without a false
    alarm, and an overwrite after that is still an error naming the key."""
    import stat

    from dask_shm import SpillFileError
    from dask_shm.shared import born

    buf = SharedSpillBuffer.create(
        64 * MB,
        root=root,
        disk_root=str(tmp_path / "disk"),
        budget=64 * MB,
        min_size=64 * 1024,
        min_shared_fraction=0.5,
    )
    store, tiers = buf.store, buf.store.tiers
    buf["moved"] = np.full(MB, 3.0)
    buf.evict()
    tier2_inode = os.stat(store.path("moved")).st_ino
    tiers.tier("shared").budget.limit = 0
    tiers.enforce()
    assert tiers.tier_of(store.file_of("moved")) == 3
    path = store.path("moved")
    assert os.stat(path).st_ino != tier2_inode
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    value = buf["moved"]  # no "replaced by another file"
    np.testing.assert_array_equal(value, np.full(MB, 3.0))
    del value
    buf.evict()  # the retained value goes back to its (verified) file
    _overwrite_payload(path)
    with pytest.raises(SpillFileError, match="'moved'.*overwritten"):
        buf["moved"]
    del buf["moved"]

    tiers.tier("shared").budget.limit = 64 * MB
    arena = os.path.join(paths.user_root(root), "born-test")
    os.mkdir(arena, 0o700)
    born.start(arena, threshold=MB, budget=64 * MB)
    try:
        with born.allocating():
            a = np.arange(MB // 4, dtype=float)
        assert born.whole_block(a) is not None
        buf["born"] = a
        buf.evict()
        del a
        path = store.path("born")
        assert tiers.tier_of(store.file_of("born")) == 2
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
        np.testing.assert_array_equal(buf["born"], np.arange(MB // 4, dtype=float))
        buf.evict()
        _overwrite_payload(path)
        with pytest.raises(SpillFileError, match="'born'.*overwritten"):
            buf["born"]
    finally:
        buf.close()
        born.stop()


def test_sealing_makes_a_file_read_only_and_never_follows_a_symlink(tmp_path) -> None:
    """A sealed file is 0400 and its fingerprint is the file as it is; a
    symlink in its place is refused and its target left writable."""
    import stat

    from dask_shm.shared import integrity

    path = tmp_path / "file"
    path.write_bytes(b"x" * 100)
    fingerprint = integrity.seal(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    assert fingerprint == integrity.fingerprint(str(path))
    assert fingerprint.size == 100

    target = tmp_path / "target"
    target.write_bytes(b"y")
    os.chmod(target, 0o600)
    link = tmp_path / "link"
    os.symlink(target, link)
    with pytest.raises(OSError):
        integrity.seal(str(link))
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


_TIER3_HOLDER = r"""
import json, sys
from dask_shm.shared import paths
print(json.dumps(paths.process_dir(sys.argv[1])), flush=True)
sys.stdin.readline()
"""


def test_tier3_directories_follow_the_lock_rule(tmp_path) -> None:
    """On the disk root (tier 3) too, a process directory is swept only once
    its lock is free, whatever its name says, and the sweep leaves no
    registry there."""
    disk_root = str(tmp_path / "disk")
    os.mkdir(disk_root)
    child = subprocess.Popen(
        [sys.executable, "-c", _TIER3_HOLDER, disk_root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        theirs = json.loads(child.stdout.readline())
        # A live lock holder whose pid and start time look dead to the old rule.
        fake = os.path.join(os.path.dirname(theirs), "p-4194303-1-deadbeef")
        os.rename(theirs, fake)
        assert paths.sweep_dead_processes(disk_root, peers=False) == []
        assert os.path.isdir(fake)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=60)
    assert paths.sweep_dead_processes(disk_root, peers=False) == [fake]
    assert os.listdir(paths.user_dir_path(disk_root)) == []


class CopiedOnLoad:
    """A value pickled with an out-of-band buffer (so it looks shareable) whose
    constructor copies that buffer: it never lives in a mapping."""

    def __init__(self, data) -> None:
        self.data = bytes(data)

    def __reduce_ex__(self, protocol):
        import pickle

        return type(self), (pickle.PickleBuffer(self.data),)

    def __sizeof__(self) -> int:
        return len(self.data)


def test_a_received_value_that_is_a_private_copy_weighs_its_full_size(root) -> None:
    """A file handed over whose value deserializes into a private copy is not
    kept as if it backed the value: the link goes at once, and the stored
    value weighs its full size."""
    sender = SharedSpillBuffer.from_config(2**30)
    receiver = SharedSpillBuffer.from_config(2**30)
    sender["c"] = CopiedOnLoad(b"x" * (4 * MB))
    handle = sender.export("c")
    assert handle is not None and handle.shareable >= 4 * MB  # looks shareable
    value = receiver.receive(handle)
    assert isinstance(value, CopiedOnLoad) and value.data == b"x" * (4 * MB)
    assert receiver.pending_arrivals() == 0
    assert receiver.store.files.names() == []
    receiver["c"] = value
    assert receiver.fast.weights["c"] >= 4 * MB
    assert "c" not in receiver.store.retained
    sender.close()
    receiver.close()
