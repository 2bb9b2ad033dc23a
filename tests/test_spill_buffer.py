"""Behaviour of dask_shm.SpillBuffer through its public and inspection surface."""

from __future__ import annotations

import os
from collections import defaultdict
from urllib.parse import quote

import dask.config
import numpy as np
import pytest
from distributed.metrics import context_meter
from distributed.spill import SpillBuffer as StockSpillBuffer
from distributed.spill import SpilledSize

from dask_shm import FileStore, SpillBuffer
from dask_shm._core import FRAME_ALIGN_MIN_LEN, FRAME_ALIGNMENT


def files_in(directory: str) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)}


def test_inspection_surface_matches_what_tools_read(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=10_000)
    keys = ["a", ("b", 1), "c/with/slash", "..", "x" * 400]
    for i, key in enumerate(keys):
        buf[key] = np.full(1_000, i, dtype="u8")  # 8000 bytes each: all but the last spill
    assert list(buf.fast) == [keys[-1]]
    assert buf.fast.weights[keys[-1]] == buf.fast.total_weight
    assert set(buf.slow) == set(keys[:-1])
    assert set(buf.memory) == set(buf.fast) and set(buf.disk) == set(buf.slow)

    slow = buf.store
    assert set(slow.weight_by_key) == set(keys[:-1])
    assert sum(slow.weight_by_key.values(), SpilledSize(0, 0)) == slow.total_weight
    assert slow.total_weight == buf.spilled_total

    # One file per spilled key, named after the key, whose size is the
    # disk size accounted for it.
    on_disk = files_in(str(tmp_path))
    assert len(on_disk) == 4
    for key in keys[:-1]:
        name = os.path.basename(slow.path(key))
        assert on_disk[name] == slow.weight_by_key[key].disk
        if len(str(key)) < 100 and key != "..":
            assert name.split("#")[0] == quote(str(key), safe="")
    assert sum(on_disk.values()) == buf.spilled_total.disk

    for i, key in enumerate(keys):
        assert (buf[key] == i).all()


def test_deleting_keys_removes_files_and_accounting(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=1)
    for i in range(5):
        buf[f"k{i}"] = np.zeros(100)
    assert len(files_in(str(tmp_path))) == 5
    for i in range(5):
        del buf[f"k{i}"]
    assert files_in(str(tmp_path)) == {}
    assert buf.spilled_total == (0, 0)
    assert len(buf) == 0
    with pytest.raises(KeyError):
        del buf["k0"]
    with pytest.raises(KeyError):
        buf["k0"]


def test_referenced_value_is_not_duplicated_on_unspill(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=100)
    buf["x"] = np.arange(1_000)  # heavier than target: lives in slow
    first = buf["x"]
    assert buf["x"] is first  # served from the weak-value cache
    del first
    assert buf["x"] is not None


def test_evict_returns_the_weight_and_respects_lru_order(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=100_000)
    buf["old"] = np.zeros(100)
    buf["new"] = np.zeros(200)
    _ = buf["old"]  # now the most recently used
    assert buf.evict() == buf.fast.weight("new", np.zeros(200))
    assert set(buf.slow) == {"new"}
    assert buf.evict() > 0
    assert set(buf.slow) == {"new", "old"}
    assert not buf.fast


def test_same_metric_labels_as_stock(tmp_path):
    """Spans and the dashboard read cumulative_metrics and context_meter
    digests; ours must emit the same labels for the same operations."""

    def run(cls: type) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        seen: defaultdict[tuple[str, str], float] = defaultdict(float)

        def outer(label: object, value: float, unit: str) -> None:
            seen[str(label), unit] += value

        buf = cls(str(tmp_path / cls.__module__), target=10_000)
        with context_meter.add_callback(outer):
            buf["a"] = np.zeros(1_000)
            buf["b"] = np.zeros(1_000)  # spills a
            _ = buf["b"]  # memory read
            _ = buf["a"]  # disk read, spills b
            buf.evict()
        return set(buf.cumulative_metrics), set(seen)

    stock_cumulative, stock_outer = run(StockSpillBuffer)
    ours_cumulative, ours_outer = run(SpillBuffer)
    assert ours_cumulative == stock_cumulative
    assert ours_outer == stock_outer
    assert {("disk-write", "bytes"), ("disk-read", "count"), ("memory-read", "count")} <= (
        ours_cumulative
    )


