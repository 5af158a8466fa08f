import json
from dataclasses import replace

import numpy as np
import pytest

from pipeline.core import storage
from pipeline.core.config import parse_config
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.sample import SAMPLE_CORPUS, SAMPLE_TRAIN_QRELS, SAMPLE_TRAIN_QUERIES
from pipeline.data.groups import select_negatives
from pipeline.data.text_shards import stage_text
from pipeline.retrieval.bm25 import bm25_run, build_index, search
from pipeline.retrieval.bm25_negatives import Bm25Config, mine_negatives
from pipeline.retrieval.mine import MineConfig
from tests.conftest import synthetic_docs, write_jsonl

# "zebra" and "stripes" occur in a handful of documents; d0 would rank first for q1.
DOCS = [
    {"_id": "d0", "title": "Zebra", "text": "zebra zebra stripes"},
    {"_id": "d1", "text": "a zebra with stripes on the savanna"},
    {"_id": "d2", "text": "zebra grazing grass near the river"},
    {"_id": "d3", "text": "stripes on a shirt and a tie"},
    {"_id": "d4", "text": "the zebra herd crossed the river at dawn"},
    {"_id": "d5", "text": "the quokka smiled"},
] + [{"_id": f"f{i}", "text": d["text"]} for i, d in enumerate(synthetic_docs(30))]
QUERIES = [
    {"_id": "q1", "text": "zebra stripes"},
    {"_id": "q2", "text": "quokka quokka"},
    {"_id": "q3", "text": "the and of"},
]
QRELS = "query-id\tcorpus-id\tscore\nq1\td0\t1\nq1\td4\t0\nq2\td5\t1\n"


@pytest.fixture
def beir(tmp_path, shared_ray):
    write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    write_jsonl(tmp_path / "queries.jsonl", QUERIES)
    (tmp_path / "qrels.tsv").write_text(QRELS)
    return tmp_path


def config(beir, **overrides) -> Bm25Config:
    return Bm25Config(
        **{
            "corpus": str(beir / "corpus.jsonl"),
            "queries": str(beir / "queries.jsonl"),
            "qrels": str(beir / "qrels.tsv"),
            "output": str(beir / "out" / "neg.jsonl"),
            **overrides,
        }
    )


def index_of(beir, **settings):
    # Staged at the index's own cut, so a small docs_per_shard gives that many shard actors.
    cut = settings.get("docs_per_shard", 1_000_000)
    return build_index(stage_text(str(beir / "corpus.jsonl"), str(beir / f"staged-{cut}"), cut), **settings)


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory, shared_ray):
    """One index (the default settings, one shard) for the tests that only read rankings."""
    folder = tmp_path_factory.mktemp("bm25-index")
    write_jsonl(folder / "corpus.jsonl", DOCS)
    with index_of(folder) as index:
        yield index


def direct_bm25s(k1: float, b: float, docs: list[dict] = DOCS, queries: list[dict] = QUERIES) -> dict:
    """The run of one bm25s index over the whole of ``docs``, as bm25s's own docs build it."""
    import bm25s

    texts = [f"{d['title']}\n{d['text']}" if d.get("title") else d["text"] for d in docs]
    direct = bm25s.BM25(k1=k1, b=b)
    direct.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    by_id = {q["_id"]: q["text"] for q in queries}
    rows, scores = direct.retrieve(
        bm25s.tokenize(list(by_id.values()), stopwords="en", show_progress=False), k=len(docs), show_progress=False
    )
    return {
        qid: {docs[r]["_id"]: float(s) for r, s in zip(rs, ss) if s > 0} for qid, rs, ss in zip(by_id, rows, scores)
    }


def assert_same_run(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for qid in expected:
        assert got[qid].keys() == expected[qid].keys()
        assert got[qid] == pytest.approx(expected[qid], rel=1e-5)
        assert list(got[qid].values()) == sorted(got[qid].values(), reverse=True)  # ranked


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in storage.read_bytes(str(path)).decode().splitlines()]


def test_rare_word_top_hit(corpus_index):
    run = bm25_run(corpus_index, {"q": "tell me about the quokka"}, depth=5)
    assert list(run["q"]) == ["d5"]  # the only document sharing a non-stopword with the query


def test_bm25_run_equals_one_bm25s_index(corpus_index):
    queries = {q["_id"]: q["text"] for q in QUERIES}
    got = bm25_run(corpus_index, queries, depth=len(DOCS))
    assert_same_run(got, direct_bm25s(k1=0.9, b=0.4))
    assert got["q3"] == {}  # only stopwords: nothing retrieved


