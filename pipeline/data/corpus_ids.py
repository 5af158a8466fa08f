"""A corpus's document ids on the driver: numpy arrays, never a Python dict of strings.

At MS MARCO scale (8.8M passages) a ``{doc_id: row}`` dict costs about 1.5 GB of Python
objects; the same ids as one fixed-width byte array, plus the sort order that answers
lookups, cost (longest id + 8) bytes a passage: about 130 MB. Jobs that join ids to
corpus rows (fine-tuning's examples, search results, qrels checks) hold this instead.

Rows are the corpus's own row numbers, which prepared shards and embedding shards both
store (``row`` column, contiguous from 0 in shard order).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import ray

from pipeline.core import storage
from pipeline.core.errors import ArtifactError, InputError
from pipeline.core.tasks import StorageTasks


class CorpusIds:
    """Doc ids indexed by corpus row, with id -> row lookups by binary search."""

    def __init__(self, ids: np.ndarray, source: str = "the corpus"):
        if ids.dtype.kind != "S":
            raise TypeError(f"ids must be a numpy bytes array, got {ids.dtype}")
        self.by_row, self.source = ids, source
        self.first_row = 0  # corpus row of by_row[0]: not 0 for one index shard's ids
        self._order = np.argsort(ids, kind="stable")
        self._sorted = ids[self._order]
        repeated = np.flatnonzero(self._sorted[1:] == self._sorted[:-1])
        if len(repeated):
            rows = sorted(self._order[repeated[0] : repeated[0] + 2].tolist())
            raise InputError(f"{source}: document id {self._sorted[repeated[0]].decode()!r} is in rows {rows}")

    @classmethod
    def from_strings(cls, ids: Iterable[str], source: str = "the corpus") -> "CorpusIds":
        return cls(_as_bytes([i.encode() for i in ids]), source)

    @classmethod
    def read(cls, folder: str, shards: Sequence[dict], on_read: Callable[[], None] | None = None) -> "CorpusIds":
        """The ids of a prepared corpus or an embeddings folder, from each shard's ``row``
        and ``doc_id`` columns (the rows must run on without a gap in shard order, from the
        first shard's ``first_row``: 0 for a whole corpus, later for an index shard's part).
        ``first_row`` is then the corpus row of ``by_row[0]``; ``on_read()`` after each shard."""
        shards = sorted(shards, key=lambda s: s["first_row"])
        first_row = int(shards[0]["first_row"]) if shards else 0
        parts, next_row = [], first_row
        for shard in shards:
            rows, ids = _shard_rows_and_ids(storage.join(folder, shard["path"]), next_row)
            next_row += len(rows)
            parts.append(ids)
            if on_read is not None:
                on_read()
        ids = np.concatenate(parts) if parts else np.zeros(0, "S1")
        corpus_ids = cls(ids, storage.resolve(folder).describe())
        corpus_ids.first_row = first_row
        return corpus_ids

    def __len__(self) -> int:
        return len(self.by_row)

    def __contains__(self, doc_id: object) -> bool:
        if not isinstance(doc_id, str) or not len(self._sorted):
            return False
        key = doc_id.encode()
        at = int(np.searchsorted(self._sorted, key))
        return at < len(self._sorted) and self._sorted[at] == key

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, -1 where the corpus has no such id."""
        if not len(self._sorted):
            return np.full(len(keys), -1, np.int64)
        at = np.minimum(np.searchsorted(self._sorted, keys), len(self._sorted) - 1)
        return np.where(self._sorted[at] == keys, self._order[at] + self.first_row, -1).astype(np.int64)

    def rows(self, doc_ids: Sequence[str]) -> np.ndarray:
        """Corpus rows of ``doc_ids`` (int64); a ``KeyError`` names the first unknown id."""
        rows = self.find(id_keys(doc_ids))
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            raise KeyError(doc_ids[missing[0]])
        return rows

    def ids(self, rows: np.ndarray) -> list[str]:
        """Doc ids of corpus ``rows``."""
        return [i.decode() for i in self.by_row[np.asarray(rows, dtype=np.int64) - self.first_row]]

    def id_bytes(self, rows: np.ndarray) -> np.ndarray:
        """Doc ids of corpus ``rows`` as bytes, shaped as ``rows``; b"" where a row is -1
        (FAISS's padding)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(self.by_row):
            return np.zeros(rows.shape, "S1")
        picked = self.by_row[np.clip(rows - self.first_row, 0, len(self.by_row) - 1)]
        return np.where(rows < 0, b"", picked)

    def holds(self, doc_ids: np.ndarray) -> np.ndarray:
        """Which of ``doc_ids`` (a bytes array) are in the corpus: a bool mask."""
        return self.find(np.asarray(doc_ids, dtype=bytes)) >= 0

    @property
    def nbytes(self) -> int:
        return self.by_row.nbytes + self._sorted.nbytes + self._order.nbytes


class NamedIds(CorpusIds):
    """The corpus rows of the passage ids some data names (a trainer's examples): the
    lookups of :class:`CorpusIds` over those ids alone. Built by :meth:`of`, one task per
    shard, so that the head holds what the data names, never every id of the corpus."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray, corpus_docs: int, source: str):
        self.source, self.first_row, self.corpus_docs = source, 0, corpus_docs
        found = rows >= 0
        self._sorted, self._order = keys[found], rows[found]  # keys sorted, as find expects
        self._by_row = np.argsort(self._order, kind="stable")  # for ids(): rows sorted
        self.by_row = np.zeros(0, "S1")  # no array over every corpus row

    @classmethod
    def of(cls, folder: str, shards: Sequence[dict], keys: np.ndarray, corpus_docs: int) -> "NamedIds":
        """The rows of ``keys`` (distinct ids, sorted) in a prepared corpus, looked up by one
        task per shard against that shard's own ids; an id in two shards is an error, as in
        :meth:`CorpusIds.read`. Keys the corpus lacks find no row (-1)."""
        source = storage.resolve(folder).describe()
        tasks = StorageTasks(folder)
        keys_arg = ray.put(keys) if tasks.ray else keys  # once, not once a task
        calls = [(storage.join(folder, s["path"]), int(s["first_row"]), keys_arg) for s in shards]
        rows = np.full(len(keys), -1, np.int64)
        for at, shard_rows in tasks.map(_rows_in_shard, calls, "look up ids", "shards"):
            repeated = at[rows[at] >= 0]
            if len(repeated):
                key = keys[repeated[0]]
                both = sorted([int(rows[repeated[0]]), int(shard_rows[at == repeated[0]][0])])
                raise InputError(f"{source}: document id {key.decode()!r} is in rows {both}")
            rows[at] = shard_rows
        return cls(keys, rows, corpus_docs, source)

    def __len__(self) -> int:
        return self.corpus_docs

    def ids(self, rows: np.ndarray) -> list[str]:
        rows = np.asarray(rows, dtype=np.int64)
        held = self._order[self._by_row]
        at = np.minimum(np.searchsorted(held, rows), max(len(held) - 1, 0))
        if len(rows) and (not len(held) or not np.array_equal(held[at], rows)):
            raise KeyError(f"rows {rows.tolist()[:5]} are not all rows of the ids this lookup holds")
        return [i.decode() for i in self._sorted[self._by_row[at]]]

    def id_bytes(self, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError("NamedIds holds the rows of named ids only: read CorpusIds for every row")

    @property
    def nbytes(self) -> int:
        return self._sorted.nbytes + self._order.nbytes + self._by_row.nbytes


def _shard_rows_and_ids(uri: str, first_row: int) -> tuple[np.ndarray, np.ndarray]:
    """One shard's ``row`` and ``doc_id`` columns (ids as bytes); its rows must run on from
    ``first_row``."""
    table = storage.read_parquet(uri, columns=["row", "doc_id"])
    rows = table.column("row").to_numpy()
    if len(rows) and not np.array_equal(rows, np.arange(first_row, first_row + len(rows))):
        raise ArtifactError(
            f"{storage.resolve(uri).describe()}: rows {rows[0]}..{rows[-1]} do not continue from row {first_row}"
        )
    return rows, _as_bytes(table.column("doc_id").cast("binary").to_numpy(zero_copy_only=False))


def _rows_in_shard(uri: str, first_row: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``keys`` (sorted) one prepared shard holds: their places in ``keys`` and
    their corpus rows. The shard's rows must run on from ``first_row``."""
    rows, ids = _shard_rows_and_ids(uri, first_row)
    if not len(keys) or not len(ids):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
    held = keys[at] == ids
    return at[held].astype(np.int64), rows[held].astype(np.int64)


class IdRecorder:
    """Stands in for :class:`CorpusIds` while data is read once to learn which passage ids
    it names: every id is "found" (at row 0), and kept. :meth:`keys` gives them distinct and
    sorted, for :meth:`NamedIds.of`. Memory: the distinct ids, plus at most as many again
    pending (merged when the pending ones outgrow the merged ones)."""

    MERGE_AT = 1 << 20  # pending ids: fewer, and np.unique runs too often to pay

    def __init__(self, corpus_docs: int, source: str):
        self.corpus_docs, self.source = corpus_docs, source
        self._merged = np.zeros(0, "S1")
        self._pending: list[np.ndarray] = []
        self._pending_count = 0

    def find(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=bytes)
        self._pending.append(keys)
        self._pending_count += len(keys)
        if self._pending_count > max(self.MERGE_AT, len(self._merged)):
            self._merge()
        return np.zeros(len(keys), np.int64)

    def _merge(self) -> None:
        self._merged = np.unique(np.concatenate([self._merged, *self._pending]))
        self._pending, self._pending_count = [], 0

    def keys(self) -> np.ndarray:
        self._merge()
        return self._merged

    def __len__(self) -> int:
        return self.corpus_docs

    def __contains__(self, doc_id: object) -> bool:
        if isinstance(doc_id, str):
            self.find(id_keys([doc_id]))
        return True

    def rows(self, doc_ids: Sequence[str]) -> np.ndarray:
        return self.find(id_keys(doc_ids))

    def holds(self, doc_ids: np.ndarray) -> np.ndarray:
        self.find(doc_ids)
        return np.ones(len(doc_ids), bool)

    def ids(self, rows: np.ndarray) -> list[str]:
        return ["" for _ in np.asarray(rows)]


def id_keys(doc_ids: Sequence[str]) -> np.ndarray:
    """Doc ids as the bytes array that :meth:`CorpusIds.find` and :meth:`CorpusIds.holds` take."""
    return _as_bytes([d.encode() for d in doc_ids])


def _as_bytes(values) -> np.ndarray:
    # Fixed width (the longest id): numpy's "S" dtype drops trailing NUL bytes, which no id has.
    return np.array(values, dtype=bytes) if len(values) else np.zeros(0, "S1")