def test_metric_values_count_real_io(tmp_path):
    buf = SpillBuffer(str(tmp_path), target=10_000)
    buf["a"] = np.zeros(1_000)
    buf["b"] = np.zeros(1_000)
    m = buf.cumulative_metrics
    assert m["disk-write", "count"] == 1
    assert m["disk-write", "bytes"] == buf.spilled_total.disk
    _ = buf["b"]
    assert m["memory-read", "count"] == 1
    assert m["memory-read", "bytes"] == buf.fast.weights["b"]
    _ = buf["a"]
    assert m["disk-read", "count"] == 1
    assert m["disk-read", "bytes"] >= 8_000


# zict's __del__ complains about the buffers whose construction was refused
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_spill_compression_config_is_honoured(tmp_path):
    value = np.zeros(100_000)  # 800 kB of zeros compresses to almost nothing
    with dask.config.set({"distributed.worker.memory.spill-compression": "zlib"}):
        compressed = SpillBuffer(str(tmp_path / "z"), target=1)
    with dask.config.set({"distributed.worker.memory.spill-compression": False}):
        plain = SpillBuffer(str(tmp_path / "p"), target=1)
    compressed["x"] = value
    plain["x"] = value
    assert compressed.spilled_total.disk < 20_000 < plain.spilled_total.disk
    assert (compressed["x"] == 0).all() and (plain["x"] == 0).all()
    # An invalid setting is refused when the buffer is built, as by stock's.
    with dask.config.set({"distributed.worker.memory.spill-compression": "nonsense"}):
        with pytest.raises(ValueError, match="spill-compression"):
            StockSpillBuffer(str(tmp_path / "stock"), target=1)
        with pytest.raises(ValueError, match="spill-compression"):
            SpillBuffer(str(tmp_path / "bad"), target=1)


def test_the_store_compresses_as_told_not_as_configured(tmp_path, shm_dir):
    """The config is read by the buffer that builds a store, never by a
    store: a store is told its codec, and a shared-mode buffer (whose
    mapped files are never compressed) does not care what is configured."""
    from dask_shm.shared import SharedSpillBuffer
    from dask_shm.spill_store import SpillStore

    value = np.zeros(100_000)
    with dask.config.set({"distributed.worker.memory.spill-compression": "nonsense"}):
        told = SpillStore(str(tmp_path / "told"), compression="zlib")
        untold = SpillStore(str(tmp_path / "untold"))
        shared = SharedSpillBuffer.create(
            1,
            root=shm_dir,
            disk_root=str(tmp_path / "disk"),
            budget="1 MiB",
            min_size=0,
            min_shared_fraction=0.5,
        )
    told["x"] = untold["x"] = value
    assert told.total_weight.disk < 20_000 < untold.total_weight.disk
    assert (told["x"] == 0).all() and (untold["x"] == 0).all()
    shared["x"] = value
    assert shared.spilled_total.disk > 800_000 and (shared["x"] == 0).all()
    shared.close()


def test_many_value_types_round_trip(tmp_path):
    pd = pytest.importorskip("pandas")
    buf = SpillBuffer(str(tmp_path), target=1)
    values = {
        "int": 12345,
        "bytes": b"x" * 10_000,
        "dict": {"a": [1, 2, 3], "b": "text"},
        "array2d": np.arange(10_000, dtype="f4").reshape(100, 100)[:, ::2],
        "frame": pd.DataFrame({"x": np.arange(1000), "s": ["a"] * 1000}),
        "empty": np.array([]),
    }
    for key, value in values.items():
        buf[key] = value
    assert set(buf.slow) == set(values) - {"empty"}  # sizeof 0 fits any target
    for key, value in values.items():
        got = buf[key]
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(got, value)
        elif isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(got, value)
        else:
            assert got == value


