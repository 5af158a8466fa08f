"""The stored BM25 index: term statistics summed in a tree of partitioned tasks, shards
built in tasks and stored, the whole built once per staging and scoring, a build cut short
resumed. The scoring itself (equal to one bm25s index) is in test_bm25.py."""

import collections
import os
import sys
import time

import numpy as np
import pytest
from ray import cloudpickle

from pipeline.core import storage
from pipeline.data.text_shards import stage_text
from pipeline.retrieval import bm25_index
from pipeline.retrieval.bm25 import bm25_run, build_index
from tests.conftest import write_jsonl
from tests.retrieval.test_bm25 import SPREAD_DOCS, SPREAD_QUERIES, assert_same_run, direct_bm25s

SCORING = {"k1": 1.2, "b": 0.75, "method": "lucene", "lowercase": True, "stopwords": "en", "stemmer": ""}


def marked(monkeypatch, marks, name: str) -> None:
    """``bm25_index.<name>`` leaving a mark per call (its process, its first argument's first
    row where it has one), so a test counts where and how often the build ran."""
    real = getattr(bm25_index, name)

    def call(*args):
        first = args[0][0]["first_row"] if isinstance(args[0], list) else len(args)
        (marks / f"{name}-{os.getpid()}-{first}-{time.monotonic_ns()}").write_text("")
        return real(*args)

    monkeypatch.setattr(bm25_index, name, call)


def seen(marks, name: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in m.split("-")[1:3]) for m in os.listdir(marks) if m.startswith(name + "-")]


@pytest.fixture
def spread(tmp_path, shared_ray, monkeypatch):
    write_jsonl(tmp_path / "corpus.jsonl", SPREAD_DOCS)
    marks = tmp_path / "marks"
    marks.mkdir()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    for name in ("_count_terms", "_sum_terms", "_build_shard"):
        marked(monkeypatch, marks, name)
    return tmp_path, marks


def staged(folder, cut: int = 2) -> dict:
    return stage_text(str(folder / "corpus.jsonl"), str(folder / "staged"), cut)


