"""Training examples: queries joined to their judged positives and their negatives.

Skips that a real collection legitimately has (a query without a positive, a mined negative that is
in fact judged positive) are counted in :class:`DataStats` instead of failing, with the first few
examples. Examples carry ids, not passage text: the trainer joins passages to queries by id with
Ray Data, so that no worker has to hold the whole corpus.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import asdict, dataclass, field
from typing import Iterator

from pipeline.core import storage
from pipeline.data.beir import positives, read_qrels, read_queries
from pipeline.data.corpus import MAX_SKIPPED_EXAMPLES
from pipeline.data.runs import read_negatives, read_trec_run


@dataclass
class TrainExample:
    """One query with the ids of its passages; ``negatives`` best first (may be empty: the
    trainer then relies on in-batch negatives).

    ``scores``, for distillation, holds a teacher's score of every passage, aligned with
    ``[*positives, *negatives]``: a flat list (an array once the ids become corpus rows)
    rather than a mapping, because millions of queries with hundreds of scored candidates
    each must fit in the driver.
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
    queries: str,
    qrels: str,
    negatives: str = "",
    doc_ids: Container[str] | None = None,
) -> tuple[list[TrainExample], DataStats]:
    """Read and validate BEIR queries + qrels (+ a negatives jsonl) and join them, as above.
    With ``doc_ids``, qrels and negatives naming other documents are errors."""
    q = read_queries(queries)
    judged = read_qrels(qrels, doc_ids, set(q))
    return build_training_examples(q, judged, read_negatives(negatives, doc_ids, set(q)) if negatives else {})


@dataclass
class DistillDataStats(DataStats):
    """:class:`DataStats` of distillation examples, which cannot fall back on random negatives:
    the teacher never scored those."""

    skipped_not_scored: int = 0  # a query the teacher did not score (e.g. the run covers a sample of queries)
    skipped_not_scored_examples: list[str] = field(default_factory=list)
    skipped_no_scored_negative: int = 0
    skipped_no_scored_negative_examples: list[str] = field(default_factory=list)


def build_distillation_examples(
    queries: dict[str, str],
    qrels: dict[str, dict[str, int]],
    teacher_run: dict[str, list[tuple[str, float, int]]],
    depth: int = 0,
    source: str = "",
) -> tuple[list[TrainExample], DistillDataStats]:
    """One scored example per query (in ``queries`` order) with at least one positive.

    ``teacher_run`` is :func:`read_trec_run`'s, best first. Positives come from the qrels;
    negatives are the scored candidates that are not judged positive, best first by teacher
    score, the first ``depth`` kept (0 = all); ``scores`` holds the teacher's score of every
    positive and negative. Skipped and counted: a query without a positive, one absent from
    the run (the teacher may score a sample of the queries), and one whose candidates are
    all positives. A judged positive missing from its query's scores is an error: the
    scoring stage scores every judged positive of a query it scores, so the run is one of
    other qrels (``source`` names it).
    """
    stats = DistillDataStats()
    examples = []
    for qid, text, pos in _judged_queries(queries, qrels, stats):
        ranked = teacher_run.get(qid)
        if ranked is None:
            stats.count("skipped_not_scored", qid)
            continue
        scored = {d: score for d, score, _ in ranked}
        missing = [d for d in pos if d not in scored]
        if missing:
            where = f" in {source}" if source else ""
            raise ValueError(
                f"query {qid!r}: judged positive {missing[0]!r} has no teacher score{where} (the "
                "scoring stage scores every judged positive: is the run of these qrels?)"
            )
        judged = set(pos)
        negatives = [d for d, _, _ in ranked if d not in judged][: depth or None]
        if not negatives:
            stats.count("skipped_no_scored_negative", qid)
            continue
        examples.append(TrainExample(qid, text, pos, negatives, [scored[d] for d in pos + negatives]))
    stats.examples = len(examples)
    return examples, stats


def load_distillation_examples(
    queries: str, qrels: str, teacher_scores: str, depth: int = 0, doc_ids: Container[str] | None = None
) -> tuple[list[TrainExample], DistillDataStats]:
    """Read and validate BEIR queries + qrels and the teacher's TREC run, and join them as in
    :func:`build_distillation_examples`. With ``doc_ids``, ids outside the corpus are errors."""
    q = read_queries(queries)
    judged = read_qrels(qrels, doc_ids, set(q))
    run = read_trec_run(teacher_scores, query_ids=set(q), doc_ids=doc_ids)
    return build_distillation_examples(q, judged, run, depth, storage.resolve(teacher_scores).uri)


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
