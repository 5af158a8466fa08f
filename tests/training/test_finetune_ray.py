"""Retriever fine-tuning end to end on Ray Train + DeepSpeed: BEIR data and BM25 negatives on
S3, two workers with the gradient cache, every query once per epoch, export and evaluation;
then the Tevatron format, whose passages become the corpus."""

from __future__ import annotations

import json
import os

import pytest
from conftest import synthetic_docs

from models.biencoder import load_biencoder
from pipeline.core import model_ref, storage
from pipeline.data.beir import positives, read_qrels
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.runs import read_negatives
from pipeline.training.finetune import FinetuneConfig, run_finetuning
from pipeline.training.group_training import prepare_group_training
from pipeline.training.train_config import TrainConfig
from tests.helpers import read_traces, save_tiny_bert

pytestmark = pytest.mark.ray

N_QUERIES = 24


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    """A random tiny BERT checkpoint with its own tokenizer: what --model.init points at."""
    return save_tiny_bert(
        str(tmp_path_factory.mktemp("tiny-bert")), [d["text"] for d in synthetic_docs(200, seed=1)], dropout=0.1
    )


def put(bucket: str, key: str, text: str) -> str:
    import boto3

    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=text.encode())
    return f"s3://{bucket}/{key}"


def beir_on_s3(bucket: str) -> dict[str, str]:
    docs = synthetic_docs(80, seed=9)
    queries = [{"_id": f"q{i}", "text": " ".join(docs[i]["text"].split()[:4])} for i in range(N_QUERIES)]
    qrels = "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\t{docs[i]['_id']}\t1\n" for i in range(N_QUERIES))
    return {
        "corpus": put(bucket, "beir/corpus.jsonl", "".join(json.dumps(d) + "\n" for d in docs)),
        "queries": put(bucket, "beir/queries.jsonl", "".join(json.dumps(q) + "\n" for q in queries)),
        "qrels": put(bucket, "beir/qrels.tsv", qrels),
    }


def test_two_workers_with_gradient_cache_from_s3_with_bm25_negatives(tiny_bert, s3_bucket, ray_session):
    data = beir_on_s3(s3_bucket)
    out = f"s3://{s3_bucket}/run"
    cfg = FinetuneConfig()
    cfg.data.queries, cfg.data.qrels, cfg.data.negatives = data["queries"], data["qrels"], "bm25"
    cfg.data.bm25_count, cfg.data.query_max_len, cfg.data.passage_max_len = 10, 12, 24
    cfg.corpus.input, cfg.corpus.docs_per_shard = data["corpus"], 30
    cfg.model.init = tiny_bert
    cfg.retriever.pooling, cfg.retriever.group_size, cfg.retriever.chunk_size = "cls", 3, 5
    cfg.train = TrainConfig(
        output=out,
        num_workers=2,
        zero_stage=2,
        micro_batch_size=4,
        max_steps=0,
        epochs=2,
        lr=1e-3,
        log_every=1,
        checkpoint_every=4,
        data_trace=True,
    )
    summary = run_finetuning(cfg)

    # 24 queries / (2 workers x 4) = 3 steps an epoch.
    assert summary["steps"] == 6 and summary["examples"] == N_QUERIES and summary["epochs"] == 2
    traces = read_traces(f"{out}/checkpoints")
    assert sorted(traces) == ["rank0-attempt0", "rank1-attempt0"]
    for epoch in (0, 1):  # each example once per epoch, however the stream was split between workers
        consumed = [row for trace in traces.values() for row in trace.get(epoch, [])]
        assert sorted(consumed) == list(range(N_QUERIES))

    # Round-1 negatives were mined with bm25s into the run folder, judged positives excluded.
    negatives = read_negatives(f"{out}/bm25/negatives.jsonl")
    judged = read_qrels(data["qrels"])
    assert all(not set(negs) & set(positives(judged[q])) for q, negs in negatives.items())
    assert summary["bm25"]["queries"] == N_QUERIES

    assert summary["export_dir"] == f"{out}/export"
    local = model_ref.materialize(summary["export_dir"])  # the export, in this node's cache
    model = load_biencoder(local)
    assert (model.cfg.pooling, model.cfg.group_size, model.cfg.chunk_size) == ("cls", 3, 5)
    assert os.path.exists(os.path.join(local, "tokenizer.json"))
    history = storage.read_json(f"{out}/history.json")
    assert len(history) == 6 and all(0.0 <= h["accuracy"] <= 1.0 for h in history)
    assert "eval" not in summary  # evaluates only when asked (--eval.queries)


def test_tevatron_training_file_with_its_own_passages(tiny_bert, tmp_path, shared_ray):
    """What a Tevatron file changes is the driver's data preparation (the training loop is
    the one the test above runs): its passages become the corpus and its groups the examples."""
    from pipeline.data.examples import TrainExample
    from pipeline.data.tevatron import write_tevatron

    docs = {d["_id"]: d["text"] for d in synthetic_docs(40, seed=4)}
    ids = list(docs)
    examples = [
        TrainExample(f"q{i}", " ".join(docs[ids[i]].split()[:3]), [ids[i]], ids[i + 1 : i + 6]) for i in range(16)
    ]
    tevatron = str(tmp_path / "train.tevatron.jsonl")
    write_tevatron(examples, lambda d: ("", docs[d]), tevatron)

    cfg = FinetuneConfig()
    cfg.data.tevatron, cfg.data.query_max_len, cfg.data.passage_max_len = tevatron, 10, 20
    cfg.corpus.input = ""  # the passages of the Tevatron file are the corpus
    cfg.model.init = tiny_bert
    cfg.retriever.group_size = 4
    cfg.eval.queries = ""
    cfg.train = TrainConfig(
        output=str(tmp_path / "run"),
        num_workers=1,
        micro_batch_size=4,
        max_steps=0,
        epochs=1,
        lr=1e-3,
        log_every=1,
        checkpoint_every=100,
    )
    prepared = prepare_group_training(cfg, cfg.retriever.group_size)
    assert cfg.train.max_steps == 4 and len(prepared.examples) == 16  # 16 groups, 4 a step
    # Only the passages the file names: 16 positives and their negatives ids[1:21].
    assert prepared.corpus.manifest["num_docs"] == 21
    # The driver keeps the examples as corpus rows, in the file's order.
    corpus_ids = CorpusIds.read(cfg.corpus.output, prepared.corpus.manifest["shards"])
    assert [corpus_ids.ids(e.positives) for e in prepared.examples] == [[ids[i]] for i in range(16)]
    assert [corpus_ids.ids(e.negatives) for e in prepared.examples] == [ids[i + 1 : i + 6] for i in range(16)]
    assert prepared.examples.query_ids == [f"q{i}" for i in range(16)]

    # With prefixes, every query is tokenized behind its prefix, and passages get the passage
    # prefix's token ids in front (the group stream's framing is tested in test_group_stream).
    from pipeline.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_bert)
    word = docs[ids[0]].split()[0]
    cfg.retriever.query_prefix, cfg.retriever.passage_prefix = f"{word}: ", f"{word} {word}: "
    prefixed = prepare_group_training(cfg, 4)
    want = tokenizer([f"{word}: {e.query}" for e in examples], add_special_tokens=False)["input_ids"]
    assert [q.tolist() for q in prefixed.stream.query_ids] == [w[:8] for w in want]
    assert prefixed.stream.spec.passage_prefix == tuple(
        tokenizer(f"{word} {word}: ", add_special_tokens=False)["input_ids"]
    )
    assert len(prefixed.stream.spec.passage_prefix) == 3 and want[0][0] != tokenizer.unk_token_id
