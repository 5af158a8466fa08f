"""The cross-encoder re-ranker: the listwise loss by hand, pair assembly against the HF
tokenizer's pair encoding, the trainer's backward against a plain reference, export (HF and
sentence-transformers), batched scoring, clear errors, and one run end to end: train on Ray
Train + DeepSpeed, export, re-rank a run on Ray actors, compare with in-process scoring and
evaluate with ir_measures."""

from __future__ import annotations

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import synthetic_docs

from models.framing import Framing
from models.reranker import (
    ListwiseObjective,
    PairLengths,
    build_reranker,
    listwise_backward,
    listwise_loss,
    load_reranker,
)
from pipeline.core.errors import StorageError
from pipeline.data.tokenizer import load_tokenizer
from pipeline.retrieval.rerank_scoring import RerankScoreConfig, run_scoring
from tests.helpers import PlainEngine, assert_same_loss_and_gradients, save_tiny_bert

N_DOCS, N_QUERIES = 40, 12


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A random tiny BERT encoder with its own tokenizer (no classifier head: it starts random)."""
    return save_tiny_bert(
        str(tmp_path_factory.mktemp("tiny-bert")),
        [d["text"] for d in synthetic_docs(200, seed=1)],
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def tiny_reranker(tiny_checkpoint):
    torch.manual_seed(1)
    lengths = PairLengths(query_max_len=12, passage_max_len=40, max_len=48)
    return build_reranker(tiny_checkpoint, lengths).eval(), load_tokenizer(tiny_checkpoint)


def hf_pair(tokenizer, query: str, passage: str, lengths: PairLengths) -> dict[str, torch.Tensor]:
    """The reference: the HF tokenizer's own pair encoding of an uncut query, the passage cut
    to ``passage_max_len - 2`` tokens and then the pair to ``max_len`` (only_second: the
    pair is [CLS] q [SEP] d [SEP], so the first cut is a pair of len(q) + passage_max_len + 1)."""
    n_query = len(tokenizer(query, add_special_tokens=False)["input_ids"])
    assert n_query <= lengths.query_max_len - 2
    return tokenizer(
        query,
        passage,
        truncation="only_second",
        return_tensors="pt",
        max_length=min(lengths.max_len, n_query + lengths.passage_max_len + 1),
    )


def test_listwise_loss_matches_a_hand_computation():
    scores = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.0, 1.5, 0.3, -2.0]])
    expected = sum(math.log(sum(math.exp(s) for s in row)) - row[0] for row in scores.tolist()) / 2
    assert listwise_loss(scores).item() == pytest.approx(expected, rel=1e-6)
    # The positive is column 0: moving it elsewhere is another loss.
    assert listwise_loss(scores.flip(1)).item() != pytest.approx(expected, rel=1e-3)


def stream_batch(tokenizer, queries: list[str], groups: list[list[str]], lengths: PairLengths) -> dict:
    """A micro-batch as the group stream delivers it: framed ids and lengths, (b, n, Ld) passages."""

    def framed(texts, max_len):
        tokens = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_len - 2)["input_ids"]
        return Framing.of(tokenizer).frame(tokens, max_len)

    q_ids, q_len = framed(queries, lengths.query_max_len)
    d = [framed(group, lengths.passage_max_len) for group in groups]
    return {
        "q_input_ids": q_ids,
        "q_length": q_len,
        "d_input_ids": np.stack([ids for ids, _ in d]),
        "d_length": np.stack([n for _, n in d]),
    }


def test_make_batch_equals_the_tokenizers_pair_encoding(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)
    docs = [d["text"] for d in synthetic_docs(6, seed=3)]
    long_passage = " ".join(d["text"] for d in synthetic_docs(4, seed=5))  # far over max_len: cut
    # A 2-token query: the passage's own cut binds (2 + 20 + 1 < 24); a longer one: max_len binds.
    queries = ["moses egypt", "the lord said unto moses and aaron in"]
    lengths = PairLengths(query_max_len=12, passage_max_len=20, max_len=24)
    groups = [[docs[0], long_passage, "tenth day"], [docs[2], long_passage, docs[3]]]
    batch = stream_batch(tokenizer, queries, groups, lengths)
    for array in batch.values():
        array.setflags(write=False)  # as Ray Data hands batches out of the object store
    task = ListwiseObjective(3, lengths, tokenizer.sep_token_id, tokenizer.pad_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on tensors that share read-only memory
        pairs = task.make_batch(batch, torch.Generator())

    lens = [hf_pair(tokenizer, q, d, lengths)["input_ids"].shape[1] for q, g in zip(queries, groups) for d in g]
    n_queries = [len(tokenizer(q, add_special_tokens=False)["input_ids"]) for q in queries]
    assert lens[1] == n_queries[0] + lengths.passage_max_len + 1 < lengths.max_len  # the passage cut
    assert lens[4] == lengths.max_len  # the pair cut
    assert pairs["input_ids"].shape == (6, max(lens))  # no column of padding only
    for row, (q, d) in enumerate((q, d) for q, g in zip(queries, groups) for d in g):
        ref = hf_pair(tokenizer, q, d, lengths)
        n = ref["input_ids"].shape[1]
        assert pairs["input_ids"][row, :n].tolist() == ref["input_ids"][0].tolist()
        assert pairs["token_type_ids"][row, :n].tolist() == ref["token_type_ids"][0].tolist()
        assert pairs["attention_mask"][row].tolist() == [1] * n + [0] * (pairs["input_ids"].shape[1] - n)
        assert set(pairs["input_ids"][row, n:].tolist()) <= {tokenizer.pad_token_id}
    assert task.count_tokens(batch) == int(pairs["attention_mask"].sum())


def test_backward_gives_the_loss_and_gradients_of_a_plain_reference(tiny_reranker):
    model, tokenizer = tiny_reranker
    lengths = model.lengths
    docs = [d["text"] for d in synthetic_docs(8, seed=7)]
    queries, groups = ["unto moses and aaron", "the first month"], [docs[:4], docs[4:]]
    task = ListwiseObjective(4, lengths, tokenizer.sep_token_id, tokenizer.pad_token_id)
    batch = task.make_batch(stream_batch(tokenizer, queries, groups, lengths), torch.Generator())

    trained = copy.deepcopy(model)
    loss, extras = listwise_backward(PlainEngine(trained), batch, group_size=4)

    reference = copy.deepcopy(model)
    scores = [[reference(**hf_pair(tokenizer, q, d, lengths))[0] for d in g] for q, g in zip(queries, groups)]
    expected = sum(torch.logsumexp(torch.stack(row), 0) - row[0] for row in scores) / len(scores)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    ref = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in trained.named_parameters() if p.grad is not None}
    assert set(got) == set(ref) and "model.classifier.weight" in got
    diff = torch.cat([(got[k] - ref[k]).flatten() for k in ref]).norm()
    assert diff / torch.cat([ref[k].flatten() for k in ref]).norm() < 1e-5
    positive_wins = [float(row[0] > max(row[1:])) for row in scores]
    assert extras["accuracy"].item() == pytest.approx(sum(positive_wins) / 2)


def test_the_activation_cost_per_query_predicts_a_larger_micro_batch(tiny_reranker):
    """What sizes the re-ranker's micro-batches from memory (--train.size_micro_batch): a
    query's group of full-length pairs. A retriever's in-batch negatives couple its
    queries: its task has no cost, and its micro-batch is never split."""
    from models.biencoder import ContrastiveObjective
    from models.memory import saved_bytes
    from pipeline.training.group_training import GroupTask

    model, tokenizer = tiny_reranker
    model = copy.deepcopy(model).train()  # dropout keeps its masks for the backward
    lengths, group = model.lengths, 4
    task = ListwiseObjective(group, lengths, tokenizer.sep_token_id, tokenizer.pad_token_id)
    cost = GroupTask(task, "", "").activation_cost(model)
    rng, queries = np.random.default_rng(9), 6
    arrays = {
        "q_input_ids": rng.integers(5, 100, (queries, lengths.query_max_len)),
        "q_length": np.full(queries, lengths.query_max_len),
        "d_input_ids": rng.integers(5, 100, (queries, group, lengths.passage_max_len)),
        "d_length": np.full((queries, group), lengths.passage_max_len),
    }
    batch = task.make_batch(arrays, torch.Generator())
    assert batch["input_ids"].shape == (queries * group, lengths.max_len)  # every pair cut at max_len

    def loss():
        return listwise_loss(
            model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).view(-1, group)
        )

    assert cost.bytes(queries) == pytest.approx(saved_bytes(loss, model), rel=1e-3)  # no draw changes a shape
    assert GroupTask(ContrastiveObjective.__new__(ContrastiveObjective), "", "").activation_cost(model) is None


def test_sdpa_attention_equals_eager_in_loss_and_gradients(tiny_reranker):
    """The cross-encoder reads its pairs through ``scaled_dot_product_attention``
    (transformers' default for BERT) and gives eager attention's loss and gradients."""
    model, tokenizer = tiny_reranker
    lengths = model.lengths
    assert model.model.config._attn_implementation == "sdpa"
    docs = [d["text"] for d in synthetic_docs(8, seed=7)]
    queries, groups = ["unto moses and aaron", "the first month"], [docs[:4], docs[4:]]
    task = ListwiseObjective(4, lengths, tokenizer.sep_token_id, tokenizer.pad_token_id)
    batch = task.make_batch(stream_batch(tokenizer, queries, groups, lengths), torch.Generator())
    assert (batch["attention_mask"] == 0).any()  # pairs of different lengths: padded rows
    results = {}
    for attention in ("sdpa", "eager"):
        copied = copy.deepcopy(model)
        copied.model.set_attn_implementation(attention)
        loss, _ = listwise_backward(PlainEngine(copied), batch, group_size=4)
        results[attention] = float(loss), {n: p.grad for n, p in copied.named_parameters() if p.grad is not None}
    assert_same_loss_and_gradients(results["sdpa"], results["eager"])


def test_export_loads_as_an_hf_classifier_and_a_sentence_transformers_cross_encoder(tiny_reranker, tmp_path):
    from sentence_transformers import CrossEncoder as STCrossEncoder
    from transformers import AutoModelForSequenceClassification

    model, tokenizer = tiny_reranker
    model.save(str(tmp_path), tokenizer.name_or_path)
    loaded = load_reranker(str(tmp_path))
    assert loaded.lengths == model.lengths
    assert AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).config.num_labels == 1
    pairs = [("the lord said", d["text"]) for d in synthetic_docs(3, seed=11)]
    with torch.no_grad():
        ours = [loaded(**hf_pair(tokenizer, q, d, PairLengths(12, 100, 48))).item() for q, d in pairs]
        theirs = STCrossEncoder(str(tmp_path), max_length=48, activation_fn=torch.nn.Identity()).predict(pairs)
    assert np.allclose(ours, theirs, atol=1e-5)
    assert len(set(np.round(ours, 5))) == 3  # a random head that still tells passages apart


def saved_with_candidates(tiny_reranker, folder) -> tuple[dict, list[str], list[list[str]]]:
    """The re-ranker saved in ``folder``, and (texts, queries, each query's candidates): pairs
    of many lengths."""
    model, tokenizer = tiny_reranker
    model.save(str(folder), tokenizer.name_or_path)
    docs = {d["_id"]: d["text"] for d in synthetic_docs(10, seed=13)}
    queries = ["moses egypt", "the lord said unto moses and aaron in", "tenth day"]
    return docs, queries, [["d0", "d1", "d2", "d3"], ["d4", "d0"], ["d5", "d6", "d7", "d8", "d9"]]


def test_pair_scorer_batches_equal_scoring_one_pair_at_a_time(tiny_reranker, tmp_path):
    from pipeline.retrieval.rerank_scoring import PairScorer

    model, tokenizer = tiny_reranker
    docs, queries, candidates = saved_with_candidates(tiny_reranker, tmp_path)
    scores = PairScorer(str(tmp_path), batch_size=3).score(queries, candidates, docs)
    assert [len(s) for s in scores] == [4, 2, 5]
    with torch.no_grad():
        for q, docs_of_q, got in zip(queries, candidates, scores):
            direct = [model(**hf_pair(tokenizer, q, docs[d], model.lengths)).item() for d in docs_of_q]
            assert np.allclose(got, direct, atol=1e-5)


def test_pair_scorer_under_a_token_budget_scores_as_without_one_and_keeps_to_it(tiny_reranker, tmp_path):
    from pipeline.retrieval.rerank_scoring import PairScorer

    docs, queries, candidates = saved_with_candidates(tiny_reranker, tmp_path)
    plain = PairScorer(str(tmp_path))
    assert plain.batch_limits == (64, 0)  # auto on a CPU: 64 pairs, no cap
    budget = PairScorer(str(tmp_path), batch_tokens=60)
    shapes = []
    budget.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    got = np.concatenate(budget.score(queries, candidates, docs))
    assert len(shapes) > 2 and all(rows * width <= 60 or rows == 1 for rows, width in shapes)
    np.testing.assert_allclose(got, np.concatenate(plain.score(queries, candidates, docs)), rtol=0, atol=1e-5)


def test_pair_scorer_in_bf16_holds_the_model_in_bf16_and_scores_as_fp32_does(tiny_reranker, tmp_path):
    from pipeline.retrieval.rerank_scoring import PairScorer

    model, tokenizer = tiny_reranker
    model.save(str(tmp_path), tokenizer.name_or_path)
    docs = {d["_id"]: d["text"] for d in synthetic_docs(12, seed=5)}
    queries, candidates = (
        ["moses egypt", "the first month"],
        [[f"d{i}" for i in range(6)], [f"d{i}" for i in range(6, 12)]],
    )
    half = PairScorer(str(tmp_path), batch_size=4, precision="bf16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    half_parts = half.score(queries, candidates, docs)
    full_parts = PairScorer(str(tmp_path), batch_size=4).score(queries, candidates, docs)
    got, expected = np.concatenate(half_parts), np.concatenate(full_parts)
    assert got.dtype == np.float32 and not np.array_equal(got, expected)  # really computed in bf16
    # bf16 keeps 8 bits: this random, large-weighted model's scores move by up to ~3% of their
    # range (as under bf16 autocast, measured beside it), and keep their order.
    np.testing.assert_allclose(got, expected, rtol=0, atol=0.05 * np.abs(expected).max())
    for part, full in zip(half_parts, full_parts):
        assert np.argmax(part) == np.argmax(full)


def test_training_settings_that_cannot_work_fail_before_any_work(tiny_checkpoint, tmp_path):
    from pipeline.training.rerank import RerankConfig, run_reranker_training

    def config(**changes) -> RerankConfig:
        cfg = RerankConfig()
        cfg.model.init, cfg.train.output = tiny_checkpoint, str(tmp_path / "run")
        cfg.data.query_max_len, cfg.data.passage_max_len, cfg.reranker.max_len = 12, 36, 48
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return cfg

    cases = [
        (
            {"data__negatives": str(tmp_path / "missing.jsonl")},
            StorageError,
            "run that first, or use --data.negatives bm25",
        ),
        ({"data__negatives": ""}, ValueError, "trains on hard negatives"),
        ({"reranker__max_len": 13}, ValueError, "at least query_max_len \\+ 2"),
        ({"reranker__max_len": 200}, ValueError, "exceeds the model's 128 positions"),
        ({"reranker__group_size": 1}, ValueError, "group_size must be >= 2"),
    ]
    for changes, error, message in cases:
        with pytest.raises(error, match=message):
            run_reranker_training(config(**changes))
    assert not (tmp_path / "run").exists()


# -- scoring ------------------------------------------------------------------------------


def write_run(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(f"{q} Q0 {d} {r} {s} x\n" for q, d, r, s in rows)
    return str(path)


def beir_fixture(folder) -> dict[str, str]:
    """A tiny collection: query i's positive is d{i}; the run lists a few candidates each."""
    from conftest import write_jsonl

    docs = synthetic_docs(N_DOCS, seed=9)
    queries = [{"_id": f"q{i}", "text": " ".join(docs[i]["text"].split()[:4])} for i in range(N_QUERIES)]
    qrels = folder / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(N_QUERIES)))
    rng = np.random.default_rng(0)
    rows = []
    for i in range(N_QUERIES):
        others = [f"d{j}" for j in rng.choice(np.arange(N_QUERIES, N_DOCS), 5, replace=False)]
        ranked = others[:3] + [f"d{i}"] + others[3:] if i % 3 else others  # every third query: positive missed
        rows += [(f"q{i}", d, r, round(10.0 - r, 2)) for r, d in enumerate(ranked, 1)]
    return {
        "corpus": write_jsonl(folder / "corpus.jsonl", docs),
        "queries": write_jsonl(folder / "queries.jsonl", queries),
        "qrels": str(qrels),
        "run": write_run(folder / "run.trec", rows),
    }


