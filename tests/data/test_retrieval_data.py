import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.core import storage
from pipeline.core.errors import InputError
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.examples import (
    DataStats,
    TrainExample,
    build_training_examples,
    load_training_examples,
)
from pipeline.data.runs import read_negatives, write_negatives
from pipeline.data.tevatron import (
    passage_lookup,
    read_tevatron,
    tevatron_example,
    write_tevatron,
)


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode()) if path.name.endswith(".gz") else text.encode())
    return str(path)


def jsonl(*objs) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def fails(match: str):
    return pytest.raises(InputError, match=match)


# ---------------------------------------------------------------- queries


def test_read_queries(tmp_path):
    path = write(
        tmp_path / "q.jsonl.gz", jsonl({"_id": "a", "text": "first"}, {"_id": 7, "text": "seven", "x": 1}) + "\n"
    )
    assert read_queries(path) == {"a": "first", "7": "seven"}


@pytest.mark.parametrize(
    "lines, message",
    [
        ('{"_id": "a", "text": "x"}\n{"_id": "b", "text": \n', r"q\.jsonl line 2: malformed JSON"),
        ("[1, 2]\n", r"line 1: expected a JSON object, got array"),
        ('{"text": "x"}\n', r"line 1: missing field '_id'"),
        ('{"_id": "a"}\n', r"line 1: missing field 'text'"),
        ('{"_id": "a", "text": 3}\n', r"line 1: field 'text' must be a string, got number"),
        ('{"_id": "a", "text": "  "}\n', r"line 1: empty text \(query a\)"),
        (
            '{"_id": "a", "text": "x"}\n\n{"_id": "a", "text": "y"}\n',
            r"line 3: duplicate query id 'a' \(first at line 1\)",
        ),
    ],
)
def test_read_queries_errors(tmp_path, lines, message):
    path = write(tmp_path / "q.jsonl", lines)
    with fails(message) as info:
        read_queries(path)
    assert info.value.source == path


# ---------------------------------------------------------------- qrels


def test_read_qrels_header_scores_and_gzip(tmp_path):
    text = "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0\nq2\td1\t2\n\n"
    expected = {"q1": {"d1": 1, "d2": 0}, "q2": {"d1": 2}}
    assert read_qrels(write(tmp_path / "a.tsv", text)) == expected
    assert read_qrels(write(tmp_path / "a.tsv.gz", text), doc_ids={"d1", "d2"}, query_ids={"q1", "q2"}) == expected
    # No header: accepted when the first row already has an integer score (space-separated too).
    assert read_qrels(write(tmp_path / "b.tsv", "q1 d1 1\nq1\td2\t0\n")) == {"q1": {"d1": 1, "d2": 0}}


@pytest.mark.parametrize(
    "text, message",
    [
        ("qid\tdocid\trel\nq1\td1\t1\n", r"a\.tsv line 1: expected the header 'query-id corpus-id score'"),
        ("query-id\tcorpus-id\tscore\nq1\td1\n", r"line 2: expected 3 columns"),
        ("query-id\tcorpus-id\tscore\nq1\td1\thigh\n", r"line 2: score must be an integer, got 'high'"),
        ("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\tnope\t1\n", r"line 3: unknown document id 'nope'"),
        ("query-id\tcorpus-id\tscore\nq9\td1\t1\n", r"line 2: unknown query id 'q9'"),
        ("q1\td1\t1\nq1\td2\t1\nq1\td1\t0\n", r"line 3: duplicate judgment \('q1', 'd1'\) \(first at line 1\)"),
    ],
)
def test_read_qrels_errors(tmp_path, text, message):
    with fails(message):
        read_qrels(write(tmp_path / "a.tsv", text), doc_ids={"d1", "d2"}, query_ids={"q1"})


def test_the_earliest_bad_judgment_is_reported_whatever_its_kind(tmp_path):
    """Unknown ids and repeated pairs are found once the file is read: the one reported is
    the earliest line, as when each line was checked as it was read."""
    lines = ["q1\td1\t1", "q1\td2\t1", "q1\tnope\t1", "q1\td1\t0", "q9\td1\t1"]
    with fails(r"line 3: unknown document id 'nope'"):
        read_qrels(write(tmp_path / "a.tsv", "\n".join(lines) + "\n"), doc_ids={"d1", "d2"}, query_ids={"q1"})
    with fails(r"line 4: duplicate judgment \('q1', 'd1'\) \(first at line 1\)"):
        read_qrels(write(tmp_path / "b.tsv", "\n".join(lines) + "\n"), query_ids={"q1"})
    with fails(r"line 4: unknown query id 'q9'"):
        read_qrels(write(tmp_path / "c.tsv", "\n".join(lines[:3] + lines[4:]) + "\n"), query_ids={"q1"})


