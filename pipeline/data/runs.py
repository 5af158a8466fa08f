"""Ranked lists on storage: TREC runs and mined-negative files.

- TREC run: ``qid Q0 docid rank score tag`` per line (first-stage results, a teacher's scores).
- negatives (written by BM25 and dense mining): ``{"query_id": str, "negatives": [docid, ...],
  "scores": [float, ...]}`` per line, negatives best-ranked first; ``scores`` is optional.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterator
from typing import Iterable

from pipeline.core import storage
from pipeline.core.errors import InputError
from pipeline.data.records import (
    as_id,
    check_new,
    get_field,
    json_lines,
    line_error,
    read_lines,
    write_json_line,
)


def read_negatives(
    uri: str, doc_ids: Container[str] | None = None, query_ids: set[str] | None = None
) -> dict[str, list[str]]:
    """Negatives jsonl -> {query id: [doc id, ...]} in ranked order (``scores`` is not kept)."""
    negatives: dict[str, list[str]] = {}
    for source, number, qid, ids in iter_negatives(uri, query_ids):
        unknown = [d for d in ids if doc_ids is not None and d not in doc_ids]
        if unknown:
            raise line_error(source, number, f"unknown document id {unknown[0]!r} (not in the corpus)")
        negatives[qid] = ids
    return negatives


def iter_negatives(uri: str, query_ids: set[str] | None = None) -> Iterator[tuple[str, int, str, list[str]]]:
    """A negatives jsonl a line at a time: (file, line, query id, ranked doc ids), each line
    checked (a query id outside ``query_ids`` or seen before, a negative listed twice)."""
    lines: dict[str, int] = {}
    for source, number, obj in json_lines(uri):
        qid = get_field(obj, "query_id", None, source, number)
        if query_ids is not None and qid not in query_ids:
            raise line_error(source, number, f"unknown query id {qid!r} (not in the queries)")
        check_new(lines, qid, "query id", source, number)
        ids = [
            as_id(d, f"negatives[{i}]", source, number)
            for i, d in enumerate(get_field(obj, "negatives", list, source, number))
        ]
        if len(set(ids)) != len(ids):
            repeated = next(d for i, d in enumerate(ids) if d in ids[:i])
            raise line_error(source, number, f"query {qid!r} lists negative {repeated!r} twice")
        scores = obj.get("scores")
        if scores is not None:
            _check_scores(scores, ids, qid, source, number)
        yield source, number, qid, ids


def _check_scores(scores, ids: list[str], qid: str, source: str, number: int) -> None:
    """A negatives line's scores: one finite number per negative (NaN or inf from a broken
    scorer would pass as a rank)."""
    if not isinstance(scores, list) or len(scores) != len(ids):
        raise line_error(source, number, f"query {qid!r}: expected a list of {len(ids)} scores, one per negative")
    for doc_id, score in zip(ids, scores):
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise line_error(
                source, number, f"query {qid!r}: negative {doc_id!r} has the score {score!r}, not a finite number"
            )


def negatives_record(qid: str, ids: list[str], scores: list[float] | None) -> dict:
    """One line of a negatives file, as BM25 and dense mining both write it."""
    return {
        "query_id": qid,
        "negatives": list(ids),
        **({"scores": [round(float(s), 4) for s in scores]} if scores is not None else {}),
    }


def write_negatives(rows: Iterable[tuple[str, list[str], list[float] | None]], uri: str) -> int:
    """Write (query id, ranked negative ids, their scores or None) rows; returns the row count."""
    n = 0
    with storage.open_output(uri) as out:
        for qid, ids, scores in rows:
            write_json_line(out, negatives_record(qid, ids, scores))
            n += 1
    return n


def _trec_lines(uri: str, query_ids: set[str] | None, doc_ids: Container[str] | None):
    """Validated TREC run lines: (source, line, qid, doc id, rank, score)."""
    for source, number, text in read_lines(uri):
        cols = text.split()
        if len(cols) != 6:
            raise line_error(source, number, f"expected 6 columns (qid Q0 docid rank score tag), got {len(cols)}")
        qid, _, did, rank_text, score_text, _ = cols
        try:
            rank, score = int(rank_text), float(score_text)
        except ValueError:
            raise line_error(
                source, number, f"rank must be an integer and score a number, got {rank_text!r} and {score_text!r}"
            ) from None
        if not math.isfinite(score):
            raise line_error(source, number, f"score must be finite, got {score_text!r}")
        if query_ids is not None and qid not in query_ids:
            raise line_error(source, number, f"unknown query id {qid!r} (not in the queries)")
        if doc_ids is not None and did not in doc_ids:
            raise line_error(source, number, f"unknown document id {did!r} (not in the corpus)")
        yield source, number, qid, did, rank, score


def _best(block: dict[str, tuple[float, int, int]], depth: int) -> list[tuple[str, float, int, int]]:
    best = sorted(block.items(), key=lambda item: (-item[1][0], item[1][1]))  # score, then the rank column
    return [(d, score, rank, line) for d, (score, rank, line) in best[: depth or None]]


def count_run_queries(uri: str) -> int:
    """How many query blocks a run has (its queries, when each query's lines are together):
    a quick pass that sizes a progress counter."""
    count, current = 0, None
    for _, _, text in read_lines(uri):
        qid = text.split(maxsplit=1)[0] if text.strip() else current
        if qid != current:
            count, current = count + 1, qid
    return count


def read_trec_run(
    uri: str,
    depth: int = 0,
    query_ids: set[str] | None = None,
    doc_ids: Container[str] | None = None,
) -> dict[str, list[tuple[str, float, int]]]:
    """TREC run (``qid Q0 docid rank score tag`` per line) -> per query its candidates as
    (doc id, score, line), best first (ties broken by the rank column); with ``depth`` > 0
    only the best ``depth``. Errors name the file and line: a malformed line, a score that is
    not a finite number, a document listed twice for a query, and with ``query_ids`` /
    ``doc_ids`` an id outside them. A run without a line is an error too.

    Memory: the whole run (cut to ``depth``). A query whose lines come in several blocks is
    merged; with a depth, a document repeated across blocks is then caught only if its first
    mention was kept. Jobs over large runs stream :func:`iter_trec_run` instead.
    """
    kept: dict[str, list[tuple[str, float, int, int]]] = {}  # (doc, score, rank, line)
    current, block = None, {}
    source = storage.resolve(uri).uri
    for source, number, qid, did, rank, score in _trec_lines(uri, query_ids, doc_ids):
        if qid != current:
            if current is not None:
                kept[current] = _best(block, depth)
            current = qid
            block = {d: (score_, rank_, line) for d, score_, rank_, line in kept.pop(qid, [])}
        if did in block:
            raise line_error(
                source, number, f"document {did!r} listed twice for query {qid!r} (first at line {block[did][2]})"
            )
        block[did] = (score, rank, number)
    if current is not None:
        kept[current] = _best(block, depth)
    if not kept:
        raise InputError(f"{source}: the run holds no candidates", source=source)
    return {q: [(d, score, line) for d, score, _, line in ranked] for q, ranked in kept.items()}


def iter_trec_run(
    uri: str, depth: int = 0, query_ids: set[str] | None = None
) -> Iterator[tuple[str, list[tuple[str, float, int]]]]:
    """:func:`read_trec_run` a query at a time: (query id, its best ``depth`` candidates as
    (doc id, score, line)), in the run's order. Holds one query's lines (and the ids of the
    queries seen): the run must list each query's lines together, as every TREC tool and
    raydense's own jobs write them; a query whose lines resume later is an error at that line."""
    started: dict[str, int] = {}  # query id -> line of its first candidate
    current, block = None, {}
    source = storage.resolve(uri).uri
    for source, number, qid, did, rank, score in _trec_lines(uri, query_ids, None):
        if qid != current:
            if current is not None:
                yield current, [(d, score_, line) for d, score_, _, line in _best(block, depth)]
            if qid in started:
                raise line_error(
                    source,
                    number,
                    f"query {qid!r} again, after other queries (its lines began at line {started[qid]}): "
                    "a run must list each query's lines together (sort it by query id: sort -s -k1,1)",
                )
            current, block, started[qid] = qid, {}, number
        if did in block:
            raise line_error(
                source, number, f"document {did!r} listed twice for query {qid!r} (first at line {block[did][2]})"
            )
        block[did] = (score, rank, number)
    if current is None:
        raise InputError(f"{source}: the run holds no candidates", source=source)
    yield current, [(d, score_, line) for d, score_, _, line in _best(block, depth)]


def write_trec_run(run: dict[str, dict[str, float]], uri: str, tag: str = "raydense") -> None:
    with storage.open_output(uri) as out:
        for qid, docs in run.items():
            ranked = sorted(docs.items(), key=lambda kv: -kv[1])
            write_trec_lines(out, qid, [d for d, _ in ranked], [s for _, s in ranked], tag)


def write_trec_lines(out, qid: str, ranked_ids: list[str], scores, tag: str = "raydense") -> None:
    """One query's ranking, best first, as TREC run lines on an open output (a streamed run)."""
    out.write(
        "".join(f"{qid} Q0 {d} {r} {s:.6f} {tag}\n" for r, (d, s) in enumerate(zip(ranked_ids, scores), 1)).encode()
    )
