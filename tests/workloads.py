"""The coiled/benchmarks workloads (github.com/coiled/benchmarks,
tests/benchmarks/), written again for dask-shm's bench and tests, scaled to a
cluster's memory and ending each in one number so that two runs can be
compared (equal sums).

- ``double_diff`` (test_array.py): ``a[1:, 1:] - b[:-1, :-1]``, a and b each
  the cluster's memory, 20 MiB chunks (coiled scales them by the square root
  of the memory; linearly here, which keeps small clusters small).
- ``anom_mean`` (test_xarray.py): anomalies from a climatology,
  ``arr.groupby(day) - arr.groupby(day).mean()``, then their mean over time;
  half the memory in one-row chunks. Without xarray: the groupby is done by
  strided slices (``day = time % ngroups``), as xarray does without flox.
- ``climatic_mean`` (test_xarray.py): a 6-d array of twice the memory in
  ``(1, 1, lat, lead, level, lon)`` chunks, mean over ``init_date`` by 10
  groups; chunks 16x smaller than coiled's 200 MiB, 10 dates and as many
  ensemble members as the size takes (coiled: 28 members, the dates scaled).
- ``vorticity`` (test_array.py, dask/distributed#6571): ``dx * pad(u) -
  dy * pad(v)``, u and v each 0.85x the memory in ``(side, side, 1)`` chunks
  of 1/100th of it (coiled: 1/400th), each padded by one wrapped row that
  is then merged back into the chunks: the pad's row moves between workers
  and the graph stops being blockwise.
- ``rechunk_p2p`` (test_rechunk.py ``test_tiles_to_rows``): 1.5x the memory
  in 8.5 MiB tiles, rechunked to full columns with ``array.rechunk.method:
  p2p``, then summed; ``array.chunk-size`` (what "auto" columns aim at) is
  1/600th of the memory as coiled's 128 MiB is of theirs (at least 1 MiB).
- ``shuffle_p2p`` (test_dataframe.py ``test_shuffle``): a timeseries of 100
  float columns, half the memory in partitions of 1/64th of it, shuffled on
  a column with ``shuffle_method="p2p"``.
- ``dataframe_align`` (test_dataframe.py ``test_dataframe_align``): such a
  timeseries of half the memory minus one of a quarter with twice as many
  rows a day, half of whose days fall within the first's range (coiled's
  ranges do not overlap, so its partitions are only put side by side; here
  aligning them cuts and joins partitions across workers).
- ``merge_p2p`` (test_join.py ``test_join_big``): two such timeseries of a
  quarter of the memory each, inner-joined on an integer column of about as
  many values as rows (each row matches about one: coiled's key, scaled by
  1e9, matches almost none at these sizes), by P2P hash join.
- ``set_index_p2p`` (test_join.py ``test_set_index``, not persisted): such
  a timeseries of a quarter of the memory, ``set_index`` on a float column
  by P2P (dask first reads the column once for the divisions). With half
  the memory, as the shuffle, a stock worker of 512 MiB paused for good in
  one of four stock runs (424 MiB resident, three keys in memory, nothing
  to spill) while the scheduler waited for it to run the shuffle's
  outputs; shared mode finished its three.
- ``spilling`` (test_spill.py, ``release``): an array of 1.79x the memory
  persisted (it spills), then its sum, the array released meanwhile; chunks
  of 1/256th of the cluster's memory (coiled's 128 MiB of 36 GiB: 4 MiB for
  2 workers x 512 MiB). Until stop 46 they were dask's "auto" 128 MiB, a
  quarter of a 512 MiB worker: with xarray and scipy installed, which dask
  imports in every worker that loads dask.array (about 170 MiB at start
  instead of 120), three such chunks passed the nanny's 95% before the
  first could be spilled, and both stock and shared mode lost workers in a
  loop (KilledWorker) or waited on a nanny that stopped restarting them.
- ``quadratic_mean`` (test_xarray.py ``test_quadratic_mean``, array
  backend): an xarray Dataset of two random variables ``(time, face, j, i)``
  of the memory each, in chunks of 10 time steps (11.7 MiB); their squares
  and their product, averaged over time. Its partial means (1.2 MiB each)
  move between workers.
- ``monthly_map_reduce``, ``monthly_cohorts``, ``monthly_chunked_cohorts``
  (test_xarray.py ``test_xarray_groupby_reduction``, whose dataset is on S3:
  here random data of its layout): two years of 3-hourly ``(time, y, x)``
  fields of the cluster's memory in ``(224, 68, 68)`` chunks (8.3 MiB; the
  zarr store's 224 time steps), ``groupby("time.month").mean()`` by flox
  with ``method="map-reduce"``, ``"cohorts"``, and ``"cohorts"`` after
  rechunking time by month (``TimeResampler("ME")``).
- ``bag_groupby`` (not coiled's: dask.bag, whose partitions are lists of
  Python objects): records as dicts, a 32nd of the memory per partition
  by dask's ``sizeof``, grouped on a key into 4 partitions by a task-based
  shuffle (pieces of a 128th of the memory cross workers), each group's
  integer scores summed: the pieces are values shared mode finds not worth
  sharing and sends as bytes.
- ``matmul`` (not coiled's: ``dask-shm demo``'s n^2 workload):
  ``(x @ x.T).sum()``, x 1/16th of the memory (2 GiB for 8 workers x 4 GiB,
  the size issue 26 measured) as ``n`` by ``4 n`` floats in 32 row blocks:
  every output block needs two row blocks, a pure all-to-all.

The xarray workloads use xarray and flox, as coiled's do (test dependencies).

Each workload is a function ``(client, memory, scale) -> float`` that runs the
computation on ``client`` and returns its result; ``memory`` is the
cluster's memory in bytes and ``scale`` multiplies every size (1.0: coiled's
proportions). Data are seeded: the same arguments give the same numbers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.array import PerformanceWarning
from distributed import Client, wait

MIB = 2**20

Workload = Callable[[Client, int, float], float]


def square_side(nbytes: float, itemsize: int = 8) -> int:
    """Side of a square float array of about ``nbytes``."""
    return max(1, int(math.sqrt(nbytes / itemsize)))


def _rng(seed: int) -> Any:
    return da.random.default_rng(seed)


def double_diff(client: Client, memory: int, scale: float) -> float:
    n = square_side(memory * scale)
    a = _rng(1).random((n, n), chunks="20MiB")
    b = _rng(2).random((n, n), chunks="20MiB")
    diff = a[1:, 1:] - b[:-1, :-1]
    return float(client.compute(diff.sum()).result())


def anom_mean(client: Client, memory: int, scale: float) -> float:
    row = MIB // 8
    rows = max(2, int(memory * scale / 2 / MIB))
    data = _rng(3).random((rows, row), chunks=(1, row))
    ngroups = max(1, rows // 100)
    clim = da.stack([data[g::ngroups].mean(axis=0) for g in range(ngroups)])
    day = np.arange(rows) % ngroups
    anom = data - clim[day]
    return float(client.compute(anom.mean(axis=0).sum()).result())


def climatic_mean(client: Client, memory: int, scale: float) -> float:
    chunk = (1, 1, 24, 21, 45, 72)
    chunk_bytes = 8 * math.prod(chunk)
    ensemble = max(1, int(memory * scale * 2 / (10 * chunk_bytes)))
    data = _rng(4).random((ensemble, 10, *chunk[2:]), chunks=chunk)
    clim = da.stack([data[:, g::10].mean(axis=1) for g in range(10)], axis=1)
    return float(client.compute(clim.sum()).result())


def vorticity(client: Client, memory: int, scale: float) -> float:
    side = square_side(memory * scale / 100)
    depth = max(2, int(memory * scale * 0.85 / (side * side * 8)))
    u = _rng(21).random((side, side, depth), chunks=(side, side, 1))
    v = _rng(22).random((side, side, depth), chunks=(side, side, 1))
    dx = _rng(23).random((side + 1, side), chunks=(side + 1, side))
    dy = _rng(24).random((side + 1, side), chunks=(side + 1, side))

    def pad_rechunk(arr: da.Array) -> da.Array:
        padded = da.pad(arr, pad_width=[(0, 1), (0, 0), (0, 0)], mode="wrap")
        chunks = list(padded.chunks)
        chunks[0] = (side + 1,)
        return padded.rechunk(tuple(chunks))

    result = dx[..., None] * pad_rechunk(u) - dy[..., None] * pad_rechunk(v)
    return float(client.compute(result.sum()).result())


def rechunk_p2p(client: Client, memory: int, scale: float) -> float:
    n = square_side(memory * scale * 1.5)
    # "auto" columns as big as coiled's are for coiled's memory: 128 MiB of
    # ~77 GiB, about 1/600th.
    column = max(MIB, int(memory * scale / 600))
    with dask.config.set({"array.rechunk.method": "p2p", "array.chunk-size": column}):
        a = _rng(5).random((n, n), chunks="8.5MiB")
        total = a.rechunk((-1, "auto")).sum()
    return float(client.compute(total).result())


#: float columns of :func:`_timeseries`, and the bytes of one row (the index too)
_COLUMNS = 100
_ROW_BYTES = (_COLUMNS + 1) * 8


def _timeseries(
    nbytes: float, part_bytes: int, seed: int, rows_factor: int = 1, start: str = "2020-01-01"
) -> Any:
    """A timeseries of 100 float columns of about ``nbytes`` in partitions of
    about ``part_bytes`` (one a day) from ``start``, as coiled's
    ``timeseries_of_size``; ``rows_factor`` times as many rows a day in
    partitions as many times larger."""
    from dask.datasets import timeseries

    dtypes = {str(i): float for i in range(_COLUMNS)}
    rows_a_day = max(1, part_bytes // _ROW_BYTES) * rows_factor
    days = _days(nbytes, part_bytes, rows_factor)
    return timeseries(
        start=start,
        end=str(np.datetime64(start) + np.timedelta64(days, "D")),
        freq=f"{86_400_000 // rows_a_day}ms",
        partition_freq="24h",
        dtypes=dtypes,
        seed=seed,
    )


def _days(nbytes: float, part_bytes: int, rows_factor: int = 1) -> int:
    """Days (partitions) of :func:`_timeseries`."""
    return max(2, round(nbytes / (part_bytes * rows_factor)))


def _part_bytes(memory: int, scale: float) -> int:
    # Partitions of 1/64th of the memory (coiled's: 55 MiB of 77 GiB, in
    # workers of 8 GiB; theirs would stall workers of a few hundred MiB).
    return max(MIB, int(memory * scale / 64))


def _rounded_sum(column: Any) -> Any:
    """A float sum that does not depend on the rows' order (each rounded to
    an integer after scaling by 2**20): row order within a partition depends
    on arrival order."""
    return (column * 2**20).round().sum()


def _order_free_total(df: Any) -> Any:
    """Column "1"'s :func:`_rounded_sum` plus the frame's size."""
    return _rounded_sum(df["1"]) + df.size


def shuffle_p2p(client: Client, memory: int, scale: float) -> float:
    df = _timeseries(memory * scale / 2, _part_bytes(memory, scale), seed=6)
    shuffled = df.shuffle("0", shuffle_method="p2p").map_partitions(lambda x: x)
    return float(client.compute(_order_free_total(shuffled)).result())


def dataframe_align(client: Client, memory: int, scale: float) -> float:
    part_bytes = _part_bytes(memory, scale)
    df = _timeseries(memory * scale / 2, part_bytes, seed=31)
    # half of its days before df's first, half within df's range
    overlap = _days(memory * scale / 4, part_bytes, rows_factor=2) // 2
    start = str(np.datetime64("2020-01-01") - np.timedelta64(overlap, "D"))
    denser = _timeseries(memory * scale / 4, part_bytes, seed=32, rows_factor=2, start=start)
    diff = denser - df
    total = diff.count().sum() + _rounded_sum(diff["1"].fillna(0))
    return float(client.compute(total).result())


def _with_predicate(df: Any, values: int) -> Any:
    # coiled's join key: an integer column of about as many values as rows
    # (``values``; coiled's ``* 1e9`` leaves almost no row a match at these
    # sizes, and an empty join would check nothing)
    df["predicate"] = df["0"] * (values / 2)
    return df.astype({"predicate": "int"})


def merge_p2p(client: Client, memory: int, scale: float) -> float:
    part_bytes = _part_bytes(memory, scale)
    side_bytes = memory * scale / 4
    rows = int(side_bytes // _ROW_BYTES)
    left = _with_predicate(_timeseries(side_bytes, part_bytes, seed=11), rows)
    right = _with_predicate(_timeseries(side_bytes, part_bytes, seed=12), rows)
    with dask.config.set({"dataframe.shuffle.method": "p2p"}):
        joined = left.merge(right, on="predicate", how="inner")
        # keeps dask from pruning the columns the join would move
        joined = joined.map_partitions(lambda x: x)
        matched = _rounded_sum(joined["1_x"]) + _rounded_sum(joined["1_y"])
        total = matched + joined["predicate"].sum() + joined.size
        # (inside: dask picks the shuffle method when it lowers the graph)
        return float(client.compute(total).result())


def set_index_p2p(client: Client, memory: int, scale: float) -> float:
    df = _timeseries(memory * scale / 4, _part_bytes(memory, scale), seed=13)
    with dask.config.set({"dataframe.shuffle.method": "p2p"}):
        indexed = df.set_index("0").map_partitions(lambda x: x)
        total = _order_free_total(indexed) + _rounded_sum(indexed.index.to_series())
        return float(client.compute(total).result())


def spilling(client: Client | None, memory: int, scale: float) -> float:
    """Without a client (dask's local schedulers): the same sum, never spilled."""
    n = square_side(memory * scale * 1.79)
    a = _rng(7).random((n, n), chunks=f"{max(MIB, memory // 256)}B").persist()
    if client is not None:
        wait(a)
    b = a.sum().persist()
    del a
    return float(b.compute())


def quadratic_mean(client: Client, memory: int, scale: float) -> float:
    import xarray as xr

    j, i = 320, 480  # 1.2 MiB a time step (coiled: 987 x 1920)
    steps = max(20, int(memory * scale / (j * i * 8)))
    shape, chunks = (steps, 1, j, i), (10, 1, -1, -1)
    rng = _rng(9)
    dims = ["time", "face", "j", "i"]
    ds = xr.Dataset(
        {
            "anom_u": (dims, rng.random(shape, chunks=chunks)),
            "anom_v": (dims, rng.random(shape, chunks=chunks)),
        }
    )
    quad = ds**2
    quad["uv"] = ds.anom_u * ds.anom_v
    mean = quad.mean("time")
    total = sum(mean[name].data.sum() for name in ("anom_u", "anom_v", "uv"))
    return float(client.compute(total).result())


def _monthly_mean(client: Client, memory: int, scale: float, method: str) -> float:
    import pandas as pd
    import xarray as xr

    time = pd.date_range("2001-01-01", "2002-12-31 21:00", freq="3h")
    side = 68
    blocks = max(1, round(memory * scale / (len(time) * side * side * 8)))
    data = _rng(10).random((len(time), side, side * blocks), chunks=(224, side, side))
    arr = xr.DataArray(data, dims=["time", "y", "x"], coords={"time": time})
    if method == "chunked-cohorts":
        arr = arr.chunk(time=xr.groupers.TimeResampler("ME"))
        method = "cohorts"
    mean = arr.groupby("time.month").mean(method=method)
    return float(client.compute(mean.data.sum()).result())


def monthly_map_reduce(client: Client, memory: int, scale: float) -> float:
    return _monthly_mean(client, memory, scale, "map-reduce")


def monthly_cohorts(client: Client, memory: int, scale: float) -> float:
    return _monthly_mean(client, memory, scale, "cohorts")


def monthly_chunked_cohorts(client: Client, memory: int, scale: float) -> float:
    return _monthly_mean(client, memory, scale, "chunked-cohorts")


#: dask's ``sizeof`` of one of bag_groupby's records (a dict of four
#: fields, one a list of three strings), about
_RECORD_BYTES = 800


def _records(part: list[int], per_part: int) -> list[dict[str, Any]]:
    return [
        {"id": i * per_part + j, "name": f"user-{j}", "score": j % 97, "tags": ["a", "b", str(j)]}
        for i in part
        for j in range(per_part)
    ]


def bag_groupby(client: Client, memory: int, scale: float) -> float:
    import dask.bag as db

    parts = 32
    per_part = max(100, int(memory * scale / 32 / _RECORD_BYTES))
    bag = db.from_sequence(range(parts), npartitions=parts).map_partitions(_records, per_part)
    groups = bag.groupby(lambda r: r["id"] % 64, shuffle="tasks", npartitions=4)
    sums = groups.map(lambda group: sum(r["score"] for r in group[1]))
    return float(client.compute(sums.sum()).result())


def matmul(client: Client, memory: int, scale: float) -> float:
    n = max(32, square_side(memory * scale / 16 / 4))
    x = _rng(8).random((n, 4 * n), chunks=(-(-n // 32), 4 * n))
    with warnings.catch_warnings():
        # (row blocks)**2 output blocks: that is the point of the workload.
        warnings.simplefilter("ignore", PerformanceWarning)
        total = (x @ x.T).sum()
    return float(client.compute(total).result())


WORKLOADS: dict[str, Workload] = {
    "double_diff": double_diff,
    "anom_mean": anom_mean,
    "climatic_mean": climatic_mean,
    "vorticity": vorticity,
    "rechunk_p2p": rechunk_p2p,
    "shuffle_p2p": shuffle_p2p,
    "dataframe_align": dataframe_align,
    "merge_p2p": merge_p2p,
    "set_index_p2p": set_index_p2p,
    "spilling": spilling,
    "matmul": matmul,
    "bag_groupby": bag_groupby,
    "quadratic_mean": quadratic_mean,
    "monthly_map_reduce": monthly_map_reduce,
    "monthly_cohorts": monthly_cohorts,
    "monthly_chunked_cohorts": monthly_chunked_cohorts,
}