def test_queries_and_judgments_are_held_in_arrays_in_file_order(tmp_path):
    """20,000 queries of one or two judgments, read as a job's driver reads them: the same
    mappings as dicts of Python strings built from the files by hand (file order kept), in
    under a third of their bytes (tracemalloc: what the readers keep), and a peak while
    reading of under 2.5x what they keep."""
    import random
    import tracemalloc

    rng = random.Random(0)
    words = "how do plants grow in the dark under deep water when light is rare".split()
    n = 20_000
    ids = [str(rng.randrange(10**9)) + f"-{i}" for i in range(n)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in ids]
    judged = [
        (q, f"p{rng.randrange(9_000_000)}", rng.choice([0, 1, 2])) for q in ids for _ in range(rng.choice([1, 1, 2]))
    ]
    queries_path = write(tmp_path / "q.jsonl", jsonl(*({"_id": q, "text": t} for q, t in zip(ids, texts))))
    qrels_path = write(tmp_path / "q.tsv", "".join(f"{q}\t{d}\t{s}\n" for q, d, s in judged))

    tracemalloc.start()
    queries = read_queries(queries_path)
    qrels = read_qrels(qrels_path, query_ids=queries)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tracemalloc.start()  # the dicts of Python strings the readers returned before
    by_hand: dict = {}
    for line in open(queries_path, encoding="utf-8"):
        query = json.loads(line)
        by_hand[query["_id"]] = query["text"]
    judgments: dict = {}
    for line in open(qrels_path, encoding="utf-8"):
        q, d, score = line.split("\t")
        judgments.setdefault(q, {})[d] = int(score)
    dict_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()

    assert list(queries.items()) == list(zip(ids, texts)) and list(queries) == ids
    assert list(queries.items()) == list(by_hand.items())
    assert list(qrels) == list(judgments) and all(qrels[q] == judgments[q] for q in ids[::97])
    assert dict(qrels.items()) == judgments and qrels.get("not-a-query", {}) == {}
    assert queries.ids(5, 8) == ids[5:8] and queries.texts(n - 2, n + 5) == texts[-2:]
    assert queries.text_rows[10:12] == texts[10:12] and queries[ids[123]] == texts[123]
    assert ids[77] in queries and "nope" not in queries and len(queries) == n and len(qrels) == n
    assert held < dict_bytes / 3, (held / n, dict_bytes / n)
    assert peak < 2.5 * held, (peak / n, held / n)


# ---------------------------------------------------------------- negatives


def test_negatives_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "n" / "neg.jsonl")
    assert write_negatives([("q1", ["d3", "d2"], [2.5, 1.0]), ("q2", [], None)], path) == 2
    assert [json.loads(x) for x in Path(path).read_text().splitlines()] == [
        {"query_id": "q1", "negatives": ["d3", "d2"], "scores": [2.5, 1.0]},
        {"query_id": "q2", "negatives": []},
    ]
    assert read_negatives(path, doc_ids={"d2", "d3"}, query_ids={"q1", "q2"}) == {"q1": ["d3", "d2"], "q2": []}
    for text, message in [
        (jsonl({"query_id": "q1"}), r"neg\.jsonl line 1: missing field 'negatives'"),
        (jsonl({"query_id": "q1", "negatives": "d2"}), r"line 1: field 'negatives' must be an array"),
        (jsonl({"query_id": "q1", "negatives": ["d2", None]}), r"line 1: negatives\[1\] must be a string or a number"),
        (jsonl({"query_id": "q1", "negatives": ["d2", "d2"]}), r"line 1: query 'q1' lists negative 'd2' twice"),
        (
            '{"query_id": "q1", "negatives": ["d2", "d3"], "scores": [1.0, NaN]}\n',
            r"line 1: query 'q1': negative 'd3' has the score nan, not a finite number",
        ),
        (
            jsonl({"query_id": "q1", "negatives": ["d2", "d3"], "scores": [1.0]}),
            r"line 1: query 'q1': expected a list of 2 scores, one per negative",
        ),
        (jsonl({"query_id": "q1", "negatives": ["d9"]}), r"line 1: unknown document id 'd9'"),
        (
            jsonl({"query_id": "q1", "negatives": []}, {"query_id": "q1", "negatives": []}),
            r"line 2: duplicate query id 'q1' \(first at line 1\)",
        ),
    ]:
        with fails(message):
            read_negatives(write(tmp_path / "neg.jsonl", text), doc_ids={"d2", "d3"})


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="killed mid-write"):
        with storage.open_output(str(tmp_path / "out.jsonl")) as out:
            out.write(b"half")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- joining


