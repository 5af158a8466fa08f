"""The CLS attention-entropy diagnostic: its numbers against a direct computation, padding
invariance, the overlay outputs, the job end to end and its errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import synthetic_docs, write_jsonl

from jobs.analyze import main
from models.diagnostics import cls_entropy, pairwise_cosine
from pipeline.core import storage
from pipeline.core.errors import ConfigError
from pipeline.workflows.analyze import (
    AnalyzeConfig,
    load_checkpoint,
    load_passages,
    measure,
    run_analysis,
)
from tests.helpers import make_tokenizer_dir, tiny_mlm

MAX_LEN = 48  # below the tiny BERT's 64 positions; some passages get truncated
TEXTS = [d["text"] for d in synthetic_docs(11, seed=3)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    """Two tiny exported BERT checkpoints (different weights, same tokenizer). A large init
    range makes the attention far from uniform, so the entropies tell layers apart."""
    paths = []
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"ckpt{seed}"))
        tokenizer = make_tokenizer_dir(path)
        tiny_mlm(len(tokenizer), seed=seed, initializer_range=0.5).save_pretrained(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", synthetic_docs(11, seed=3))


def reference(path: str, texts: list[str]) -> np.ndarray:
    """(passages, layers, heads) entropies, one unpadded passage at a time, all in float64."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(path, attn_implementation="eager").double().eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = []
    for text in texts:
        enc = tokenizer(text, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        with torch.no_grad():
            attentions = model(**enc, output_attentions=True).attentions
        rows = [att[0, :, 0, :] for att in attentions]  # per layer: (heads, keys), keys all real
        out.append([(-(a * torch.where(a > 0, a.log(), 0.0)).sum(-1)).numpy() for a in rows])
    return np.array(out)


def test_entropy_matches_direct_computation(checkpoints):
    model, tokenizer = load_checkpoint(checkpoints[0])
    res = measure(model, tokenizer, TEXTS, MAX_LEN, batch_size=4)
    ref = reference(checkpoints[0], TEXTS)
    means = [layer["mean"] for layer in res["layers"]]
    np.testing.assert_allclose(means, ref.mean((0, 2)), atol=1e-5)
    np.testing.assert_allclose([layer["std"] for layer in res["layers"]], ref.mean(2).std(0), atol=1e-5)
    np.testing.assert_allclose([layer["heads"] for layer in res["layers"]], ref.mean(0), atol=1e-5)
    lengths = [len(tokenizer(t, truncation=True, max_length=MAX_LEN)["input_ids"]) for t in TEXTS]
    assert res["mean_length"] == pytest.approx(np.mean(lengths))
    assert res["uniform_entropy"] == pytest.approx(np.log(lengths).mean())
    assert res["log_mean_length"] == pytest.approx(np.log(np.mean(lengths)))
    assert (res["num_passages"], res["num_layers"], res["num_heads"]) == (len(TEXTS), 4, 2)
    assert min(means) < 0.8 * res["uniform_entropy"]  # the check above is not trivially uniform


def test_cls_pairwise_cosine_is_the_mean_over_distinct_pairs(checkpoints):
    """Each passage's [CLS] vector taken unpadded, its cosines to every other passage's by
    hand: the mean over the n(n-1)/2 pairs, and a histogram that counts every pair."""
    from transformers import AutoModel, AutoTokenizer

    model, tokenizer = load_checkpoint(checkpoints[0])
    result = measure(model, tokenizer, TEXTS, MAX_LEN, batch_size=4)["cls_cosine"]
    direct = AutoModel.from_pretrained(checkpoints[0]).double().eval()
    tok = AutoTokenizer.from_pretrained(checkpoints[0])
    with torch.no_grad():
        cls = [
            direct(**tok(t, truncation=True, max_length=MAX_LEN, return_tensors="pt")).last_hidden_state[0, 0]
            for t in TEXTS
        ]
    cosines = [
        float(torch.dot(cls[i], cls[j]) / (cls[i].norm() * cls[j].norm()))
        for i in range(len(cls))
        for j in range(i + 1, len(cls))
    ]
    assert result["pairs"] == len(TEXTS) * (len(TEXTS) - 1) // 2 == sum(result["histogram"]["counts"])
    assert result["mean"] == pytest.approx(np.mean(cosines), abs=1e-5)
    assert result["std"] == pytest.approx(np.std(cosines), abs=1e-5)


def test_pairwise_cosine_of_collinear_and_orthogonal_vectors():
    collinear = pairwise_cosine(torch.tensor([[1.0, 2.0], [2.0, 4.0], [0.5, 1.0]]))
    assert collinear["mean"] == pytest.approx(1.0) and collinear["std"] == pytest.approx(0.0, abs=1e-12)
    orthogonal = pairwise_cosine(torch.eye(4))
    assert orthogonal["mean"] == pytest.approx(0.0) and orthogonal["pairs"] == 6


def test_padding_does_not_change_the_result(checkpoints):
    model, tokenizer = load_checkpoint(checkpoints[0])
    runs = [measure(model, tokenizer, TEXTS, MAX_LEN, batch_size=b) for b in (1, 3, len(TEXTS))]
    for res in runs[1:]:
        for got, want in zip(res["layers"], runs[0]["layers"]):
            np.testing.assert_allclose(
                [got["mean"], got["std"], *got["heads"]], [want["mean"], want["std"], *want["heads"]], atol=1e-5
            )
    enc = tokenizer(TEXTS, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
    extra = 9  # more padding columns than the batch needs
    ids = torch.nn.functional.pad(enc["input_ids"], (0, extra), value=tokenizer.pad_token_id)
    mask = torch.nn.functional.pad(enc["attention_mask"], (0, extra))
    with torch.no_grad():
        padded = cls_entropy(model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions, mask)
        tight = model(**enc, output_attentions=True).attentions
    torch.testing.assert_close(padded, cls_entropy(tight, enc["attention_mask"]), atol=1e-5, rtol=0)


def test_overlay_of_two_checkpoints_writes_json_and_png(checkpoints, corpus, s3_bucket):
    # The second checkpoint and the output live on S3 (moto on loopback).
    remote = storage.upload_dir(checkpoints[1], f"s3://{s3_bucket}/ckpt1")
    output = f"s3://{s3_bucket}/analyze"
    cfg = AnalyzeConfig(
        checkpoints=[checkpoints[0], remote],
        labels=["local", "remote"],
        passages=corpus,
        num_passages=7,
        passage_max_len=MAX_LEN,
        batch_size=3,
        output=output,
    )
    summary = run_analysis(cfg)
    assert summary["files"] == {
        "json": f"{output}/entropy.json",
        "plot": f"{output}/cls_entropy.png",
        "cosine_plot": f"{output}/cls_cosine.png",
    }
    for plot in ("plot", "cosine_plot"):
        assert storage.read_bytes(summary["files"][plot]).startswith(b"\x89PNG\r\n\x1a\n")
    saved = storage.read_json(summary["files"]["json"])
    assert [c["label"] for c in saved["checkpoints"]] == ["local", "remote"]
    assert [c["path"] for c in saved["checkpoints"]] == [checkpoints[0], remote]
    texts = load_passages(corpus, 7, seed=0)
    for path, got in zip(checkpoints, saved["checkpoints"]):
        want = measure(*load_checkpoint(path), texts, MAX_LEN, batch_size=7)
        assert got["num_passages"] == 7 and got["mean_length"] == pytest.approx(want["mean_length"])
        np.testing.assert_allclose(
            [lay["mean"] for lay in got["layers"]], [lay["mean"] for lay in want["layers"]], atol=1e-6
        )
        assert summary["entropy"][got["label"]] == [lay["mean"] for lay in got["layers"]]
        assert summary["cls_cosine"][got["label"]] == pytest.approx(want["cls_cosine"]["mean"], abs=1e-6)
    means = [summary["entropy"][label] for label in ("local", "remote")]
    assert not np.allclose(*means)  # different weights, different curves


def test_job_end_to_end_with_passages_on_s3(checkpoints, corpus, s3_bucket, tmp_path, capsys):
    passages = f"s3://{s3_bucket}/corpus.jsonl"
    storage.write_bytes(passages, open(corpus, "rb").read())
    summary = main(
        [
            "--checkpoints",
            checkpoints[0],
            "--passages",
            passages,
            "--num_passages",
            "5",
            "--seed",
            "none",
            "--passage_max_len",
            str(MAX_LEN),
            "--batch_size",
            "2",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(summary))
    want = measure(*load_checkpoint(checkpoints[0]), TEXTS[:5], MAX_LEN)  # seed none: the first 5
    label = os.path.basename(checkpoints[0])
    np.testing.assert_allclose(summary["entropy"][label], [lay["mean"] for lay in want["layers"]], atol=1e-6)
    assert summary["num_passages"] == 5
    assert os.path.isfile(tmp_path / "out" / "cls_entropy.png")
    assert json.loads((tmp_path / "out" / "entropy.json").read_text())["passages"] == passages


def test_passage_sample(corpus):
    assert load_passages(corpus, 4, seed=None) == TEXTS[:4]
    sample = load_passages(corpus, 4, seed=1)
    assert sample == load_passages(corpus, 4, seed=1) and sample != load_passages(corpus, 4, seed=2)
    assert sorted(map(TEXTS.index, sample)) == list(map(TEXTS.index, sample))  # kept in corpus order
    assert load_passages(corpus, 100, seed=0) == TEXTS


def test_clear_errors(checkpoints, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(ConfigError, match="no-such-checkpoint: no such directory"):
        main(["--checkpoints", f"{checkpoints[0]},{missing}", "--output", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="1 labels for 2 checkpoints"):
        main(["--checkpoints", ",".join(checkpoints), "--labels", "one"])
    with pytest.raises(ConfigError, match="at least one checkpoint"):
        main([])
    no_tokenizer, empty = tmp_path / "model-only", tmp_path / "empty"
    tiny_mlm(120).save_pretrained(no_tokenizer)
    empty.mkdir()
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_checkpoint(str(no_tokenizer))
    with pytest.raises(ValueError, match="not a Hugging Face checkpoint"):
        load_checkpoint(str(empty))
