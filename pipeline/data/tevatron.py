"""Tevatron train jsonl: ``{"query_id", "query", "positive_passages": [{"docid", "title", "text"}],
"negative_passages": [...]}`` per line; read, validated, written, and split into a corpus."""

from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Iterator

from pipeline.core import storage
from pipeline.data.corpus import iter_documents, json_type
from pipeline.data.examples import DataStats, TrainExample
from pipeline.data.records import (
    check_new,
    get_field,
    json_lines,
    line_error,
    write_json_line,
)


def passage_lookup(corpus_uri: str, doc_ids: set[str] | None = None) -> Callable[[str], tuple[str, str]]:
    """docid -> (title, text) over a corpus read with :func:`pipeline.data.corpus.iter_documents`, which
    already joins a BEIR title into the text, so the title returned is "". Holds the texts of
    ``doc_ids`` (all documents when None) in memory: for a driver-side export, not for workers."""
    texts = {d.doc_id: d.text for d in iter_documents(corpus_uri) if doc_ids is None or d.doc_id in doc_ids}

    def lookup(doc_id: str) -> tuple[str, str]:
        return "", texts[doc_id]

    return lookup


def tevatron_record(
    qid: str,
    query: str,
    positive_ids: list[str],
    negative_ids: list[str],
    corpus_lookup: Callable[[str], tuple[str, str]] | None = None,
) -> dict:
    """One Tevatron training line. Without ``corpus_lookup`` the passages are ids with empty
    title and text (mining's: the text is joined from the corpus at training time)."""

    lookup = corpus_lookup or (lambda doc_id: ("", ""))

    def passages(ids: list[str]) -> list[dict]:
        return [{"docid": d, "title": t, "text": x} for d in ids for t, x in [lookup(d)]]

    return {
        "query_id": qid,
        "query": query,
        "positive_passages": passages(positive_ids),
        "negative_passages": passages(negative_ids),
    }


def write_tevatron(examples: Iterable[TrainExample], corpus_lookup: Callable[[str], tuple[str, str]], uri: str) -> int:
    """Write examples as Tevatron train jsonl (local or S3, ``.gz`` for gzip); returns the count."""
    n = 0
    with storage.open_output(uri) as out:
        for ex in examples:
            write_json_line(out, tevatron_record(ex.query_id, ex.query, ex.positives, ex.negatives, corpus_lookup))
            n += 1
    return n


def read_tevatron(uri: str, stats: DataStats | None = None) -> Iterator[dict]:
    """Validated Tevatron train records: a record without positive passages is skipped and
    counted in ``stats``; duplicate query ids, missing fields, a negative listed twice and a
    negative that is also a positive are errors at their line."""
    stats = stats if stats is not None else DataStats()
    lines: dict[str, int] = {}
    for source, number, obj in json_lines(uri):
        qid = get_field(obj, "query_id", None, source, number)
        check_new(lines, qid, "query id", source, number)
        query = get_field(obj, "query", str, source, number)
        if not query.strip():
            raise line_error(source, number, f"empty query (query {qid})")
        pos = _passages(obj, "positive_passages", source, number)
        neg = _passages(obj, "negative_passages", source, number)
        if not pos:
            stats.count("skipped_no_positive", qid)
            continue
        _audit_negatives(qid, [p["docid"] for p in pos], [p["docid"] for p in neg], source, number)
        if not neg:
            stats.count("no_negatives", qid)  # kept: its groups draw random corpus passages
        stats.examples += 1
        yield {"query_id": qid, "query": query, "positive_passages": pos, "negative_passages": neg}


def _passages(obj: dict, key: str, source: str, number: int) -> list[dict]:
    out = []
    for i, p in enumerate(get_field(obj, key, list, source, number)):
        ctx = f"{key}[{i}]: "
        if not isinstance(p, dict):
            raise line_error(source, number, f"{ctx}expected an object, got {json_type(p)}")
        out.append(
            {
                "docid": get_field(p, "docid", None, source, number, ctx=ctx),
                "title": get_field(p, "title", str, source, number, default="", ctx=ctx),
                "text": get_field(p, "text", str, source, number, ctx=ctx),
            }
        )
    return out


def _audit_negatives(qid: str, positive: list[str], negative: list[str], source: str, number: int) -> None:
    """A record's negatives, audited as a negatives file's are: none listed twice, none a
    positive of the record."""
    seen: set[str] = set()
    for doc_id in negative:
        if doc_id in seen:
            raise line_error(source, number, f"query {qid!r} lists negative {doc_id!r} twice")
        if doc_id in positive:
            raise line_error(source, number, f"query {qid!r}: negative {doc_id!r} is also one of its positive passages")
        seen.add(doc_id)


def tevatron_example(record: dict) -> TrainExample:
    """The id-only :class:`TrainExample` of a Tevatron record."""
    return TrainExample(
        record["query_id"],
        record["query"],
        [p["docid"] for p in record["positive_passages"]],
        [p["docid"] for p in record["negative_passages"]],
    )


def extract_tevatron_corpus(uri: str, corpus_uri: str) -> int:
    """Write the distinct passages of a Tevatron file as a BEIR corpus jsonl; returns their count.

    Streams: only each docid and a digest of its text are kept, to check that a passage
    repeated across records has the same text every time (else the join by id would be
    ambiguous, and that is an error naming both lines).
    """

    seen: dict[str, tuple[bytes, int]] = {}
    with storage.open_output(corpus_uri) as out:
        for source, number, obj in json_lines(uri):
            for key in ("positive_passages", "negative_passages"):
                for p in _passages(obj, key, source, number):
                    title, text = p["title"], p["text"]
                    digest = hashlib.blake2b(f"{title}\x00{text}".encode("utf-8"), digest_size=16).digest()
                    first = seen.get(p["docid"])
                    if first is None:
                        if not (title + text).strip():
                            raise line_error(source, number, f"{key}: passage {p['docid']!r} has empty text")
                        seen[p["docid"]] = (digest, number)
                        write_json_line(out, {"_id": p["docid"], "title": title, "text": text})
                    elif first[0] != digest:
                        raise line_error(
                            source, number, f"{key}: passage {p['docid']!r} has another text than on line {first[1]}"
                        )
    return len(seen)