QUERIES = {"q1": "first query", "q2": "only judged non-relevant", "q3": "no qrels at all", "q4": "fourth"}
QRELS = {"q1": {"d1": 1, "d2": 0}, "q2": {"d2": 0}, "q4": {"d4": 1, "d5": 2}}
NEGATIVES = {"q1": ["d2", "d1", "d3"], "q4": ["d5"], "q9": ["d1"]}


def test_build_training_examples_skips_drops_and_counts():
    examples, stats = build_training_examples(QUERIES, QRELS, NEGATIVES)
    assert examples == [
        TrainExample("q1", "first query", ["d1"], ["d2", "d3"]),
        TrainExample("q4", "fourth", ["d4", "d5"], []),
    ]
    assert stats == DataStats(
        examples=2,
        skipped_no_positive=2,
        skipped_no_positive_examples=["q2", "q3"],
        dropped_negative_is_positive=2,
        dropped_negative_is_positive_examples=["q1:d1", "q4:d5"],
        no_negatives=1,
        no_negatives_examples=["q4"],
    )
    assert examples[0].as_dict() == {
        "query_id": "q1",
        "query": "first query",
        "positives": ["d1"],
        "negatives": ["d2", "d3"],
    }


# ---------------------------------------------------------------- Tevatron


def test_beir_to_tevatron_round_trip(tmp_path):
    corpus = write(
        tmp_path / "beir" / "corpus.jsonl",
        jsonl(
            *({"_id": f"d{i}", "title": "T" if i == 1 else "", "text": f"text {i} \u201cq\u201d"} for i in range(1, 6))
        ),
    )
    queries = read_queries(
        write(tmp_path / "beir" / "queries.jsonl", jsonl(*({"_id": k, "text": v} for k, v in QUERIES.items())))
    )
    qrels = read_qrels(
        write(
            tmp_path / "beir" / "qrels.tsv",
            "query-id\tcorpus-id\tscore\n"
            + "".join(f"{q}\t{d}\t{s}\n" for q, ds in QRELS.items() for d, s in ds.items()),
        )
    )
    examples, _ = build_training_examples(queries, qrels, NEGATIVES)
    negatives = str(tmp_path / "beir" / "neg.jsonl")
    # A negatives file as mining writes it (judged positives left out): read from files, the
    # same examples as corpus rows, and the same counts but the drops.
    mined = {q: [d for d in NEGATIVES[q] if qrels.get(q, {}).get(d, 0) <= 0] for q in ("q1", "q4")}
    write_negatives([(q, ids, None) for q, ids in mined.items()], negatives)
    corpus_ids = CorpusIds.from_strings(f"d{i}" for i in range(1, 6))
    files = (str(tmp_path / "beir" / "queries.jsonl"), str(tmp_path / "beir" / "qrels.tsv"))
    rows, row_stats = load_training_examples(*files, negatives, corpus_ids)
    assert [
        TrainExample(e.query_id, e.query, corpus_ids.ids(e.positives), corpus_ids.ids(e.negatives)) for e in rows
    ] == examples
    built = build_training_examples(queries, qrels, NEGATIVES)[1]
    built.dropped_negative_is_positive, built.dropped_negative_is_positive_examples = 0, []
    assert row_stats == built
    # The audit: a file mined against other qrels (a judged positive among the negatives)
    # fails at its line, naming the query and the passage. Mutation: the check dropped, the
    # loader drops the positive and trains on the rest.
    write_negatives([(q, NEGATIVES[q], None) for q in ("q1", "q4")], negatives)
    with fails(r"neg\.jsonl line 1: query 'q1': negative 'd1' is a judged positive of the query in .*qrels\.tsv"):
        load_training_examples(*files, negatives, corpus_ids)
    assert rows.negatives.dtype == np.int32 and len(rows.negatives) == 2
    lookup = passage_lookup(corpus)
    out = str(tmp_path / "tev" / "train.jsonl.gz")
    assert write_tevatron(examples, lookup, out) == 2
    stats = DataStats()
    records = list(read_tevatron(out, stats))
    assert [tevatron_example(r) for r in records] == examples
    assert records[0]["positive_passages"] == [{"docid": "d1", "title": "", "text": "T\ntext 1 \u201cq\u201d"}]
    assert records[0]["negative_passages"][1] == {"docid": "d3", "title": "", "text": "text 3 \u201cq\u201d"}
    assert stats == DataStats(examples=2, no_negatives=1, no_negatives_examples=["q4"])


