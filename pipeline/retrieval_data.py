"""Retriever training data: reading, validating, joining and writing it.

Formats (every path a local file or an ``s3://`` URI; a name ending in ``.gz`` is gzip):

- queries, BEIR ``queries.jsonl``: ``{"_id": str|number, "text": str}`` per line. Empty text and
  duplicate ids are errors.
- qrels, BEIR ``qrels/*.tsv``: ``query-id<TAB>corpus-id<TAB>score`` with an integer score; score > 0
  marks a positive, score <= 0 a judged non-relevant document. The header line ``query-id corpus-id
  score`` is expected; a file whose first row already has an integer score is read as having no
  header (TREC-style tools write such files), and any other first row is an error. Whitespace other
  than a tab also separates columns when a line has no tab. A pair judged twice is an error.
- negatives (written by ``jobs/bm25_negatives.py``): ``{"query_id": str, "negatives": [docid, ...],
  "scores": [float, ...]}`` per line, negatives best-ranked first; ``scores`` is optional.
- Tevatron train jsonl: ``{"query_id", "query", "positive_passages": [{"docid", "title", "text"}],
  "negative_passages": [...]}`` per line.
- TREC run (a teacher's scores for distillation): ``qid Q0 docid rank score tag`` per line.

Errors are :class:`pipeline.corpus.CorpusError` (a ValueError) naming the file and 1-based line.
Skips that a real collection legitimately has (a query without a positive, a mined negative that is
in fact judged positive) are counted in :class:`DataStats` instead, with the first few examples.

Training records carry ids, not passage text: the trainer joins passages to queries by id with
Ray Data, so that no worker has to hold the whole corpus.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from pipeline import storage
from pipeline.corpus import MAX_SKIPPED_EXAMPLES, CorpusError, decode_line, json_type, numbered_lines, iter_documents

QRELS_HEADER = ("query-id", "corpus-id", "score")


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


# ---------------------------------------------------------------- reading helpers


def _lines(uri: str) -> Iterator[tuple[str, int, str]]:
    """(file, 1-based number, text) of each non-blank line. The corpus reader's line reader
    gunzips ``*.jsonl.gz`` itself; pyarrow detects other ``*.gz`` names (e.g. ``qrels.tsv.gz``)."""
    source = storage.resolve(uri).uri
    try:
        for number, raw in numbered_lines(source):
            text = decode_line(source, number, raw)
            if text.strip():
                yield source, number, text
    except OSError as exc:
        if isinstance(exc, storage.StorageError):
            raise
        raise CorpusError(f"{source}: cannot read ({exc})", source=source) from exc


def _fail(source: str, number: int, problem: str) -> CorpusError:
    return CorpusError(f"{source} line {number}: {problem}", source=source, line=number)


def _json_lines(uri: str) -> Iterator[tuple[str, int, dict]]:
    for source, number, text in _lines(uri):
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise _fail(source, number, f"malformed JSON ({getattr(exc, 'msg', exc)})") from exc
        if not isinstance(obj, dict):
            raise _fail(source, number, f"expected a JSON object, got {json_type(obj)}")
        yield source, number, obj


def _as_id(value: Any, what: str, source: str, number: int) -> str:
    """An id: a non-empty string or a finite number (BEIR files use both), as str."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise _fail(source, number, f"{what} must be a string or a number, got {json_type(value)}")
    if not str(value):
        raise _fail(source, number, f"{what} is empty")
    return str(value)


def _get(obj: dict, key: str, kind: type | None, source: str, number: int, *,
         default: Any = ..., ctx: str = "") -> Any:
    """Field ``key`` of ``obj``, checked to be a ``kind`` (None: an id). ``ctx`` prefixes messages."""
    if key not in obj:
        if default is not ...:
            return default
        raise _fail(source, number, f"{ctx}missing field {key!r}")
    if kind is None:
        return _as_id(obj[key], f"{ctx}field {key!r}", source, number)
    if not isinstance(obj[key], kind):
        expected = {str: "a string", list: "an array"}[kind]
        raise _fail(source, number, f"{ctx}field {key!r} must be {expected}, got {json_type(obj[key])}")
    return obj[key]


def _check_new(seen: dict[str, int], key: str, what: str, source: str, number: int) -> None:
    if key in seen:
        raise _fail(source, number, f"duplicate {what} {key!r} (first at line {seen[key]})")
    seen[key] = number


