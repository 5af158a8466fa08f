"""BEIR queries and qrels.

- queries, ``queries.jsonl``: ``{"_id": str|number, "text": str}`` per line; or MS MARCO's
  ``queries.*.tsv``: ``id<TAB>text`` per line, no header. Empty text and duplicate ids are
  errors.
- qrels, ``qrels/*.tsv``: ``query-id<TAB>corpus-id<TAB>score`` with an integer score; score > 0
  marks a positive, score <= 0 a judged non-relevant document. The header line ``query-id corpus-id
  score`` is expected; a file whose first row already has an integer score is read as having no
  header (TREC-style tools write such files), and any other first row is an error. Whitespace other
  than a tab also separates columns when a line has no tab. TREC's four columns
  ``query-id iteration corpus-id score`` (MS MARCO's ``qrels.*.tsv``) are read too, the
  iteration ignored. A pair judged twice is an error.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Container, ItemsView, Iterator, Mapping, Sequence

import numpy as np

from pipeline.core import storage
from pipeline.core.errors import InputError
from pipeline.data.corpus_ids import CorpusIds, id_keys
from pipeline.data.records import (
    get_field,
    json_lines,
    line_error,
    read_lines,
)

QRELS_HEADER = ("query-id", "corpus-id", "score")
CHUNK = 65536  # strings made Python objects at once while a column becomes a numpy array


class _Strings:
    """UTF-8 strings appended one at a time into one byte buffer and their end offsets: a
    column of a file held without a Python object per value."""

    def __init__(self):
        self.data, self.ends = bytearray(), array("q")

    def append(self, value: str) -> None:
        self.data += value.encode()
        self.ends.append(len(self.data))

    def __len__(self) -> int:
        return len(self.ends)

    def raw(self, i: int) -> bytes:
        return bytes(self.data[self.ends[i - 1] if i else 0 : self.ends[i]])

    def get(self, i: int) -> str:
        return self.raw(i).decode()

    def slice(self, start: int, stop: int) -> list[str]:
        return [self.get(i) for i in range(start, stop)]

    def fixed_width(self) -> np.ndarray:
        """The strings as a numpy bytes array (the longest's width), made a chunk at a time."""
        chunks = [
            np.array(
                [self.raw(i) for i in range(s, min(s + CHUNK, len(self)))],
                dtype=bytes,
            )
            for s in range(0, len(self), CHUNK)
        ]
        return np.concatenate(chunks) if chunks else np.zeros(0, "S1")


def _first_repeat(keys: np.ndarray, lines: np.ndarray) -> tuple[int, int] | None:
    """(index of the earliest-lined repeat of a key, index of that key's first occurrence),
    or None when every key differs."""
    order = np.lexsort((lines, keys))
    same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if not len(same):
        return None
    later = order[same + 1]
    pick = int(np.argmin(lines[later]))
    first = keys[order] == keys[later[pick]]
    return int(later[pick]), int(order[np.flatnonzero(first)[0]])


def _held(container, keys: np.ndarray) -> np.ndarray:
    """Which of ``keys`` (bytes) ``container`` holds: by its own lookup where it has one
    (:class:`Queries`, :class:`CorpusIds`), else one membership test per key."""
    if hasattr(container, "holds"):
        return container.holds(keys)
    return np.fromiter((k.decode() in container for k in keys), bool, len(keys))


def _known(keys: np.ndarray, holds: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Which of ``keys`` ``holds`` says are known, asking it each distinct key once."""
    unique, inverse = np.unique(keys, return_inverse=True)
    return np.asarray(holds(unique), bool)[inverse]


def _first_unknown(keys: np.ndarray, holds: Callable[[np.ndarray], np.ndarray]) -> int | None:
    """Index of the first of ``keys`` (in file order) that ``holds`` does not know."""
    unknown = np.flatnonzero(~_known(keys, holds))
    return int(unknown[0]) if len(unknown) else None


class _Items(ItemsView):
    """A mapping's items, iterated in one pass over its arrays rather than a lookup a key."""

    def __init__(self, mapping: Mapping, pairs: Callable[[], Iterator]):
        super().__init__(mapping)
        self._pairs = pairs

    def __iter__(self) -> Iterator:
        return self._pairs()


class TextRows(Sequence[str]):
    """Texts by row, read as they are indexed or sliced."""

    def __init__(self, texts: _Strings):
        self._texts = texts

    def __len__(self) -> int:
        return len(self._texts)

    def __getitem__(self, rows):
        if isinstance(rows, slice):
            return self._texts.slice(*rows.indices(len(self))[:2])
        return self._texts.get(range(len(self))[rows])


class Queries(Mapping[str, str]):
    """BEIR queries: query id -> text in file order, held as numpy arrays and one text buffer
    (2 x the longest id + the text + 16 bytes a query), not as a dict of Python strings
    (~100 bytes more a query than its text and id), with lookups by id and slices by row:
    a job's driver holds a job's queries, and there may be millions."""

    def __init__(self, source: str, ids: np.ndarray, texts: _Strings):
        self.source, self._ids, self._texts = source, CorpusIds(ids, source), texts

    def __len__(self) -> int:
        return len(self._texts)

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), CHUNK):
            yield from self.ids(start, start + CHUNK)

    def __contains__(self, qid: object) -> bool:
        return qid in self._ids

    def items(self) -> ItemsView[str, str]:
        return _Items(
            self, lambda: zip(self, (t for s in range(0, len(self), CHUNK) for t in self.texts(s, s + CHUNK)))
        )

    def __getitem__(self, qid: str) -> str:
        row = int(self._ids.find(id_keys([qid]))[0]) if isinstance(qid, str) and len(self) else -1
        if row < 0:
            raise KeyError(qid)
        return self._texts.get(row)

    @classmethod
    def of(cls, queries: Mapping[str, str], source: str = "the queries") -> Queries:
        """``queries`` as :class:`Queries` (itself if it is one)."""
        if isinstance(queries, Queries):
            return queries
        ids, texts = _Strings(), _Strings()
        for qid, text in queries.items():
            ids.append(qid)
            texts.append(text)
        return cls(source, ids.fixed_width(), texts)

    def judged_only(self, judged: Container[str]) -> Queries:
        """The queries that ``judged`` (a :class:`Judgments`) has, in file order: itself when
        that is every one. Read a chunk at a time: no Python string per query is kept."""
        ids, texts, kept = [], _Strings(), 0
        for start in range(0, len(self), CHUNK):
            for qid, text in zip(self.ids(start, start + CHUNK), self.texts(start, start + CHUNK)):
                if qid in judged:
                    ids.append(qid.encode())
                    texts.append(text)
                    kept += 1
        if kept == len(self):
            return self
        return Queries(self.source, np.array(ids, dtype=bytes) if ids else np.zeros(0, "S1"), texts)

    @property
    def text_rows(self) -> TextRows:
        """The texts as a sequence of rows that reads only the slices asked of it (a shard
        fan-out slices its queries a block at a time)."""
        return TextRows(self._texts)

    def ids(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The ids of rows ``start`` up to ``stop`` (file order)."""
        stop = len(self) if stop is None else min(stop, len(self))
        return self._ids.ids(np.arange(start, max(start, stop)))

    def texts(self, start: int = 0, stop: int | None = None) -> list[str]:
        stop = len(self) if stop is None else min(stop, len(self))
        return self._texts.slice(start, max(start, stop))

    def holds(self, keys: np.ndarray) -> np.ndarray:
        return self._ids.holds(keys)


class Judgments(Mapping[str, dict[str, int]]):
    """BEIR qrels: query id -> {doc id: score}, queries in the order they first appear and
    each query's documents in file order, held as numpy arrays (the longest doc id + 16
    bytes a judgment, 2 x the longest query id + 16 a judged query), not as a dict of dicts
    of Python strings (~300 bytes a query of one judgment). A lookup builds that query's
    dict. ``ir_measures`` reads dicts only: give it ``dict(judgments.items())``."""

    def __init__(self, source: str, qids: np.ndarray, docs: np.ndarray, scores: np.ndarray, lines: np.ndarray):
        self.source = source
        judged, first, inverse = np.unique(qids, return_index=True, return_inverse=True)
        in_use_order = np.argsort(first, kind="stable")  # the sorted ids, in order of first use
        appearance = np.empty_like(in_use_order)
        appearance[in_use_order] = np.arange(len(in_use_order))  # sorted id -> order of first use
        query_of = appearance[inverse]  # each judgment's query, by order of first use
        by_query = np.argsort(query_of, kind="stable")  # file order within a query
        self._queries = CorpusIds(judged[in_use_order], source)
        self._starts = np.searchsorted(query_of[by_query], np.arange(len(judged) + 1))
        self.docs, self.scores, self.lines = docs[by_query], scores[by_query], lines[by_query]

    def __len__(self) -> int:
        return len(self._queries)

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), CHUNK):
            yield from self._queries.ids(np.arange(start, min(start + CHUNK, len(self))))

    def __contains__(self, qid: object) -> bool:
        return qid in self._queries

    def items(self) -> ItemsView[str, dict[str, int]]:
        return _Items(self, lambda: ((qid, self._judged(q)) for q, qid in enumerate(self)))

    def _judged(self, q: int) -> dict[str, int]:
        at = slice(self._starts[q], self._starts[q + 1])
        return {d.decode(): int(s) for d, s in zip(self.docs[at], self.scores[at])}

    def __getitem__(self, qid: str) -> dict[str, int]:
        judged = self.get(qid)
        if judged is None:
            raise KeyError(qid)
        return judged

    def get(self, qid: str, default=None):
        """One lookup where ``Mapping.get`` made two: mining and evaluation ask it of every query."""
        if not isinstance(qid, str) or not len(self):
            return default
        row = int(self._queries.find(id_keys([qid]))[0])
        return default if row < 0 else self._judged(row)

    def of(self, qids: Sequence[str]) -> dict[str, dict[str, int]]:
        """The judgments of those of ``qids`` that are judged, found in one search: what a
        block of queries takes along to the task that writes it."""
        if not len(qids) or not len(self):
            return {}
        rows = self._queries.find(id_keys(qids))
        return {qid: self._judged(int(row)) for qid, row in zip(qids, rows) if row >= 0}

    def restricted_to(self, queries: Container[str]) -> "Judgments":
        """The judgments of the queries ``queries`` holds (a :class:`Queries`): what an
        evaluation of those queries is scored on (qrels of every dev query, a sample of them
        evaluated)."""
        qids = np.repeat(self._queries.by_row, np.diff(self._starts))  # each judgment's query
        keep = _known(qids, functools.partial(_held, queries)) if len(qids) else np.zeros(0, bool)
        return Judgments(self.source, qids[keep], self.docs[keep], self.scores[keep], self.lines[keep])

    def check_documents(self, holds: Callable[[np.ndarray], np.ndarray]) -> None:
        """An :class:`InputError` at the first line whose document ``holds`` (bytes ids ->
        which are held) says is not in the corpus."""
        unknown = ~_known(self.docs, holds)
        if unknown.any():
            at = int(np.flatnonzero(unknown)[np.argmin(self.lines[unknown])])
            raise line_error(
                self.source, int(self.lines[at]), f"unknown document id {self.docs[at].decode()!r} (not in the corpus)"
            )


def read_queries(uri: str) -> Queries:
    """BEIR queries.jsonl -> :class:`Queries` (id -> text, in file order)."""
    source = storage.resolve(uri).uri
    ids, texts, lines = _Strings(), _Strings(), array("q")
    for source, number, qid, text in _query_lines(uri):
        if not text.strip():
            raise line_error(source, number, f"empty text (query {qid})")
        ids.append(qid)
        texts.append(text)
        lines.append(number)
    id_bytes = ids.fixed_width()
    del ids
    repeat = _first_repeat(id_bytes, np.asarray(lines))
    if repeat is not None:
        again, first = repeat
        raise line_error(
            source, lines[again], f"duplicate query id {id_bytes[again].decode()!r} (first at line {lines[first]})"
        )
    return Queries(source, id_bytes, texts)


def _query_lines(uri: str) -> Iterator[tuple[str, int, str, str]]:
    """(file, line, id, text) of each query of a BEIR jsonl or an MS MARCO tsv file."""
    name = uri.removesuffix(".gz")
    if name.endswith(".tsv"):
        for source, number, text in read_lines(uri):
            qid, tab, query = text.rstrip("\r\n").partition("\t")
            if not tab or "\t" in query or not qid.strip():
                raise line_error(source, number, "expected 2 tab-separated columns (query id, text)")
            yield source, number, qid.strip(), query
        return
    for source, number, obj in json_lines(uri):
        yield source, number, get_field(obj, "_id", None, source, number), get_field(obj, "text", str, source, number)


def read_qrels(uri: str, doc_ids: Container[str] | None = None, query_ids: Container[str] | None = None) -> Judgments:
    """BEIR qrels TSV -> :class:`Judgments` (query id -> {doc id: score}, every judgment,
    including score <= 0).

    With ``doc_ids`` / ``query_ids`` a judgment naming a document / query outside them is an
    error: it means the qrels belong to another corpus or split. The first such line (or
    repeated judgment) in the file is the one reported."""
    source = storage.resolve(uri).uri
    qids, docs, scores, lines = _Strings(), _Strings(), array("q"), array("q")
    header_checked = False
    for source, number, text in read_lines(uri):
        cols = text.split("\t") if "\t" in text else text.split()
        cols = [c.strip() for c in cols]
        if len(cols) == 4:  # TREC qrels: query-id, iteration, corpus-id, score
            cols = [cols[0], cols[2], cols[3]]
        if len(cols) != 3:
            raise line_error(
                source, number, f"expected 3 columns (query-id, corpus-id, score) or TREC's 4, got {len(cols)}"
            )
        qid, did, score_text = cols
        try:
            score = int(score_text)
        except ValueError:
            score = None
        if not header_checked:
            header_checked = True
            if score is None:
                if tuple(c.lower() for c in cols) != QRELS_HEADER:
                    raise line_error(
                        source,
                        number,
                        f"expected the header {' '.join(QRELS_HEADER)!r} "
                        f"or a judgment with an integer score, got {text!r}",
                    )
                continue
        if score is None:
            raise line_error(source, number, f"score must be an integer, got {score_text!r}")
        if not qid or not did:
            raise line_error(source, number, "empty query id or document id")
        qids.append(qid)
        docs.append(did)
        scores.append(score)
        lines.append(number)
    if not len(lines):  # a run scored against nothing would report zeros after all the work
        what = "has only its header" if header_checked else "is empty"
        raise InputError(f"{source}: {what}: a qrels file needs judgments (query-id, corpus-id, score)")
    line_of = np.asarray(lines, dtype=np.int64)
    qid_bytes, doc_bytes = qids.fixed_width(), docs.fixed_width()
    del qids, docs
    errors = []  # (line, message) of each kind of error's first line; the earliest is raised
    for ids, known, what, where in (
        (qid_bytes, query_ids, "query", "queries"),
        (doc_bytes, doc_ids, "document", "corpus"),
    ):
        at = None if known is None else _first_unknown(ids, functools.partial(_held, known))
        if at is not None:
            errors.append((line_of[at], f"unknown {what} id {ids[at].decode()!r} (not in the {where})"))
    # A pair as one key: the query id, a byte no id holds, the document id.
    pairs = np.char.add(np.char.add(qid_bytes, b"\x00"), doc_bytes) if len(qid_bytes) else qid_bytes
    repeat = _first_repeat(pairs, line_of)
    if repeat is not None:
        again, first = repeat
        pair = (qid_bytes[again].decode(), doc_bytes[again].decode())
        errors.append((line_of[again], f"duplicate judgment {pair!r} (first at line {line_of[first]})"))
    if errors:
        line, message = min(errors)
        raise line_error(source, int(line), message)
    return Judgments(source, qid_bytes, doc_bytes, np.asarray(scores, dtype=np.int32), line_of.astype(np.int32))


def positives(judged: dict[str, int]) -> list[str]:
    """The judged-relevant (score > 0) document ids, in qrels order."""
    return [did for did, score in judged.items() if score > 0]