def test_write_tevatron_to_s3(s3_bucket):
    uri = f"s3://{s3_bucket}/tev/train.jsonl"
    example = TrainExample("q", "query", ["a"], ["b"])
    write_tevatron([example], lambda d: (f"title {d}", f"text {d}"), uri)
    assert [tevatron_example(r) for r in read_tevatron(uri)] == [example]
    assert json.loads(storage.read_bytes(uri))["negative_passages"] == [
        {"docid": "b", "title": "title b", "text": "text b"}
    ]


def passage(docid, text="t"):
    return {"docid": docid, "title": "", "text": text}


def test_read_tevatron_skips_and_drops(tmp_path):
    path = write(
        tmp_path / "t.jsonl",
        jsonl(
            {"query_id": "q1", "query": "a", "positive_passages": [], "negative_passages": [passage("x")]},
            {
                "query_id": 2,
                "query": "b",
                "positive_passages": [passage("p")],
                "negative_passages": [passage("n")],
            },
        ),
    )
    stats = DataStats()
    assert list(read_tevatron(path, stats)) == [
        {"query_id": "2", "query": "b", "positive_passages": [passage("p")], "negative_passages": [passage("n")]}
    ]
    assert stats == DataStats(examples=1, skipped_no_positive=1, skipped_no_positive_examples=["q1"])


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"query": "a", "positive_passages": [], "negative_passages": []},
            r"t\.jsonl line 2: missing field 'query_id'",
        ),
        ({"query_id": "q2", "positive_passages": [], "negative_passages": []}, r"line 2: missing field 'query'"),
        ({"query_id": "q2", "query": " ", "positive_passages": [], "negative_passages": []}, r"line 2: empty query"),
        ({"query_id": "q2", "query": "a", "negative_passages": []}, r"line 2: missing field 'positive_passages'"),
        (
            {"query_id": "q2", "query": "a", "positive_passages": [{"docid": "p"}], "negative_passages": []},
            r"line 2: positive_passages\[0\]: missing field 'text'",
        ),
        (
            {"query_id": "q2", "query": "a", "positive_passages": [passage("p")], "negative_passages": ["n"]},
            r"line 2: negative_passages\[0\]: expected an object, got string",
        ),
        (
            {"query_id": "q1", "query": "a", "positive_passages": [], "negative_passages": []},
            r"line 2: duplicate query id 'q1' \(first at line 1\)",
        ),
        (  # the audit of a record's negatives, as of a negatives file's
            {"query_id": "q2", "query": "a", "positive_passages": [passage("p")], "negative_passages": [passage("p")]},
            r"line 2: query 'q2': negative 'p' is also one of its positive passages",
        ),
        (
            {
                "query_id": "q2",
                "query": "a",
                "positive_passages": [passage("p")],
                "negative_passages": [passage("n"), passage("n")],
            },
            r"line 2: query 'q2' lists negative 'n' twice",
        ),
    ],
)
def test_read_tevatron_errors(tmp_path, record, message):
    first = {"query_id": "q1", "query": "a", "positive_passages": [passage("p")], "negative_passages": []}
    with fails(message):
        list(read_tevatron(write(tmp_path / "t.jsonl", jsonl(first, record))))


def test_tevatron_passages_become_a_corpus_each_once(tmp_path):
    from pipeline.data.corpus import iter_documents
    from pipeline.data.tevatron import extract_tevatron_corpus

    path = write(
        tmp_path / "t.jsonl",
        jsonl(
            {
                "query_id": "q1",
                "query": "a",
                "positive_passages": [passage("p", "pos text")],
                "negative_passages": [passage("n1", "one"), passage("n2", "two")],
            },
            {
                "query_id": "q2",
                "query": "b",
                "positive_passages": [passage("n1", "one")],
                "negative_passages": [passage("p", "pos text")],
            },
        ),
    )
    assert extract_tevatron_corpus(path, str(tmp_path / "corpus.jsonl")) == 3
    assert [(d.doc_id, d.text) for d in iter_documents(str(tmp_path / "corpus.jsonl"))] == [
        ("p", "pos text"),
        ("n1", "one"),
        ("n2", "two"),
    ]