# ---------------------------------------------------------------- BEIR queries, qrels, negatives


def read_queries(uri: str) -> dict[str, str]:
    """BEIR queries.jsonl -> {query id: text}, in file order."""
    queries: dict[str, str] = {}
    lines: dict[str, int] = {}
    for source, number, obj in _json_lines(uri):
        qid = _get(obj, "_id", None, source, number)
        text = _get(obj, "text", str, source, number)
        if not text.strip():
            raise _fail(source, number, f"empty text (query {qid})")
        _check_new(lines, qid, "query id", source, number)
        queries[qid] = text
    return queries


def read_qrels(uri: str, doc_ids: set[str] | None = None,
               query_ids: set[str] | None = None) -> dict[str, dict[str, int]]:
    """BEIR qrels TSV -> {query id: {doc id: score}} (every judgment, including score <= 0).

    With ``doc_ids`` / ``query_ids`` a judgment naming a document / query outside them is an error:
    it means the qrels belong to another corpus or split.
    """
    qrels: dict[str, dict[str, int]] = {}
    first_line: dict[tuple[str, str], int] = {}
    header_checked = False
    for source, number, text in _lines(uri):
        cols = text.split("\t") if "\t" in text else text.split()
        cols = [c.strip() for c in cols]
        if len(cols) != 3:
            raise _fail(source, number, f"expected 3 columns (query-id, corpus-id, score), got {len(cols)}")
        qid, did, score_text = cols
        try:
            score = int(score_text)
        except ValueError:
            score = None
        if not header_checked:
            header_checked = True
            if score is None:
                if tuple(c.lower() for c in cols) != QRELS_HEADER:
                    raise _fail(source, number, f"expected the header {' '.join(QRELS_HEADER)!r} "
                                                f"or a judgment with an integer score, got {text!r}")
                continue
        if score is None:
            raise _fail(source, number, f"score must be an integer, got {score_text!r}")
        if not qid or not did:
            raise _fail(source, number, "empty query id or document id")
        if query_ids is not None and qid not in query_ids:
            raise _fail(source, number, f"unknown query id {qid!r} (not in the queries)")
        if doc_ids is not None and did not in doc_ids:
            raise _fail(source, number, f"unknown document id {did!r} (not in the corpus)")
        if (qid, did) in first_line:
            raise _fail(source, number, f"duplicate judgment ({qid!r}, {did!r}) "
                                        f"(first at line {first_line[qid, did]})")
        first_line[qid, did] = number
        qrels.setdefault(qid, {})[did] = score
    return qrels


def positives(judged: dict[str, int]) -> list[str]:
    """The judged-relevant (score > 0) document ids, in qrels order."""
    return [did for did, score in judged.items() if score > 0]


def read_negatives(uri: str, doc_ids: set[str] | None = None,
                   query_ids: set[str] | None = None) -> dict[str, list[str]]:
    """Negatives jsonl -> {query id: [doc id, ...]} in ranked order (``scores`` is not kept)."""
    negatives: dict[str, list[str]] = {}
    lines: dict[str, int] = {}
    for source, number, obj in _json_lines(uri):
        qid = _get(obj, "query_id", None, source, number)
        if query_ids is not None and qid not in query_ids:
            raise _fail(source, number, f"unknown query id {qid!r} (not in the queries)")
        _check_new(lines, qid, "query id", source, number)
        ids = [_as_id(d, f"negatives[{i}]", source, number)
               for i, d in enumerate(_get(obj, "negatives", list, source, number))]
        if len(set(ids)) != len(ids):
            raise _fail(source, number, f"query {qid!r} lists a negative twice")
        unknown = [d for d in ids if doc_ids is not None and d not in doc_ids]
        if unknown:
            raise _fail(source, number, f"unknown document id {unknown[0]!r} (not in the corpus)")
        negatives[qid] = ids
    return negatives


