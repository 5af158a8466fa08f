"""BEIR queries and qrels.

- queries, ``queries.jsonl``: ``{"_id": str|number, "text": str}`` per line. Empty text and
  duplicate ids are errors.
- qrels, ``qrels/*.tsv``: ``query-id<TAB>corpus-id<TAB>score`` with an integer score; score > 0
  marks a positive, score <= 0 a judged non-relevant document. The header line ``query-id corpus-id
  score`` is expected; a file whose first row already has an integer score is read as having no
  header (TREC-style tools write such files), and any other first row is an error. Whitespace other
  than a tab also separates columns when a line has no tab. A pair judged twice is an error.
"""

from __future__ import annotations

from collections.abc import Container

from pipeline.data.records import (
    check_new,
    get_field,
    json_lines,
    line_error,
    read_lines,
)

QRELS_HEADER = ("query-id", "corpus-id", "score")


def read_queries(uri: str) -> dict[str, str]:
    """BEIR queries.jsonl -> {query id: text}, in file order."""
    queries: dict[str, str] = {}
    lines: dict[str, int] = {}
    for source, number, obj in json_lines(uri):
        qid = get_field(obj, "_id", None, source, number)
        text = get_field(obj, "text", str, source, number)
        if not text.strip():
            raise line_error(source, number, f"empty text (query {qid})")
        check_new(lines, qid, "query id", source, number)
        queries[qid] = text
    return queries


def read_qrels(
    uri: str, doc_ids: Container[str] | None = None, query_ids: set[str] | None = None
) -> dict[str, dict[str, int]]:
    """BEIR qrels TSV -> {query id: {doc id: score}} (every judgment, including score <= 0).

    With ``doc_ids`` / ``query_ids`` a judgment naming a document / query outside them is an error:
    it means the qrels belong to another corpus or split.
    """
    qrels: dict[str, dict[str, int]] = {}
    first_line: dict[tuple[str, str], int] = {}
    header_checked = False
    for source, number, text in read_lines(uri):
        cols = text.split("\t") if "\t" in text else text.split()
        cols = [c.strip() for c in cols]
        if len(cols) != 3:
            raise line_error(source, number, f"expected 3 columns (query-id, corpus-id, score), got {len(cols)}")
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
        if query_ids is not None and qid not in query_ids:
            raise line_error(source, number, f"unknown query id {qid!r} (not in the queries)")
        if doc_ids is not None and did not in doc_ids:
            raise line_error(source, number, f"unknown document id {did!r} (not in the corpus)")
        if (qid, did) in first_line:
            raise line_error(
                source, number, f"duplicate judgment ({qid!r}, {did!r}) (first at line {first_line[qid, did]})"
            )
        first_line[qid, did] = number
        qrels.setdefault(qid, {})[did] = score
    return qrels


def positives(judged: dict[str, int]) -> list[str]:
    """The judged-relevant (score > 0) document ids, in qrels order."""
    return [did for did, score in judged.items() if score > 0]