def test_sharded_bm25_scores_with_the_whole_corpus_statistics(beir):
    """3 shards of 12 documents (the quokka in one of them): each shard scores with the
    corpus's document count, mean length and document frequencies, so scores and ranking
    are those of one bm25s index over the whole corpus, merged across shards."""
    queries = {q["_id"]: q["text"] for q in QUERIES}
    with index_of(beir, k1=1.2, b=0.75, docs_per_shard=12) as index:
        assert len(index.actors) == 3 and index.total == len(DOCS)
        got = bm25_run(index, queries, depth=len(DOCS), batch_size=2)
        assert index.holds(np.array([b"d3", b"nope", b"f7"])).tolist() == [True, False, True]
    assert (beir / "staged-12").is_dir()  # the staged text stays, for a rerun or a restarted actor
    assert_same_run(got, direct_bm25s(k1=1.2, b=0.75))


def test_a_bm25_shard_killed_mid_run_rebuilds_itself_and_every_query_is_answered_once(tmp_path, shared_ray):
    """The middle shard's process is SIGKILLed after the first block: Ray restarts it, it
    rebuilds its index from the staged text and the corpus statistics it was made with, and
    the run equals one bm25s index over the corpus, every query in it once."""
    from tests.helpers import kill_process_of, pid_of

    write_jsonl(tmp_path / "corpus.jsonl", SPREAD_DOCS)
    queries = {q["_id"]: q["text"] for q in SPREAD_QUERIES}
    with index_of(tmp_path, k1=1.2, b=0.75, docs_per_shard=4) as index:
        answered, killed = [], None
        for qid, ids, scores in search(index, queries, len(SPREAD_DOCS), batch_size=1):
            answered.append((qid, dict(zip(ids, scores))))
            if killed is None:
                killed = kill_process_of(index.actors[1])
        assert pid_of(index.actors[1]) != killed
    assert [qid for qid, _ in answered] == list(queries)
    assert_same_run(dict(answered), direct_bm25s(1.2, 0.75, SPREAD_DOCS, SPREAD_QUERIES))


# Terms spread over three shards of four documents, each with another document frequency
# per shard: "heron" is common in shard 0 and rare in shard 2, "otter" the reverse, "kelp"
# in every shard once. A shard that scored with its own statistics (or a wrong sum of the
# shards' frequencies) would rank these queries' hits, which come from every shard, otherwise.
SPREAD_DOCS = [
    {"_id": "a0", "text": "heron heron marsh"},
    {"_id": "a1", "text": "heron in the reeds"},
    {"_id": "a2", "text": "heron kelp shore"},
    {"_id": "a3", "text": "grey heron at dawn standing still"},
    {"_id": "b0", "text": "otter and heron by the river"},
    {"_id": "b1", "text": "otter otter kelp"},
    {"_id": "b2", "text": "a quiet pond"},
    {"_id": "b3", "text": "the otter dives"},
    {"_id": "c0", "text": "otter"},
    {"_id": "c1", "text": "kelp forest otter heron"},
    {"_id": "c2", "text": "sea otter cracking shells on its belly"},
    {"_id": "c3", "text": "otter pups sleeping"},
]
SPREAD_QUERIES = [
    {"_id": "s1", "text": "heron otter"},
    {"_id": "s2", "text": "kelp heron"},
    {"_id": "s3", "text": "otter kelp shore"},
]


def test_queries_whose_terms_and_hits_span_shards_score_with_the_corpus_statistics(tmp_path, shared_ray):
    write_jsonl(tmp_path / "corpus.jsonl", SPREAD_DOCS)
    queries = {q["_id"]: q["text"] for q in SPREAD_QUERIES}
    with index_of(tmp_path, k1=1.2, b=0.75, docs_per_shard=4) as index:
        assert len(index.actors) == 3
        got = bm25_run(index, queries, depth=len(SPREAD_DOCS), batch_size=2)
    expected = direct_bm25s(1.2, 0.75, SPREAD_DOCS, SPREAD_QUERIES)
    assert_same_run(got, expected)
    for qid, hits in got.items():  # every query's hits come from all three shards
        assert {d[0] for d in hits} == {"a", "b", "c"}, qid

    # The test can fail: each shard scored as its own corpus, then merged, ranks otherwise.
    per_shard: dict[str, dict[str, float]] = {q: {} for q in queries}
    for shard in range(3):
        part = direct_bm25s(1.2, 0.75, SPREAD_DOCS[4 * shard : 4 * shard + 4], SPREAD_QUERIES)
        for qid, hits in part.items():
            per_shard[qid].update(hits)
    ranked = lambda run: {q: sorted(h, key=lambda d: (-h[d], d)) for q, h in run.items()}
    assert ranked(per_shard) != ranked(expected)