def read_trec_run(uri: str, depth: int = 0, query_ids: set[str] | None = None, doc_ids: set[str] | None = None,
                  ) -> dict[str, list[tuple[str, float, int]]]:
    """TREC run (``qid Q0 docid rank score tag`` per line) -> per query its candidates as
    (doc id, score, line), best first (ties broken by the rank column); with ``depth`` > 0
    only the best ``depth``. Errors name the file and line: a malformed line, a score that is
    not a finite number, a document listed twice for a query, and with ``query_ids`` /
    ``doc_ids`` an id outside them. A run without a line is an error too.

    Memory: a query's lines are held until the run moves to another query, then cut to
    ``depth``. A query whose lines come in several blocks is merged; with a depth, a document
    repeated across blocks is then caught only if its first mention was kept.
    """
    kept: dict[str, list[tuple[str, float, int, int]]] = {}  # (doc, score, rank, line)
    current, block = None, {}

    def close() -> None:
        if current is not None:
            best = sorted(block.items(), key=lambda item: (-item[1][0], item[1][1]))
            kept[current] = [(d, score, rank, line) for d, (score, rank, line) in best[:depth or None]]

    source = storage.resolve(uri).uri
    for source, number, text in _lines(uri):
        cols = text.split()
        if len(cols) != 6:
            raise _fail(source, number, f"expected 6 columns (qid Q0 docid rank score tag), got {len(cols)}")
        qid, _, did, rank_text, score_text, _ = cols
        try:
            rank, score = int(rank_text), float(score_text)
        except ValueError:
            raise _fail(source, number, f"rank must be an integer and score a number, got {rank_text!r} "
                                        f"and {score_text!r}") from None
        if not math.isfinite(score):
            raise _fail(source, number, f"score must be finite, got {score_text!r}")
        if query_ids is not None and qid not in query_ids:
            raise _fail(source, number, f"unknown query id {qid!r} (not in the queries)")
        if doc_ids is not None and did not in doc_ids:
            raise _fail(source, number, f"unknown document id {did!r} (not in the corpus)")
        if qid != current:
            close()
            current = qid
            block = {d: (score_, rank_, line) for d, score_, rank_, line in kept.pop(qid, [])}
        if did in block:
            raise _fail(source, number, f"document {did!r} listed twice for query {qid!r} "
                                        f"(first at line {block[did][2]})")
        block[did] = (score, rank, number)
    close()
    if not kept:
        raise CorpusError(f"{source}: the run holds no candidates", source=source)
    return {q: [(d, score, line) for d, score, _, line in ranked] for q, ranked in kept.items()}


