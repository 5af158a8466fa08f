"""Arrays in storage (`storage.write_array` / `read_array`): what staging's id hashes,
tokenization's word-piece counts, BM25's index shards and the query vectors store. They read
back equal, and an object array (a pickle) planted in their place is refused, never run."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core import storage
from pipeline.core.errors import StorageError


class _WritesAFile:
    """Unpickled, it writes ``path``: the proof that a load ran what storage held."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_array_is_read_back_equal_in_dtype_and_shape(tmp_path):
    hashes = np.arange(10, dtype=np.uint64) * np.uint64(2**61)
    storage.write_array(str(tmp_path / "a" / "hashes.npy"), hashes)
    back = storage.read_array(str(tmp_path / "a" / "hashes.npy"))
    assert back.dtype == hashes.dtype and np.array_equal(back, hashes)


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    """Mutation: ``allow_pickle=True`` in ``read_array``: the planted object's file is written
    and nothing is refused."""
    proof = tmp_path / "ran"
    planted = np.array([_WritesAFile(str(proof))], dtype=object)
    with open(tmp_path / "counts.npy", "wb") as f:
        np.save(f, planted, allow_pickle=True)
    with pytest.raises(StorageError, match="counts.npy: not a plain .npy array"):
        storage.read_array(str(tmp_path / "counts.npy"))
    assert not proof.exists()


def test_an_object_array_is_never_written(tmp_path):
    with pytest.raises(ValueError):
        storage.write_array(str(tmp_path / "x.npy"), np.array([{"a": 1}], dtype=object))
    assert not (tmp_path / "x.npy").exists()
