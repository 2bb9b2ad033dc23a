"""Errors from the Rust store: the same OSError subclass as stock, naming the path."""

from __future__ import annotations

import gc
import os
import shutil
import sys

import pytest
from distributed.spill import SpillBuffer as StockSpillBuffer

import dask_shm
from dask_shm._core import FileStore


def stock_error(directory: str) -> OSError:
    """What stock raises for ``directory``. Its half-built SpillBuffer complains
    from zict's ``__del__``; that noise is swallowed here, where it happens."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        try:
            StockSpillBuffer(directory, target=1)
        except OSError as e:
            error = e
        else:
            raise AssertionError("stock accepted the directory")
        error.__traceback__ = None  # frames holding the half-built buffer
        gc.collect()
    finally:
        sys.unraisablehook = hook
    return error


def regular_file(tmp_path) -> str:
    path = tmp_path / "file"
    path.write_bytes(b"not a directory")
    return str(path)


@pytest.mark.parametrize(
    "make_directory",
    [
        pytest.param(lambda tmp: os.path.join(regular_file(tmp), "spill"), id="under-a-file"),
        pytest.param(lambda tmp: os.path.join(regular_file(tmp), "a", "b"), id="deep-under-a-file"),
        pytest.param(regular_file, id="is-a-file"),
    ],
)
def test_bad_spill_directory_raises_what_stock_raises(tmp_path, make_directory):
    directory = make_directory(tmp_path)
    stock = stock_error(directory)
    with pytest.raises(OSError) as info:
        dask_shm.SpillBuffer(directory, target=1)
    ours = info.value
    assert type(ours) is type(stock) is NotADirectoryError
    assert (ours.errno, ours.strerror, ours.filename) == (
        stock.errno,
        stock.strerror,
        stock.filename,
    )
    assert str(ours) == str(stock)
    with pytest.raises(NotADirectoryError, match="Not a directory: '.*'"):
        FileStore(directory)


def test_symlinked_spill_directory_is_refused_naming_it(tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError) as info:
        FileStore(str(link))
    assert info.value.filename == str(link)
    assert "symbolic link" in info.value.strerror


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create another user's directory")
def test_another_users_spill_directory_is_a_permission_error(tmp_path):
    directory = tmp_path / "theirs"
    directory.mkdir()
    os.chown(directory, 12345, 12345)
    with pytest.raises(PermissionError) as info:
        FileStore(str(directory))
    assert info.value.filename == str(directory)
    assert "belongs to uid 12345" in info.value.strerror


def test_spilling_into_a_vanished_directory_names_it(tmp_path):
    directory = str(tmp_path / "spill")
    store = FileStore(directory)
    shutil.rmtree(directory)
    with pytest.raises(FileNotFoundError) as info:
        store.put("key", [b"x" * 100], 100)
    assert info.value.filename == directory
    assert len(store) == 0  # nothing half-stored


def test_deleting_from_a_directory_that_became_a_file_names_the_file(tmp_path):
    directory = tmp_path / "spill"
    store = FileStore(str(directory))
    name, _ = store.put("key", [b"x" * 100], 100)
    shutil.rmtree(directory)
    directory.write_bytes(b"")
    with pytest.raises(NotADirectoryError) as info:
        store.delete(name)
    assert info.value.filename == str(store.path(name))