def test_negatives_exclude_judged_positives(beir, corpus_index):
    from pipeline.data.tevatron import read_tevatron

    cfg = config(beir, count=3, threads=1, tevatron=str(beir / "out" / "train.tevatron.jsonl"))
    full = bm25_run(corpus_index, {"q1": "zebra stripes"}, depth=cfg.depth)["q1"]
    ranking = list(full)
    assert ranking[0] == "d0" and "d4" in ranking[:4]
    summary = mine_negatives(cfg)
    negatives = {r["query_id"]: r for r in read_jsonl(cfg.output)}
    # d0 (judged positive, ranked first) is gone; d4 (judged non-relevant) stays; order kept.
    assert negatives["q1"]["negatives"] == [d for d in ranking if d != "d0"][:3]
    assert negatives["q1"]["scores"] == pytest.approx([full[d] for d in negatives["q1"]["negatives"]], abs=1e-4)
    assert negatives["q2"]["negatives"] == [] and negatives["q3"]["negatives"] == []
    assert summary["positives_dropped"] == 2 and summary["queries_no_negatives"] == 2
    run = storage.read_bytes(cfg.run_uri()).decode().splitlines()
    assert run[0].split()[:4] == ["q1", "Q0", "d0", "1"] and run[0].split()[5] == "bm25"
    assert float(run[0].split()[4]) == pytest.approx(full["d0"], abs=1e-5)

    # The Tevatron file carries the same negatives, with the passages' text.
    records = {r["query_id"]: r for r in read_tevatron(cfg.tevatron)}
    assert set(records) == {"q1", "q2"}  # q3 has no judged positive
    assert summary["tevatron"]["examples"] == 2 and summary["tevatron"]["skipped_no_positive"] == 1
    q1 = records["q1"]
    assert [p["docid"] for p in q1["positive_passages"]] == ["d0"]
    assert [p["docid"] for p in q1["negative_passages"]] == negatives["q1"]["negatives"]
    texts = {d["_id"]: (f"{d['title']}\n{d['text']}" if d.get("title") else d["text"]) for d in DOCS}
    for p in q1["positive_passages"] + q1["negative_passages"]:
        assert p["text"] == texts[p["docid"]]


def test_bm25_negatives_stopped_mid_way_resume_from_their_finished_blocks(beir, shared_ray, monkeypatch, tmp_path):
    """One query per block: the third block's task fails, and the rerun retrieves only that
    block and writes what an unstopped run writes. Every block is merged and written in a
    task, never by the driver: counted by the work's marks (each names its process), with
    the driver's own merge made to fail. Mutation: the blocks merged on the driver
    (``search_blocks``) fails on the driver's merge."""
    import os
    import sys

    from ray import cloudpickle

    from pipeline.retrieval import bm25_negatives as bm25
    from pipeline.retrieval import fanout

    whole = config(beir, count=3, batch_size=1, output=str(beir / "whole" / "neg.jsonl"))
    assert mine_negatives(whole)["blocks"] == 3
    write_block, marks = bm25._write_block, tmp_path / "marks"
    marks.mkdir()

    def stopped_at_the_third(scores, rows, ids, cfg, folder, block, *args):
        if block == 2 and not (marks / "resumed").exists():
            raise RuntimeError("stopped")
        (marks / f"{os.getpid()}-{block}").write_text("")
        return write_block(scores, rows, ids, cfg, folder, block, *args)

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(bm25, "_write_block", stopped_at_the_third)
    monkeypatch.setattr(fanout, "merge_topk", lambda *a, **k: pytest.fail("the driver merged a block"))
    stopped = replace(whole, output=str(beir / "stopped" / "neg.jsonl"))
    with pytest.raises(Exception, match="stopped"):
        mine_negatives(stopped)
    (marks / "resumed").write_text("")
    resumed = mine_negatives(stopped)
    assert (resumed["blocks"], resumed["blocks_resumed"]) == (3, 2)
    for name in ("neg.jsonl", "neg.run.trec"):
        assert (beir / "stopped" / name).read_bytes() == (beir / "whole" / name).read_bytes(), name
    assert not (beir / "stopped" / "neg.parts").exists()
    written = [name.split("-") for name in os.listdir(marks) if name != "resumed"]
    assert sorted(int(block) for _, block in written) == [0, 1, 2]
    assert str(os.getpid()) not in {pid for pid, _ in written}


