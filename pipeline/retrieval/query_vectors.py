"""Query vectors kept in storage, a block of queries to a file, for a search over more
queries than a driver should hold: the encoder actors write each block's vectors
(:func:`write_vectors`), and each searcher reads a block when it is asked it
(:class:`StoredRows`). The driver never holds a query's vector (BERT-base's for MS MARCO's
502k training queries: 1.5 GB)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from pipeline.core import storage
from pipeline.core.parts import part_uri

QUERY_VECTORS = "query_vectors.npy"  # a block's file among a stage's parts


def write_vectors(uri: str, vectors: np.ndarray) -> None:
    storage.write_array(uri, np.ascontiguousarray(vectors, dtype=np.float32))


def read_vectors(uri: str) -> np.ndarray:
    return storage.read_array(uri)


class StoredQueryVectors:
    """The vectors of ``rows`` queries, block ``b`` (queries ``b * block`` up to ``(b + 1) *
    block``) stored at ``uri_of(b)``. Sliced like an array of rows, as a shard fan-out slices
    its queries, it reads only the blocks the slice covers."""

    def __init__(self, uri_of: Callable[[int], str], rows: int, block: int):
        self.uri_of, self.rows, self.block = uri_of, rows, block

    @classmethod
    def in_parts(cls, folder: str, rows: int, block: int) -> StoredQueryVectors:
        """Each block's vectors beside the block's other part files in ``folder``
        (:mod:`pipeline.core.parts`): claimed, resumed and removed with them."""
        return cls(functools.partial(part_uri, folder, name=QUERY_VECTORS), rows, block)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice):
            raise TypeError("stored query vectors are read by slices of rows")
        start, stop, step = rows.indices(self.rows)
        if step != 1:
            raise ValueError("stored query vectors are read by contiguous slices")
        first, end = start // self.block, -(-stop // self.block)
        parts = [self.read(b) for b in range(first, end)] if stop > start else []
        if not parts:
            return np.zeros((0, 0), np.float32)
        offset = start - first * self.block
        return np.concatenate(parts)[offset : offset + stop - start]

    def rows_between(self, start: int, stop: int) -> StoredRows:
        return StoredRows(self, start, min(stop, self.rows))

    def stored(self, b: int) -> bool:
        return storage.exists(self.uri_of(b))

    def read(self, b: int) -> np.ndarray:
        return read_vectors(self.uri_of(b))


@dataclasses.dataclass(frozen=True)
class StoredRows:
    """Rows ``start`` up to ``stop`` of stored query vectors, as a search block is sent: each
    searcher reads them from storage itself, so the driver neither reads them nor puts them
    in its node's object store (where every block's pages would count in its memory)."""

    vectors: StoredQueryVectors
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def read(self) -> np.ndarray:
        return self.vectors[self.start : self.stop]


def read_blocks(stored: StoredQueryVectors, blocks: list[int]) -> np.ndarray:
    """``blocks``' vectors laid end to end: a Ray task's, so that they land in a worker
    node's object store, not on the driver."""
    return np.concatenate([stored.read(b) for b in blocks])