@pytest.mark.parametrize(
    "second, message",
    [
        (
            passage("p", "other text"),
            r"t\.jsonl line 2: negative_passages: passage 'p' has another text than on line 1",
        ),
        (passage("e", " "), r"line 2: negative_passages: passage 'e' has empty text"),
    ],
)
def test_tevatron_corpus_errors(tmp_path, second, message):
    from pipeline.data.tevatron import extract_tevatron_corpus

    path = write(
        tmp_path / "t.jsonl",
        jsonl(
            {"query_id": "q1", "query": "a", "positive_passages": [passage("p", "pos text")], "negative_passages": []},
            {"query_id": "q2", "query": "b", "positive_passages": [passage("x")], "negative_passages": [second]},
        ),
    )
    with fails(message):
        extract_tevatron_corpus(path, str(tmp_path / "corpus.jsonl"))
    assert not (tmp_path / "corpus.jsonl").exists()  # nothing half-written


# -- training groups across epochs --------------------------------------------------------------


def test_groups_rotate_so_every_negative_is_used_once_per_cycle():
    from pipeline.data.examples import TrainExample
    from pipeline.data.groups import select_group

    ex = TrainExample("q1", "text", positives=["p1", "p2", "p3"], negatives=[f"n{i}" for i in range(21)])
    seen, positives = [], []
    for epoch in range(3):  # 21 negatives / windows of 7 = 3 epochs
        group = select_group(ex, epoch, group_size=8, seed=5)
        assert len(group) == 8 and group[0] in ex.positives
        positives.append(group[0])
        seen.extend(group[1:])
    assert sorted(seen) == sorted(ex.negatives)  # each exactly once
    assert sorted(positives) == ["p1", "p2", "p3"]  # the positive rotates through all of them
    assert select_group(ex, 1, 8, seed=5) == select_group(ex, 1, 8, seed=5)  # deterministic
    assert select_group(ex, 0, 8, seed=5) != select_group(ex, 0, 8, seed=6)


def test_groups_for_short_or_missing_negative_lists():
    from pipeline.data.examples import TrainExample
    from pipeline.data.groups import select_group

    short = TrainExample("q2", "t", positives=["p"], negatives=["a", "b"])
    group = select_group(short, 0, group_size=5)
    assert len(group) == 5 and set(group[1:]) <= {"a", "b"}
    bare = TrainExample("q3", "t", positives=["p", "x"], negatives=[])
    group = select_group(bare, 2, group_size=4, fallback=["x", "y", "z", "p"])
    assert len(group) == 4 and set(group[1:]) <= {"y", "z"}  # positives never drawn as negatives
    with pytest.raises(ValueError, match="no negatives and no fallback"):
        select_group(bare, 0, group_size=4)
    with pytest.raises(ValueError, match="no positive"):
        select_group(TrainExample("q4", "t", positives=[]), 0, 4)
    assert select_group(short, 3, group_size=1) == ["p"]


def test_margins_drop_exactly_the_candidates_too_close_to_the_positive():
    """A hand-built ranking: with the hardest positive at 0.80, an absolute margin of 0.05
    keeps candidates at or below 0.75, a relative one of 0.1 those at or below 0.72; both
    together, the stricter. A negative positive score lowers the ceiling by its magnitude
    (sentence-transformers' rule: pos - |pos| x margin, not pos x (1 - margin))."""
    from types import SimpleNamespace

    from pipeline.data.groups import margin_ceiling, select_negatives

    ids = [f"d{i}" for i in range(8)]
    scores = [0.95, 0.81, 0.80, 0.76, 0.75, 0.73, 0.72, 0.40]
    top = SimpleNamespace(count=10, sample="top", seed=0, skip_top=0)
    assert margin_ceiling(0.80, 0.05, None) == pytest.approx(0.75)
    assert margin_ceiling(0.80, None, 0.1) == pytest.approx(0.72)
    assert margin_ceiling(0.80, 0.05, 0.1) == pytest.approx(0.72)
    assert margin_ceiling(-2.0, None, 0.1) == pytest.approx(-2.2)
    assert margin_ceiling(0.80, None, None) == float("inf")

    def kept(ceiling, excluded=frozenset()):
        return select_negatives("q", ids, scores, set(excluded), top, ceiling)[0]

    assert kept(margin_ceiling(0.80, 0.05, None) + 1e-9) == ["d4", "d5", "d6", "d7"]
    assert kept(margin_ceiling(0.80, None, 0.1) + 1e-9) == ["d6", "d7"]
    assert kept(float("inf"), {"d2"}) == [d for d in ids if d != "d2"]  # no margin: positives only
    skipping = SimpleNamespace(count=1, sample="top", seed=0, skip_top=5)
    assert select_negatives("q", ids, scores, set(), skipping, 0.725)[0] == ["d6"]