def test_file_store_mapped_frames_are_aligned_private_and_writable(tmp_path):
    store = FileStore(str(tmp_path))
    payload = np.arange(FRAME_ALIGN_MIN_LEN + 1001, dtype="u1")
    stored = store.put("k", [b"hdr", memoryview(payload), b"", payload.tobytes()], memory=7)
    assert stored is not None
    name, disk = stored
    assert store.sizes(name) == (7, disk)
    assert os.path.getsize(store.path(name)) == disk
    frames = store.read_mapped(name)
    n = payload.nbytes
    assert [f.nbytes for f in frames] == [3, n, 0, n]
    arr = np.frombuffer(frames[1], dtype="u1")
    assert arr.ctypes.data % FRAME_ALIGNMENT == 0
    assert not frames[1].readonly
    arr[:] = 0  # copy-on-write: the file is untouched
    assert bytes(store.read(name)[1]) == payload.tobytes()
    assert bytes(store.read(name)[3]) == payload.tobytes()
    assert store.delete(name) == (7, disk)
    assert store.delete(name) is None
    assert arr.sum() == 0  # the mapping outlives the deleted file


def test_file_store_refuses_over_capacity_without_writing(tmp_path):
    store = FileStore(str(tmp_path))
    assert store.put("a", [b"x" * 1000], memory=1, max_disk=1500) is not None
    assert store.put("b", [b"x" * 1000], memory=1, max_disk=1500) is None
    assert len(files_in(str(tmp_path))) == 1
    assert store.total()[1] == os.path.getsize(store.path(store.names()[0]))


def test_file_store_rejects_bad_names_and_foreign_directories(tmp_path):
    store = FileStore(str(tmp_path / "d"))
    for bad in ["", "a/b", "../escape", ".hidden"]:
        with pytest.raises(OSError):
            store.put(bad, [b"x"], memory=1)
    with pytest.raises(KeyError):
        store.read("missing#0")
    os.symlink(tmp_path / "d", tmp_path / "link")
    with pytest.raises(OSError, match="not a plain directory"):
        FileStore(str(tmp_path / "link"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        FileStore(str(tmp_path / "file"))
    assert oct(os.stat(tmp_path / "d").st_mode & 0o777) == "0o700"


def test_parts_passed_in_build_the_buffer(tmp_path):
    """A buffer built on SpillBuffer passes its store, weight and charge in:
    the charge (bytes held outside the values, capped at half the target)
    counts against ``target``, the given store is the one spilled to, and
    the buffer has all the state zict.Buffer's own __init__ sets up (it
    builds that state itself, with the charged LRU: a zict that adds state
    shows here)."""
    import zict

    from dask_shm.spill_store import SpillStore

    store = SpillStore(str(tmp_path / "given"))
    buf = SpillBuffer(None, 1000, store=store, weight=lambda k, v: len(v), charge=lambda: 400)
    assert set(vars(zict.Buffer({}, {}, n=1))) <= set(vars(buf))
    assert buf.store is store and buf.cumulative_metrics is store.cumulative_metrics
    buf["a"] = b"x" * 300
    buf["b"] = b"x" * 300
    assert set(buf.memory) == {"a", "b"}  # 600 + 400 is not above 1000
    buf["c"] = b"x" * 300
    assert set(buf.memory) == {"b", "c"} and set(store) == {"a"}
    assert buf["a"] == b"x" * 300
    buf.close()

    capped = SpillBuffer(
        None,
        1000,
        store=SpillStore(str(tmp_path / "capped")),
        weight=lambda k, v: len(v),
        charge=lambda: 10**9,
    )
    capped["a"] = b"x" * 400
    capped["b"] = b"x" * 100
    assert set(capped.memory) == {"a", "b"}, "the charge is at most half the target"
    capped.close()

    with pytest.raises(ValueError, match="belong to the given store"):
        SpillBuffer(str(tmp_path / "both"), 1000, store=SpillStore(str(tmp_path / "s")))


def test_spill_directory_may_be_a_path_as_in_stock(tmp_path):
    """distributed's own tests pass a pathlib.Path."""
    buf = SpillBuffer(tmp_path / "spill", target=100)
    buf["a"] = "a" * 200  # larger than target: straight to disk
    assert set(buf.disk) == {"a"} and os.listdir(tmp_path / "spill")
    assert buf["a"] == "a" * 200
    buf.close()
