"""coCondenser on Ray Train + DeepSpeed: warm start from a Condenser, span pairs, skipped
documents; on a RoBERTa backbone with a byte-level BPE tokenizer (the other families are
tested in process in tests/models/test_backbones.py)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import synthetic_docs, write_jsonl

from models.backbone import BackboneConfig, build_mlm, load_module_state
from models.cocondenser import CoCondenserConfig
from models.condenser import Condenser
from pipeline.core import storage
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.training.pretrain import PretrainConfig, run_pretraining
from pipeline.training.train_config import TrainConfig
from tests.helpers import read_traces, save_tiny_family

pytestmark = pytest.mark.ray


def test_warm_started_cocondenser_with_gradient_cache_on_two_workers(tmp_path, ray_session):
    from safetensors.torch import load_file

    docs = synthetic_docs(120, seed=11)
    roberta = str(tmp_path / "roberta")
    save_tiny_family(roberta, "roberta", [d["text"] for d in docs])
    corpus = PrepareConfig(
        input=write_jsonl(tmp_path / "raw.jsonl", docs),
        output=str(tmp_path / "corpus"),
        tokenizer=roberta,
        docs_per_shard=40,
    )
    manifest = prepare_corpus(corpus).manifest
    corpus.input = ""  # prepared: the job reads the manifest
    tokenizer_dir = os.path.join(corpus.output, manifest["tokenizer"])

    # A "trained" Condenser: random backbone, and a head perturbed away from any fresh init.
    torch.manual_seed(3)
    condenser = Condenser(build_mlm(BackboneConfig(init=roberta), manifest["vocab_size"]))
    assert type(condenser.lm).__name__ == "RobertaForMaskedLM"
    with torch.no_grad():
        for p in condenser.head.parameters():
            p.add_(torch.randn_like(p))
    condenser_dir = str(tmp_path / "condenser")
    condenser.save(condenser_dir, tokenizer_dir)

    cfg = PretrainConfig(method="cocondenser", corpus=corpus, model=BackboneConfig(init=condenser_dir))
    cfg.cocondenser = CoCondenserConfig(span_length=12, min_span_length=6, chunk_size=4)  # head: "auto"
    # lr 1e-12 (0 is refused as a user error): Adam moves each weight by about lr a step, so
    # the export must equal the warm start, head included, to far below any real update.
    cfg.train = TrainConfig(
        output=str(tmp_path / "run"),
        num_workers=2,
        zero_stage=2,
        micro_batch_size=5,
        max_steps=1000,
        epochs=1,
        lr=1e-12,
        log_every=1,
        checkpoint_every=100,
        data_trace=True,
    )
    summary = run_pretraining(cfg)

    head_before = load_file(os.path.join(condenser_dir, "condenser_head.safetensors"))
    head_after, meta = load_module_state(summary["head_path"])
    assert meta["n_head_layers"] == 2
    assert all(torch.allclose(head_before[k], head_after[k], rtol=0, atol=1e-8) for k in head_before)
    backbone_before = load_file(os.path.join(condenser_dir, "model.safetensors"))
    backbone_after = load_file(os.path.join(summary["export_dir"], "model.safetensors"))
    assert all(torch.allclose(backbone_before[k], backbone_after[k], rtol=0, atol=1e-8) for k in backbone_before)

    # Every pair the workers trained on, and every short document folded into one, was
    # consumed once; the skipped count is exactly the short documents among them.
    # Token counts as the corpus stores them (a byte-level BPE reads spaces, so re-tokenizing
    # the raw text need not give the staged text's count).
    shards = [storage.read_parquet(storage.join(corpus.output, s["path"])) for s in manifest["shards"]]
    n_tokens = {
        row: len(ids)
        for table in shards
        for row, ids in zip(table.column("row").to_pylist(), table.column("input_ids").to_pylist())
    }
    traces = read_traces(os.path.join(cfg.train.output, "checkpoints"))
    consumed = [row for trace in traces.values() for row in trace[0]]
    assert len(consumed) == len(set(consumed))
    short = [row for row in consumed if n_tokens[row] < 2 * 6]
    assert summary["skipped_docs"] == len(short) > 0
    pairs = len(consumed) - len(short)
    # 5 pairs per worker and step, the last batch of each worker partial (drop_last=False)
    assert summary["steps"] == -(-pairs // (2 * 5)) and pairs >= 100 - 2 * 5

    history = storage.read_json(os.path.join(cfg.train.output, "history.json"))
    assert all(entry["contrastive_loss"] > 0 for entry in history)
    # The logged loss is the eq. 7 total: MLM head + MLM late + contrastive.
    entry = history[0]
    assert entry["loss"] == pytest.approx(
        entry["head_mlm_loss"] + entry["late_mlm_loss"] + entry["contrastive_loss"], rel=1e-4
    )
