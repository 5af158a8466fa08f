"""Training examples: queries joined to their judged positives and their negatives.

Skips that a real collection legitimately has (a query without a positive, a mined negative that is
in fact judged positive) are counted in :class:`DataStats` instead of failing, with the first few
examples. Examples carry ids, not passage text: the trainer joins passages to queries by id with
Ray Data, so that no worker has to hold the whole corpus.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np

from pipeline.core import storage
from pipeline.core.errors import InputError
from pipeline.data.beir import positives, read_qrels, read_queries
from pipeline.data.corpus import MAX_SKIPPED_EXAMPLES
from pipeline.data.corpus_ids import CorpusIds, id_keys
from pipeline.data.records import line_error
from pipeline.data.runs import iter_negatives, iter_trec_run


@dataclass
class TrainExample:
    """One query with the ids of its passages; ``negatives`` best first (may be empty: the
    trainer then relies on in-batch negatives).

    ``scores``, for distillation, holds a teacher's score of every passage, aligned with
    ``[*positives, *negatives]``. Jobs hold many examples as :class:`ExampleRows`, whose
    items are these with corpus rows (arrays) for ids.
    """

    query_id: str
    query: str
    positives: list[str]
    negatives: list[str] = field(default_factory=list)
    scores: list[float] | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        if self.scores is None:
            del out["scores"]
        return out


@dataclass
class DataStats:
    """What validation kept, skipped and dropped; reported in job summaries."""

    examples: int = 0
    skipped_no_positive: int = 0
    skipped_no_positive_examples: list[str] = field(default_factory=list)
    dropped_negative_is_positive: int = 0
    dropped_negative_is_positive_examples: list[str] = field(default_factory=list)  # "qid:docid"
    no_negatives: int = 0  # kept, with in-batch negatives only
    no_negatives_examples: list[str] = field(default_factory=list)

    def count(self, what: str, example: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        examples = getattr(self, f"{what}_examples")
        if len(examples) < MAX_SKIPPED_EXAMPLES:
            examples.append(example)

    def as_dict(self) -> dict:
        return asdict(self)


def query_seed(seed: int, query_id: str) -> int:
    """A per-query seed that is the same in every process (Python's hash() is salted)."""

    digest = hashlib.blake2b(f"{seed}\x00{query_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# A corpus row: int32 holds 2 billion passages, and a third less of distillation's arrays
# than int64 (MS MARCO: 101M scored candidates, 8 bytes each with their scores).
ROW = np.int32


class ExampleRows:
    """Training examples with corpus rows for passage ids, in flat arrays: no Python object
    per passage. Example ``i``'s positives are ``positives[positive_offsets[i]:positive_offsets[i + 1]]``,
    its negatives likewise, and its teacher scores (distillation) the positives' then the
    negatives' at ``positive_offsets[i] + negative_offsets[i]``. MS MARCO's distillation
    (502k queries, 200 scored candidates each) holds 0.8 GB here, where lists of ids and
    scores took about 10 GB. Indexing gives a :class:`TrainExample` of array views."""

    def __init__(
        self,
        query_ids: list[str],
        queries: list[str],
        positive_offsets: np.ndarray,
        positives: np.ndarray,
        negative_offsets: np.ndarray,
        negatives: np.ndarray,
        scores: np.ndarray | None = None,
    ):
        self.query_ids, self.queries = query_ids, queries
        self.positive_offsets, self.positives = positive_offsets, positives
        self.negative_offsets, self.negatives = negative_offsets, negatives
        self.scores = scores

    def __len__(self) -> int:
        return len(self.query_ids)

    def __getitem__(self, i: int) -> TrainExample:
        p0, p1 = self.positive_offsets[i], self.positive_offsets[i + 1]
        n0, n1 = self.negative_offsets[i], self.negative_offsets[i + 1]
        scores = None if self.scores is None else self.scores[p0 + n0 : p1 + n1]
        query = self.queries[i] if self.queries else ""
        return TrainExample(self.query_ids[i], query, self.positives[p0:p1], self.negatives[n0:n1], scores)

    def __iter__(self) -> Iterator[TrainExample]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        arrays = (self.positive_offsets, self.positives, self.negative_offsets, self.negatives, self.scores)
        return sum(a.nbytes for a in arrays if a is not None)

    def without_text(self) -> "ExampleRows":
        """The same examples without their query texts (once tokenized, a trainer needs none)."""
        return ExampleRows(
            self.query_ids,
            [],
            self.positive_offsets,
            self.positives,
            self.negative_offsets,
            self.negatives,
            self.scores,
        )

    @classmethod
    def from_examples(cls, examples: Iterable[TrainExample], corpus_ids: CorpusIds, source: str = "") -> "ExampleRows":
        """Examples by passage id (read, or streamed one at a time) as corpus rows; an id
        the corpus lacks is an error naming its query (and ``source``)."""
        builder = ExampleRowsBuilder(corpus_ids)
        where = f" ({source})" if source else ""
        for ex in examples:
            try:
                pos, neg = corpus_ids.rows(list(ex.positives)), corpus_ids.rows(list(ex.negatives))
            except KeyError as missing:
                raise InputError(
                    f"query {ex.query_id!r}{where}: passage {missing.args[0]!r} is not in the corpus"
                ) from None
            if ex.scores is not None and len(ex.scores) != len(pos) + len(neg):
                raise InputError(
                    f"query {ex.query_id!r}{where}: {len(ex.scores)} teacher scores for {len(pos) + len(neg)} passages"
                )
            builder.add(ex.query_id, ex.query, pos, neg, ex.scores)
        return builder.build()


def _gather(
    offsets: np.ndarray, values: np.ndarray, order: np.ndarray, block: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """The ragged rows ``order`` of (offsets, values), as new (offsets, values). Gathered
    ``block`` rows at a time: an index over every value would be the largest array here."""
    if np.array_equal(order, np.arange(len(offsets) - 1)):
        return offsets, values
    lengths = (offsets[1:] - offsets[:-1])[order]
    new_offsets = np.zeros(len(order) + 1, np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    out = np.empty(new_offsets[-1], values.dtype)
    for a in range(0, len(order), block):
        b = min(a + block, len(order))
        shift = offsets[:-1][order[a:b]] - new_offsets[a:b]
        out[new_offsets[a] : new_offsets[b]] = values[
            np.repeat(shift, lengths[a:b]) + np.arange(new_offsets[a], new_offsets[b])
        ]
    return new_offsets, out


class ExampleRowsBuilder:
    """:class:`ExampleRows` one example at a time, the pending examples' arrays joined into
    one chunk every ``CHUNK`` passages: few small arrays pending, and no more held twice."""

    CHUNK = 65_536

    def __init__(self, corpus_ids: CorpusIds):
        if len(corpus_ids) > np.iinfo(ROW).max:
            raise InputError(f"{corpus_ids.source}: {len(corpus_ids):,} passages, more than a corpus row can number")
        self.query_ids: list[str] = []
        self.queries: list[str] = []
        self._chunks: list[tuple[np.ndarray, ...]] = []  # (pos lengths, pos, neg lengths, neg, scores)
        self._pending: list[tuple] = []
        self._pending_passages = 0
        self._scored: bool | None = None

    def add(self, query_id: str, query: str, positives: np.ndarray, negatives: np.ndarray, scores=None) -> None:
        scored = scores is not None
        if self._scored is None:
            self._scored = scored
        elif scored != self._scored:
            raise InputError(
                f"query {query_id!r} {'carries' if scored else 'lacks'} teacher scores, unlike the examples "
                "before it: all or none must carry them"
            )
        self.query_ids.append(query_id)
        self.queries.append(query)
        self._pending.append((positives, negatives, scores))
        self._pending_passages += len(positives) + len(negatives)
        if self._pending_passages >= self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        pos, neg, scores = zip(*self._pending)
        self._chunks.append(
            (
                np.array([len(p) for p in pos], np.int64),
                np.concatenate(pos).astype(ROW, copy=False),
                np.array([len(n) for n in neg], np.int64),
                np.concatenate(neg).astype(ROW, copy=False),
                np.concatenate(scores).astype(np.float32, copy=False) if self._scored else None,
            )
        )
        self._pending, self._pending_passages = [], 0

    def build(self, order: np.ndarray | None = None) -> ExampleRows:
        """The examples added, or those at ``order`` in that order, without holding every
        array twice: each is joined, then reordered, one at a time."""
        self._flush()
        chunks, self._chunks = [list(chunk) for chunk in self._chunks], []

        def pop(i: int, dtype) -> np.ndarray:
            parts = [chunk[i] for chunk in chunks]
            for chunk in chunks:
                chunk[i] = None
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        def offsets(lengths: np.ndarray) -> np.ndarray:
            out = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(lengths, out=out[1:])
            return out

        def ordered(offsets: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return (offsets, values) if order is None else _gather(offsets, values, order)

        positive_offsets, negative_offsets = offsets(pop(0, np.int64)), offsets(pop(2, np.int64))
        scores = None
        if self._scored:
            _, scores = ordered(positive_offsets + negative_offsets, pop(4, np.float32))
        positive_offsets, positives = ordered(positive_offsets, pop(1, ROW))
        negative_offsets, negatives = ordered(negative_offsets, pop(3, ROW))
        query_ids, queries = self.query_ids, self.queries
        if order is not None:
            query_ids, queries = [query_ids[i] for i in order], [queries[i] for i in order]
        return ExampleRows(query_ids, queries, positive_offsets, positives, negative_offsets, negatives, scores)


def build_training_examples(
    queries: dict[str, str],
    qrels: dict[str, dict[str, int]],
    negatives: dict[str, list[str]] | None = None,
) -> tuple[list[TrainExample], DataStats]:
    """One example per query (in ``queries`` order) with at least one positive.

    A query without a positive judgment is skipped; a negative that is a judged positive is dropped
    (a mined "negative" that is relevant would teach the model the opposite); a query left without
    negatives is kept. These three are counted; negatives of queries not in ``queries`` are ignored.
    """
    stats = DataStats()
    examples = [
        TrainExample(qid, text, pos, clean_negatives(qid, (negatives or {}).get(qid, []), set(pos), stats))
        for qid, text, pos in _judged_queries(queries, qrels, stats)
    ]
    stats.examples = len(examples)
    return examples, stats


def _judged_queries(
    queries: dict[str, str], qrels: dict[str, dict[str, int]], stats: DataStats
) -> Iterator[tuple[str, str, list[str]]]:
    """(id, text, positives) of each query with a positive, in ``queries`` order; the others
    are counted as ``skipped_no_positive``."""
    for qid, text in queries.items():
        pos = positives(qrels.get(qid, {}))
        if pos:
            yield qid, text, pos
        else:
            stats.count("skipped_no_positive", qid)


def load_training_examples(
    queries: str, qrels: str, negatives: str, corpus_ids: CorpusIds
) -> tuple[ExampleRows, DataStats]:
    """Read and validate BEIR queries + qrels (+ a negatives jsonl, streamed a line at a time
    into arrays) and join them as :func:`build_training_examples` does, as corpus rows: no
    Python object per negative.

    The negatives file is audited before any training reads it: a negative outside the
    corpus, one listed twice for a query, one that is a judged positive of its query (the
    file was mined against other qrels: it would teach the model the opposite) and a score
    that is not finite are each an error at its line, naming the query and the passage.
    Qrels naming documents outside the corpus are errors at their line too."""
    q = read_queries(queries)
    judged = read_qrels(qrels, corpus_ids, q)
    mined, mined_at = None, {}  # query id -> its place in mined
    if negatives:
        builder = ExampleRowsBuilder(corpus_ids)
        none = np.zeros(0, ROW)
        for source, number, qid, ids in iter_negatives(negatives, set(q)):
            judged_positive = set(positives(judged.get(qid, {}))).intersection(ids)
            if judged_positive:
                first = next(d for d in ids if d in judged_positive)
                raise line_error(
                    source,
                    number,
                    f"query {qid!r}: negative {first!r} is a judged positive of the query in {judged.source}: "
                    "the file was mined against other qrels (mine again with these)",
                )
            rows = corpus_ids.find(id_keys(ids)) if ids else none
            unknown = np.flatnonzero(rows < 0)
            if len(unknown):
                raise line_error(
                    source, number, f"query {qid!r}: unknown document id {ids[unknown[0]]!r} (not in the corpus)"
                )
            mined_at[qid] = len(builder.query_ids)
            builder.add(qid, "", none, rows)
        mined = builder.build()
    stats = DataStats()
    examples = ExampleRowsBuilder(corpus_ids)
    for qid, text, pos in _judged_queries(q, judged, stats):
        positive_rows = corpus_ids.rows(pos)
        negative_rows = mined[mined_at[qid]].negatives if qid in mined_at else np.zeros(0, ROW)
        judged_positive = np.isin(negative_rows, positive_rows)
        for row in negative_rows[judged_positive]:
            stats.count("dropped_negative_is_positive", f"{qid}:{corpus_ids.ids([row])[0]}")
        if judged_positive.all():
            stats.count("no_negatives", qid)
        examples.add(qid, text, positive_rows, negative_rows[~judged_positive])
    stats.examples = len(examples.query_ids)
    return examples.build(), stats


@dataclass
class DistillDataStats(DataStats):
    """:class:`DataStats` of distillation examples, which cannot fall back on random negatives:
    the teacher never scored those."""

    skipped_not_scored: int = 0  # a query the teacher did not score (e.g. the run covers a sample of queries)
    skipped_not_scored_examples: list[str] = field(default_factory=list)
    skipped_no_scored_negative: int = 0
    skipped_no_scored_negative_examples: list[str] = field(default_factory=list)
    # Teacher-cleaned (--data.teacher_margin): candidates dropped as likely unjudged positives,
    # in all, and the queries that lost any ("qid:dropped" examples).
    teacher_dropped: int = 0
    teacher_dropped_queries: int = 0
    teacher_dropped_queries_examples: list[str] = field(default_factory=list)


def build_distillation_examples(
    queries: dict[str, str],
    qrels: dict[str, dict[str, int]],
    teacher_run: Iterable[tuple[str, list[tuple[str, float, int]]]],
    corpus_ids: CorpusIds,
    depth: int = 0,
    source: str = "",
    teacher_margin: float | None = None,
    deep: int = 0,
    seed: int = 0,
) -> tuple[ExampleRows, DistillDataStats]:
    """One scored example per query (in ``queries`` order) with at least one positive, as
    corpus rows.

    ``teacher_run`` gives each query's candidates a query at a time, best first, as
    :func:`iter_trec_run` streams them: (query id, [(doc id, score, line), ...]). Only one
    query's candidates are ever held as Python objects; the kept ones go into arrays.
    Positives come from the qrels; negatives are the scored candidates that are not judged
    positive, best first by teacher score, the first ``depth`` kept (0 = all); ``scores``
    holds the teacher's score of every positive and negative. ``teacher_margin`` cleans them
    first (RocketQA's denoising): a candidate the teacher scores above the query's lowest
    positive score minus the margin is taken for an unjudged positive and dropped, counted.
    ``deep`` mixes in, for recall, that many more drawn from the candidates below the best
    ``depth`` (a draw seeded by ``seed`` and the query id, kept in teacher order). Skipped and counted: a query
    without a positive, one absent from the run (the teacher may score a sample of the
    queries), and one whose candidates are all positives. Errors (``source`` names the run):
    a candidate outside the corpus (at its line), and a judged positive missing from its
    query's scores (the scoring stage scores every judged positive of a query it scores, so
    the run is one of other qrels).
    """
    where = f" in {source}" if source else ""
    builder = ExampleRowsBuilder(corpus_ids)
    stats = DistillDataStats()
    outcome: dict[str, int] = {}  # query id -> its example's place in the builder, -1 if no negative
    for qid, ranked in teacher_run:
        ids = [d for d, _, _ in ranked]
        rows = corpus_ids.find(id_keys(ids))
        unknown = np.flatnonzero(rows < 0)
        if len(unknown):
            first = min(unknown, key=lambda i: ranked[i][2])
            raise line_error(source, ranked[first][2], f"unknown document id {ids[first]!r} (not in the corpus)")
        pos = positives(qrels.get(qid, {}))
        if not pos:
            continue  # counted below, in the queries' order
        scores = np.fromiter((score for _, score, _ in ranked), np.float32, len(ranked))
        at = {d: i for i, d in enumerate(ids)}
        missing = [d for d in pos if d not in at]
        if missing:
            raise ValueError(
                f"query {qid!r}: judged positive {missing[0]!r} has no teacher score{where} (the "
                "scoring stage scores every judged positive: is the run of these qrels?)"
            )
        judged = np.array([at[d] for d in pos], np.int64)
        candidates = np.flatnonzero(~np.isin(np.arange(len(ids)), judged))
        if teacher_margin is not None:
            candidates = _teacher_cleaned(qid, candidates, scores, judged, teacher_margin, stats)
        candidates = _teacher_drawn(qid, candidates, depth, deep, seed)
        if not len(candidates):
            outcome[qid] = -1
            continue
        outcome[qid] = len(builder.query_ids)
        builder.add(
            qid, queries[qid], rows[judged], rows[candidates], np.concatenate([scores[judged], scores[candidates]])
        )

    order = []
    for qid, _, _ in _judged_queries(queries, qrels, stats):
        kept = outcome.get(qid)
        if kept is None:
            stats.count("skipped_not_scored", qid)
        elif kept < 0:
            stats.count("skipped_no_scored_negative", qid)
        else:
            order.append(kept)
    stats.examples = len(order)
    return builder.build(np.array(order, np.int64)), stats


def _teacher_cleaned(
    qid: str, candidates: np.ndarray, scores: np.ndarray, judged: np.ndarray, margin: float, stats: DistillDataStats
) -> np.ndarray:
    """``candidates`` (positions in the query's run) less those scored above its lowest
    judged positive's score minus ``margin``, the dropped counted in ``stats``."""
    kept = candidates[scores[candidates] <= float(scores[judged].min()) - margin]
    dropped = len(candidates) - len(kept)
    if dropped:
        stats.teacher_dropped += dropped
        stats.count("teacher_dropped_queries", f"{qid}:{dropped}")
    return kept


def _teacher_drawn(qid: str, candidates: np.ndarray, depth: int, deep: int, seed: int) -> np.ndarray:
    """The best ``depth`` of ``candidates`` (0 = all), then ``deep`` drawn from those below
    them (seeded by ``seed`` and the query, kept in teacher order)."""
    if not deep or len(candidates) <= depth:
        return candidates[: depth or None]
    below = candidates[depth:]
    rng = np.random.default_rng([query_seed(seed, qid) % 2**63])
    drawn = np.sort(rng.choice(len(below), min(deep, len(below)), replace=False))
    return np.concatenate([candidates[:depth], below[drawn]])


def load_distillation_examples(
    queries: str,
    qrels: str,
    teacher_scores: str,
    corpus_ids: CorpusIds,
    depth: int = 0,
    teacher_margin: float | None = None,
    deep: int = 0,
    seed: int = 0,
) -> tuple[ExampleRows, DistillDataStats]:
    """Read and validate BEIR queries + qrels, stream the teacher's TREC run a query at a
    time, and join them as in :func:`build_distillation_examples`: the driver's memory grows
    with the kept candidates' arrays (8 bytes each), not with the run's lines as objects.
    The run must list each query's lines together, as the scoring stage writes it."""
    q = read_queries(queries)
    judged = read_qrels(qrels, corpus_ids, q)
    source = storage.resolve(teacher_scores).uri
    return build_distillation_examples(
        q,
        judged,
        iter_trec_run(teacher_scores, query_ids=set(q)),
        corpus_ids,
        depth,
        source,
        teacher_margin,
        deep,
        seed,
    )


def clean_negatives(qid: str, negs: list[str], pos: set[str], stats: DataStats) -> list[str]:
    kept = []
    for did in negs:
        if did in pos:
            stats.count("dropped_negative_is_positive", f"{qid}:{did}")
        else:
            kept.append(did)
    if not kept:
        stats.count("no_negatives", qid)
    return kept