def _write_line(out: BinaryIO, obj: dict) -> None:
    out.write(json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n")


def write_negatives(rows: Iterable[tuple[str, list[str], list[float] | None]], uri: str) -> int:
    """Write (query id, ranked negative ids, their scores or None) rows; returns the row count."""
    n = 0
    with storage.open_output(uri) as out:
        for qid, ids, scores in rows:
            _write_line(out, {"query_id": qid, "negatives": list(ids),
                              **({"scores": [round(float(s), 4) for s in scores]} if scores is not None else {})})
            n += 1
    return n


# ---------------------------------------------------------------- joining


def build_training_examples(queries: dict[str, str], qrels: dict[str, dict[str, int]],
                            negatives: dict[str, list[str]] | None = None,
                            ) -> tuple[list[TrainExample], DataStats]:
    """One example per query (in ``queries`` order) with at least one positive.

    A query without a positive judgment is skipped; a negative that is a judged positive is dropped
    (a mined "negative" that is relevant would teach the model the opposite); a query left without
    negatives is kept. These three are counted; negatives of queries not in ``queries`` are ignored.
    """
    stats = DataStats()
    examples = [TrainExample(qid, text, pos, _clean_negatives(qid, (negatives or {}).get(qid, []), set(pos), stats))
                for qid, text, pos in _judged_queries(queries, qrels, stats)]
    stats.examples = len(examples)
    return examples, stats


def _judged_queries(queries: dict[str, str], qrels: dict[str, dict[str, int]],
                    stats: DataStats) -> Iterator[tuple[str, str, list[str]]]:
    """(id, text, positives) of each query with a positive, in ``queries`` order; the others
    are counted as ``skipped_no_positive``."""
    for qid, text in queries.items():
        pos = positives(qrels.get(qid, {}))
        if pos:
            yield qid, text, pos
        else:
            stats.count("skipped_no_positive", qid)


def load_training_examples(queries: str, qrels: str, negatives: str = "", doc_ids: set[str] | None = None,
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


def build_distillation_examples(queries: dict[str, str], qrels: dict[str, dict[str, int]],
                                teacher_run: dict[str, list[tuple[str, float, int]]], depth: int = 0,
                                source: str = "") -> tuple[list[TrainExample], DistillDataStats]:
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
            raise ValueError(f"query {qid!r}: judged positive {missing[0]!r} has no teacher score{where} (the "
                             "scoring stage scores every judged positive: is the run of these qrels?)")
        judged = set(pos)
        negatives = [d for d, _, _ in ranked if d not in judged][:depth or None]
        if not negatives:
            stats.count("skipped_no_scored_negative", qid)
            continue
        examples.append(TrainExample(qid, text, pos, negatives, [scored[d] for d in pos + negatives]))
    stats.examples = len(examples)
    return examples, stats


def load_distillation_examples(queries: str, qrels: str, teacher_scores: str, depth: int = 0,
                               doc_ids: set[str] | None = None) -> tuple[list[TrainExample], DistillDataStats]:
    """Read and validate BEIR queries + qrels and the teacher's TREC run, and join them as in
    :func:`build_distillation_examples`. With ``doc_ids``, ids outside the corpus are errors."""
    q = read_queries(queries)
    judged = read_qrels(qrels, doc_ids, set(q))
    run = read_trec_run(teacher_scores, query_ids=set(q), doc_ids=doc_ids)
    return build_distillation_examples(q, judged, run, depth, storage.resolve(teacher_scores).uri)


def _clean_negatives(qid: str, negs: list[str], pos: set[str], stats: DataStats) -> list[str]:
    kept = []
    for did in negs:
        if did in pos:
            stats.count("dropped_negative_is_positive", f"{qid}:{did}")
        else:
            kept.append(did)
    if not kept:
        stats.count("no_negatives", qid)
    return kept


# ---------------------------------------------------------------- Tevatron


def passage_lookup(corpus_uri: str, doc_ids: set[str] | None = None) -> Callable[[str], tuple[str, str]]:
    """docid -> (title, text) over a corpus read with :func:`pipeline.corpus.iter_documents`, which
    already joins a BEIR title into the text, so the title returned is "". Holds the texts of
    ``doc_ids`` (all documents when None) in memory: for a driver-side export, not for workers."""
    texts = {d.doc_id: d.text for d in iter_documents(corpus_uri)
             if doc_ids is None or d.doc_id in doc_ids}

    def lookup(doc_id: str) -> tuple[str, str]:
        return "", texts[doc_id]

    return lookup


def write_tevatron(examples: Iterable[TrainExample], corpus_lookup: Callable[[str], tuple[str, str]],
                   uri: str) -> int:
    """Write examples as Tevatron train jsonl (local or S3, ``.gz`` for gzip); returns the count."""
    def passages(ids: list[str]) -> list[dict]:
        return [{"docid": d, "title": t, "text": x} for d in ids for t, x in [corpus_lookup(d)]]

    n = 0
    with storage.open_output(uri) as out:
        for ex in examples:
            _write_line(out, {"query_id": ex.query_id, "query": ex.query,
                              "positive_passages": passages(ex.positives),
                              "negative_passages": passages(ex.negatives)})
            n += 1
    return n


def read_tevatron(uri: str, stats: DataStats | None = None) -> Iterator[dict]:
    """Validated Tevatron train records, with :func:`build_training_examples`' rules: a record
    without positive passages is skipped, a negative passage whose docid is also positive is
    dropped, both counted in ``stats``; duplicate query ids and missing fields are errors."""
    stats = stats if stats is not None else DataStats()
    lines: dict[str, int] = {}
    for source, number, obj in _json_lines(uri):
        qid = _get(obj, "query_id", None, source, number)
        _check_new(lines, qid, "query id", source, number)
        query = _get(obj, "query", str, source, number)
        if not query.strip():
            raise _fail(source, number, f"empty query (query {qid})")
        pos = _passages(obj, "positive_passages", source, number)
        neg = _passages(obj, "negative_passages", source, number)
        if not pos:
            stats.count("skipped_no_positive", qid)
            continue
        kept = set(_clean_negatives(qid, [p["docid"] for p in neg], {p["docid"] for p in pos}, stats))
        stats.examples += 1
        yield {"query_id": qid, "query": query, "positive_passages": pos,
               "negative_passages": [p for p in neg if p["docid"] in kept]}


def _passages(obj: dict, key: str, source: str, number: int) -> list[dict]:
    out = []
    for i, p in enumerate(_get(obj, key, list, source, number)):
        ctx = f"{key}[{i}]: "
        if not isinstance(p, dict):
            raise _fail(source, number, f"{ctx}expected an object, got {json_type(p)}")
        out.append({"docid": _get(p, "docid", None, source, number, ctx=ctx),
                    "title": _get(p, "title", str, source, number, default="", ctx=ctx),
                    "text": _get(p, "text", str, source, number, ctx=ctx)})
    return out


def tevatron_example(record: dict) -> TrainExample:
    """The id-only :class:`TrainExample` of a Tevatron record."""
    return TrainExample(record["query_id"], record["query"],
                        [p["docid"] for p in record["positive_passages"]],
                        [p["docid"] for p in record["negative_passages"]])


# -- training groups, rotated across epochs ---------------------------------------------

def _query_seed(seed: int, query_id: str) -> int:
    """A per-query seed that is the same in every process (Python's hash() is salted)."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}\x00{query_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def select_group(example: TrainExample, epoch: int, group_size: int, seed: int = 0,
                 fallback: list | None = None) -> list:
    """The ``group_size`` passage ids a query trains on in ``epoch``: positive first.

    As in Tevatron, the positive rotates through the query's positives, and the negatives
    are a fixed per-query shuffle read through a window that slides by ``group_size - 1``
    each epoch, so over ``len(negatives) / (group_size - 1)`` epochs every negative is
    used once. A query with fewer negatives than the window samples its own with
    replacement; one with none draws from ``fallback`` (e.g. a seeded sample of corpus ids;
    its positives are never drawn), so every group has the same size.
    """
    return select_group_with_sources(example, epoch, group_size, seed, fallback)[0]


def select_group_with_sources(example: TrainExample, epoch: int, group_size: int, seed: int = 0,
                              fallback: list | None = None) -> tuple[list, "np.ndarray"]:
    """:func:`select_group`'s passages, and where each one came from: its index in
    ``[*example.positives, *example.negatives]``, or -1 for a passage drawn from
    ``fallback``. Per-passage data (teacher scores) follows the choice through it."""
    import numpy as np

    if not len(example.positives):  # lists of ids, or arrays of corpus rows
        raise ValueError(f"query {example.query_id!r} has no positive")
    key = _query_seed(seed, example.query_id)
    positive_index = (key + epoch) % len(example.positives)
    positive = example.positives[positive_index]
    k = group_size - 1
    if k <= 0:
        return [positive], np.array([positive_index], dtype=np.int64)
    negatives, offset = list(example.negatives), len(example.positives)
    if not negatives:
        excluded = set(example.positives)
        negatives, offset = [d for d in (fallback or []) if d not in excluded], None
        if not negatives:
            raise ValueError(f"query {example.query_id!r} has no negatives and no fallback passages")
    rng = np.random.default_rng([key % 2**63, epoch])
    if len(negatives) < k:
        chosen = rng.integers(len(negatives), size=k)
    else:
        order = np.random.default_rng(key % 2**63).permutation(len(negatives))
        start = epoch * k % len(negatives)
        chosen = np.concatenate([order, order])[start:start + k]
    sources = np.concatenate([[positive_index], chosen + offset if offset is not None else np.full(k, -1)])
    return [positive] + [negatives[i] for i in chosen], sources.astype(np.int64)


def extract_tevatron_corpus(uri: str, corpus_uri: str) -> int:
    """Write the distinct passages of a Tevatron file as a BEIR corpus jsonl; returns their count.

    Streams: only each docid and a digest of its text are kept, to check that a passage
    repeated across records has the same text every time (else the join by id would be
    ambiguous, and that is an error naming both lines).
    """
    import hashlib

    seen: dict[str, tuple[bytes, int]] = {}
    with storage.open_output(corpus_uri) as out:
        for source, number, obj in _json_lines(uri):
            for key in ("positive_passages", "negative_passages"):
                for p in _passages(obj, key, source, number):
                    title, text = p["title"], p["text"]
                    digest = hashlib.blake2b(f"{title}\x00{text}".encode("utf-8"), digest_size=16).digest()
                    first = seen.get(p["docid"])
                    if first is None:
                        if not (title + text).strip():
                            raise _fail(source, number, f"{key}: passage {p['docid']!r} has empty text")
                        seen[p["docid"]] = (digest, number)
                        _write_line(out, {"_id": p["docid"], "title": title, "text": text})
                    elif first[0] != digest:
                        raise _fail(source, number, f"{key}: passage {p['docid']!r} has another text than on "
                                                    f"line {first[1]}")
    return len(seen)