def test_random_sample_is_seeded_subset_in_rank_order(beir, corpus_index):
    cfg = config(beir, count=2, sample="random", seed=3, run="none")
    full = bm25_run(corpus_index, {"q1": "zebra stripes"})["q1"]
    ranking = [d for d in full if d != "d0"]
    mine_negatives(cfg)
    first = read_jsonl(cfg.output)[0]["negatives"]
    assert set(first) < set(ranking) and first == sorted(first, key=ranking.index)
    # The draw is seeded by (seed, query id): the same from the same ranking, whatever else ran.
    assert select_negatives("q1", list(full), list(full.values()), {"d0"}, cfg)[0] == first
    assert select_negatives("q1", list(full), list(full.values()), {"d0"}, replace(cfg, seed=4))[0] != first
    assert not storage.exists(str(beir / "out" / "neg.run.trec"))
    # Dense mining's settings draw the same negatives from the same ranking: a "random" draw
    # with a seed is comparable between the two miners.
    dense = MineConfig(count=2, sample="random", seed=3)
    assert select_negatives("q1", list(full), list(full.values()), {"d0"}, dense)[0] == first


def test_skip_top_leaves_out_the_best_ranked_candidates(beir, corpus_index):
    cfg = config(beir, count=3, skip_top=2, run="none")
    full = list(bm25_run(corpus_index, {"q1": "zebra stripes"})["q1"])
    mine_negatives(cfg)
    # d0 (judged positive) is first; skip_top drops ranks 1-2 whatever they are, then the positive filter.
    assert read_jsonl(cfg.output)[0]["negatives"] == [d for d in full[2:] if d != "d0"][:3]


def test_config_validation(beir):
    with pytest.raises(ConfigError, match="count .* must not exceed depth"):
        parse_config(Bm25Config, ["--corpus", "c", "--queries", "q", "--qrels", "r", "--depth", "10"])
    # With no arguments, the embedded default: the bundled sample's training split.
    embedded = parse_config(Bm25Config, [])
    assert (embedded.corpus, embedded.queries, embedded.qrels) == (
        SAMPLE_CORPUS,
        SAMPLE_TRAIN_QUERIES,
        SAMPLE_TRAIN_QRELS,
    )
    assert config(beir, output="x/neg.jsonl.gz").run_uri() == "x/neg.run.trec"


def test_qrels_for_unknown_document_fails(beir):
    (beir / "qrels.tsv").write_text(QRELS + "q2\tmissing\t1\n")
    with pytest.raises(InputError, match=r"qrels\.tsv line 5: unknown document id 'missing'"):
        mine_negatives(config(beir))


def test_job_reads_s3_writes_local(beir, s3_bucket, capsys):
    import boto3
    import ir_measures

    s3 = boto3.client("s3")
    for name in ("corpus.jsonl", "queries.jsonl", "qrels.tsv"):
        s3.upload_file(str(beir / name), s3_bucket, f"beir/{name}")
    from jobs.bm25_negatives import main

    out = beir / "job" / "negatives.jsonl.gz"
    summary = main(
        [
            f"--corpus=s3://{s3_bucket}/beir/corpus.jsonl",
            f"--queries=s3://{s3_bucket}/beir/queries.jsonl",
            f"--qrels=s3://{s3_bucket}/beir/qrels.tsv",
            f"--output={out}",
            "--depth=20",
            "--count=4",
            "--no-write_scores",
        ]
    )
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == summary
    assert {k: last[k] for k in ("queries", "docs", "queries_without_positive", "positives_dropped")} == {
        "queries": 3,
        "docs": len(DOCS),
        "queries_without_positive": 1,
        "positives_dropped": 2,
    }
    rows = read_jsonl(out)
    assert [r["query_id"] for r in rows] == ["q1", "q2", "q3"] and all("scores" not in r for r in rows)
    assert len(rows[0]["negatives"]) == 4 and "d0" not in rows[0]["negatives"]
    assert last["negatives_per_query"] == pytest.approx(4 / 3, abs=1e-3)
    run = list(ir_measures.read_trec_run(last["run"]))
    assert {r.query_id for r in run} == {"q1", "q2"} and ("q1", "d0") in {(r.query_id, r.doc_id) for r in run}