def test_scoring_streams_blocks_through_the_pool_and_the_passage_servers(
    tiny_reranker, tmp_path, shared_ray, monkeypatch
):
    """Blocks of 2 queries through 2 actors, texts from 3 passage servers: every query's
    candidates (and, for a teacher, its missed positive) get the scores a PairScorer gives
    in this process, and the streamed metrics equal ir_measures over the whole runs."""
    from pipeline.data.beir import read_queries
    from pipeline.data.runs import read_trec_run
    from pipeline.retrieval.metrics import JOB_MEASURES, evaluate
    from pipeline.retrieval.rerank_scoring import PairScorer

    model, tokenizer = tiny_reranker
    model.save(str(tmp_path / "export"), tokenizer.name_or_path)
    data = beir_fixture(tmp_path)
    cfg = RerankScoreConfig(
        model=str(tmp_path / "export"),
        run=data["run"],
        queries=data["queries"],
        corpus=data["corpus"],
        qrels=data["qrels"],
        depth=4,
        include_positives=True,
        queries_per_task=2,
        docs_per_server=N_DOCS // 3 + 1,
        output=str(tmp_path / "out"),
    )
    cfg.pool.actors = 2
    summary = run_scoring(cfg)
    assert summary["passage_servers"] == 3 and summary["queries"] == N_QUERIES
    first_stage = read_trec_run(data["run"], depth=4)
    scored = read_trec_run(summary["run"])
    texts = {d["_id"]: d["text"] for d in synthetic_docs(N_DOCS, seed=9)}
    queries = read_queries(data["queries"])
    scorer = PairScorer(str(tmp_path / "export"))
    added = 0
    for qid, ranked in first_stage.items():
        expected = [d for d, _, _ in ranked] + (
            [f"d{qid[1:]}"] if f"d{qid[1:]}" not in {d for d, _, _ in ranked} else []
        )
        added += len(expected) - len(ranked)
        direct = dict(zip(expected, scorer.score([queries[qid]], [expected], texts)[0].tolist()))
        assert {d: s for d, s, _ in scored[qid]} == pytest.approx(direct, abs=1e-4)
        assert [s for _, s, _ in scored[qid]] == pytest.approx(sorted(direct.values(), reverse=True), abs=1e-5)
    assert summary["positives_added"] == added > 0
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(N_QUERIES)}
    for key, run in (
        ("first_stage_metrics", {q: {d: s for d, s, _ in r} for q, r in first_stage.items()}),
        ("metrics", {q: {d: s for d, s, _ in scored[q] if d in {c for c, _, _ in r}} for q, r in first_stage.items()}),
    ):
        values = evaluate(qrels, run, JOB_MEASURES.values())
        assert summary[key] == pytest.approx({n: values[m] for n, m in JOB_MEASURES.items()})
    [staged] = (tmp_path / "out" / "text-shards").glob("*/manifest.json")  # kept for a rerun
    assert json.loads(staged.read_text())["docs"] == N_DOCS

    # Stopped after 2 of its 6 blocks and rerun: the same run file and metrics, the finished
    # blocks not scored again.
    import dataclasses

    from pipeline.retrieval import rerank_scoring

    write_block, written = rerank_scoring._write_block, []

    def stopped_after_two(output, block, *args):
        if len(written) == 2:
            raise KeyboardInterrupt
        write_block(output, block, *args)
        written.append(block["index"])

    stopped = dataclasses.replace(cfg, output=str(tmp_path / "stopped"))
    monkeypatch.setattr(rerank_scoring, "_write_block", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_scoring(stopped)
    monkeypatch.setattr(
        rerank_scoring,
        "_write_block",
        lambda output, block, *args: written.append(block["index"]) or write_block(output, block, *args),
    )
    resumed = run_scoring(stopped)
    assert sorted(written) == list(range(6)) and len(written) == 6  # each block scored once over both runs
    assert (tmp_path / "stopped" / "run.trec").read_bytes() == (tmp_path / "out" / "run.trec").read_bytes()
    for key in ("metrics", "first_stage_metrics", "queries", "pairs", "positives_added"):
        assert resumed[key] == pytest.approx(summary[key]), key


def test_a_run_naming_a_document_outside_the_corpus_is_an_error(tiny_reranker, tmp_path, shared_ray):
    model, tokenizer = tiny_reranker
    model.save(str(tmp_path / "export"), tokenizer.name_or_path)
    data = beir_fixture(tmp_path)
    last = f"q{N_QUERIES - 1}"
    with open(data["run"], "a") as f:
        f.write(f"{last} Q0 nowhere 99 0.1 x\n")
    cfg = RerankScoreConfig(
        model=str(tmp_path / "export"),
        run=data["run"],
        queries=data["queries"],
        corpus=data["corpus"],
        qrels="",
        depth=100,
        queries_per_task=64,  # one block: the run is read whole before any scoring fails
        output=str(tmp_path / "out"),
    )
    lines = len(open(data["run"]).readlines())
    with pytest.raises(ValueError, match=rf"run.trec line {lines}: document 'nowhere' is not in the corpus"):
        run_scoring(cfg)
    with open(data["run"], "a") as f:
        f.write("q0 Q0 d1 1 0.1 x\n")  # q0 again, after the other queries
    with pytest.raises(ValueError, match=rf"run.trec line {lines + 1}: query 'q0' again, after other queries"):
        run_scoring(cfg)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        RerankScoreConfig(depth=0)


# -- on Ray -------------------------------------------------------------------------------


def read_run_lines(path) -> list[tuple[str, str, float]]:
    with open(path) as f:
        return [(c[0], c[2], float(c[4])) for c in (line.split() for line in f)]


def test_a_passage_server_killed_between_fetches_serves_its_texts_again(tmp_path, shared_ray):
    """Servers hold the staged text in memory only: one SIGKILLed is restarted by Ray, reloads
    its load from the staging, and the next fetch (and one in flight) gets every text."""
    from conftest import write_jsonl

    from pipeline.data.text_shards import stage_text
    from pipeline.retrieval.passages import PassageStore, fetch_texts
    from tests.helpers import kill_process_of, pid_of

    docs = synthetic_docs(30, seed=4)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    ids = [d["_id"] for d in docs[::3]] + ["missing"]
    want = [d["text"] for d in docs[::3]] + [None]
    with PassageStore(stage_text(corpus, str(tmp_path / "text"), 10), docs_per_server=10) as passages:
        assert len(passages.actors) == 3 and fetch_texts(passages.actors, ids) == want
        killed = kill_process_of(passages.actors[1])
        assert fetch_texts(passages.actors, ids) == want
        assert pid_of(passages.actors[1]) != killed


def _slow_texts(servers: list, ids: list[str]) -> list:
    """What a scorer does with the servers a call hands it, slowly enough that calls are
    still out when a server is replaced."""
    import time

    from pipeline.retrieval.passages import fetch_texts

    time.sleep(0.4)
    return fetch_texts(servers, ids)


def test_passage_servers_on_a_drained_node_move_while_every_call_is_served(local_cluster, monkeypatch, tmp_path):
    """Both passage servers sit on a node that is drained (60 s ahead) after the third call,
    while a fresh node joins: each server is copied there, the calls made once a copy has
    loaded are handed the copy, the calls handed a replaced server still get every text
    (it is let go only once they are back), and then it is killed."""
    import sys
    import time

    import ray
    from conftest import write_jsonl
    from ray import cloudpickle

    from pipeline.core import draining
    from pipeline.data.text_shards import stage_text
    from pipeline.retrieval.passages import PassageStore
    from tests.helpers import drain_for_preemption, is_killed

    monkeypatch.setattr(draining, "DRAIN_CHECK_S", 0.0)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    doomed = local_cluster.add_node(num_cpus=2)
    docs = synthetic_docs(30, seed=5)
    ids = [d["_id"] for d in docs[::2]]
    want = [d["text"] for d in docs[::2]]
    task = ray.remote(_slow_texts).options(num_cpus=0.5, max_retries=0)

    def node_of(actor) -> str:
        return ray.get(actor.__ray_call__.remote(lambda instance: ray.get_runtime_context().get_node_id()))

    staged = stage_text(write_jsonl(tmp_path / "corpus.jsonl", docs), str(tmp_path / "text"), 15)
    with PassageStore(staged, docs_per_server=15) as passages:
        placed = list(passages.actors)
        assert len(placed) == 2 and {node_of(a) for a in placed} == {doomed.node_id}
        calls, handed = [], []
        # Calls go on until both servers moved: the fresh node's start and the copies' load
        # take what this machine takes (seconds alone, a minute with other work on its cores).
        moved_by = float("inf")
        while len(passages.moves) < 2 and time.monotonic() < moved_by:
            calls.append(passages.call_with_servers(lambda servers: task.remote(servers, ids)))
            handed.append(list(passages.actors))
            if len(calls) == 3:
                drain_for_preemption(local_cluster.address, doomed.node_id, deadline_s=600)
                fresh = local_cluster.add_node(num_cpus=2)
                moved_by = time.monotonic() + 300
            time.sleep(0.2)
        assert all(texts == want for texts in ray.get(calls))
        assert sorted(m["shard"] for m in passages.moves) == [0, 1]
        assert {node_of(a) for a in passages.actors} == {fresh.node_id}
        assert any(set(map(id, servers)) == set(map(id, placed)) for servers in handed[3:])  # out at the move
        passages.call_with_servers(lambda servers: task.remote(servers, ids))  # lets the replaced ones go
        assert all(is_killed(actor) for actor in placed)


def test_pair_scorer_with_packed_linears_scores_as_the_blas_path(tiny_reranker, tmp_path):
    """cpu_linears=onednn (the default on CPUs) against PyTorch's own path."""
    from models.packed_linears import PackedLinear
    from pipeline.retrieval.rerank_scoring import PairScorer

    docs, queries, candidates = saved_with_candidates(tiny_reranker, tmp_path)
    scorers = {way: PairScorer(str(tmp_path), batch_size=4, cpu_linears=way) for way in ("onednn", "blas")}
    assert any(type(m) is PackedLinear for m in scorers["onednn"].model.modules())
    assert not any(type(m) is PackedLinear for m in scorers["blas"].model.modules())
    got, expected = (np.concatenate(s.score(queries, candidates, docs)) for s in scorers.values())
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert np.abs(expected).max() > 0.1


def test_scoring_blocks_are_sized_by_the_bytes_they_carry():
    """At MS MARCO's training queries and the teacher's depth, a task carries ~32 MiB of
    candidates: 461 tasks, not 7,859 of 64 queries; a deeper run takes fewer queries a task;
    a small run is still cut into PROGRESS_BLOCKS; the bounds hold at the extremes."""
    from pipeline.retrieval.fanout import PROGRESS_BLOCKS
    from pipeline.retrieval.rerank_scoring import MAX_SCORING_BLOCK, MIN_SCORING_BLOCK, PAIR_BYTES, scoring_block

    block = scoring_block(30, 502_939)
    assert block * 30 * PAIR_BYTES <= 32 * 2**20 < (block + 1) * 30 * PAIR_BYTES
    assert -(-502_939 // block) == 461
    assert scoring_block(100, 502_939) < block
    assert -(-1_000 // scoring_block(30, 1_000)) >= PROGRESS_BLOCKS
    assert scoring_block(100_000, 10**7) == MIN_SCORING_BLOCK and scoring_block(1, 10**9) == MAX_SCORING_BLOCK