def test_term_statistics_are_summed_in_a_tree_of_partitioned_tasks(spread, monkeypatch):
    """6 loads of 2 documents, 3 partitions, 2 tables a merge: every partition's sum takes
    three levels (6 -> 3 -> 2 -> 1), no task sums more than 2 tables, none runs on the
    driver, each stored partition holds only its own terms, and together they are the
    corpus's document frequencies counted by hand; the index then scores as one bm25s
    index. Mutation: ``FAN_IN`` ignored (one task a partition) sums 6 tables in a task."""
    folder, marks = spread
    monkeypatch.setattr(bm25_index, "FAN_IN", 2)
    text = staged(folder)
    text_bytes = sum(item["text_bytes"] for item in text["shards"])
    monkeypatch.setattr(bm25_index, "TEXT_BYTES_PER_PARTITION", -(-text_bytes // 3))
    assert bm25_index.IndexPlan.of(text, 2).partitions == 3
    with build_index(text, **SCORING, docs_per_shard=2) as index:
        got = bm25_run(index, {q["_id"]: q["text"] for q in SPREAD_QUERIES}, depth=len(SPREAD_DOCS))
        manifest = index.index
    assert_same_run(got, direct_bm25s(1.2, 0.75, SPREAD_DOCS, SPREAD_QUERIES))

    merges = seen(marks, "_sum_terms")
    assert len(merges) == 3 * (3 + 2 + 1) and max(inputs for _, inputs in merges) == 2
    assert str(os.getpid()) not in {str(pid) for pid, _ in merges + seen(marks, "_count_terms")}
    assert len(seen(marks, "_count_terms")) == 6 and len(seen(marks, "_build_shard")) == 6

    tokenizer = bm25_index.tokenizer_of(SCORING)
    by_hand: collections.Counter = collections.Counter()
    for doc in SPREAD_DOCS:
        ids = next(tokenizer.streaming_tokenize([doc["text"]]))
        by_hand.update({bm25_index._terms(tokenizer)[i] for i in ids})
    stored: dict[str, int] = {}
    terms_folder = storage.join(manifest["folder"], "terms")
    for p in range(3):
        table = storage.read_parquet(storage.join(terms_folder, f"terms-{p:04d}.parquet"))
        terms = np.array(table.column("term").to_pylist(), dtype=object)
        assert (bm25_index.partition_of(terms, 3) == p).all()
        stored.update(zip(terms, table.column("df").to_pylist()))
    expected = dict(by_hand) | {"": 0}  # and bm25s's empty token, in no document
    assert stored == expected and manifest["vocab_size"] == len(expected)


def test_an_index_is_built_once_per_staging_and_scoring_and_read_by_every_later_use(spread):
    """Built, then asked for again: read from storage, no build task runs; other scoring is
    another index; the corpus rewritten is staged anew and its index built anew. Mutation:
    the stored manifest never reused builds the second time and fails on the marks."""
    folder, marks = spread
    with build_index(staged(folder), **SCORING, docs_per_shard=4) as index:
        first = index.index
    assert not first["reused"] and len(seen(marks, "_build_shard")) == 3
    with build_index(staged(folder), **SCORING, docs_per_shard=4) as index:
        again = index.index
        got = bm25_run(index, {q["_id"]: q["text"] for q in SPREAD_QUERIES}, depth=len(SPREAD_DOCS))
    assert again["reused"] and again["folder"] == first["folder"]
    assert len(seen(marks, "_build_shard")) == 3 and len(seen(marks, "_count_terms")) == 3
    assert_same_run(got, direct_bm25s(1.2, 0.75, SPREAD_DOCS, SPREAD_QUERIES))

    with build_index(staged(folder), **{**SCORING, "k1": 0.9}, docs_per_shard=4) as index:
        assert not index.index["reused"] and index.index["folder"] != first["folder"]
    write_jsonl(folder / "corpus.jsonl", SPREAD_DOCS[:8])
    with build_index(staged(folder), **SCORING, docs_per_shard=4) as index:
        assert not index.index["reused"] and index.total == 8
    assert len(seen(marks, "_build_shard")) == 3 + 3 + 2


def test_a_build_cut_short_resumes_from_what_it_stored(spread, monkeypatch):
    """The third shard's build fails: the statistics and the other shards are stored, so the
    rerun builds that shard alone and counts no term again; the index scores as one bm25s
    index. Mutation: the stored shards not looked for rebuilds all three."""
    folder, marks = spread
    text = staged(folder)
    build = bm25_index._build_shard

    def third_fails(load, *args):
        if load[0]["first_row"] == 8 and not (marks / "rerun").exists():
            raise RuntimeError("node lost")
        return build(load, *args)

    monkeypatch.setattr(bm25_index, "_build_shard", third_fails)
    with pytest.raises(Exception, match="node lost"):
        build_index(text, **SCORING, docs_per_shard=4)
    shards = [os.path.join(r, "shard.json") for r, _, f in os.walk(folder / "staged") if "shard.json" in f]
    deadline = time.monotonic() + 30
    while len(shards) < 2 and time.monotonic() < deadline:  # the other shards' tasks still finishing
        time.sleep(0.2)
        shards = [os.path.join(r, "shard.json") for r, _, f in os.walk(folder / "staged") if "shard.json" in f]
    assert len(shards) == 2
    (marks / "rerun").write_text("")
    before = set(seen(marks, "_build_shard"))
    with build_index(text, **SCORING, docs_per_shard=4) as index:
        got = bm25_run(index, {q["_id"]: q["text"] for q in SPREAD_QUERIES}, depth=len(SPREAD_DOCS))
    assert len(seen(marks, "_count_terms")) == 3
    assert [first for _, first in set(seen(marks, "_build_shard")) - before] == [8]
    assert_same_run(got, direct_bm25s(1.2, 0.75, SPREAD_DOCS, SPREAD_QUERIES))
