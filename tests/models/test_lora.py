"""LoRA fine-tuning: only the adapters train, and the export merges them into a plain encoder.

The distributed gradient of a LoRA model under DeepSpeed is checked with the other
fine-tuning cases in tests/training/test_finetune_deepspeed.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import synthetic_docs, write_jsonl
from transformers import AutoModel

from models.biencoder import BiEncoderConfig, ContrastiveObjective, contrastive_loss
from models.lora import FAMILY_TARGETS, LoraSettings, target_pattern
from tests.helpers import save_tiny_bert, save_tiny_decoder

GROUP = 2


def _batch(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    queries = tokenizer([" ".join(t.split()[:4]) for t in texts[:4]], padding=True, return_tensors="pt")
    passages = tokenizer(texts[: 4 * GROUP], padding=True, truncation=True, max_length=24, return_tensors="pt")
    return {
        "q_input_ids": queries["input_ids"],
        "q_attention_mask": queries["attention_mask"],
        "d_input_ids": passages["input_ids"],
        "d_attention_mask": passages["attention_mask"],
    }


def test_a_lora_run_trains_only_its_adapters_and_exports_them_merged(tmp_path):
    """A few optimiser steps on a LoRA bi-encoder: the encoder's own weights do not move, the
    adapters do, and the merged export, loaded by ``AutoModel`` without peft, gives the
    adapted model's hidden states."""
    from transformers import AutoTokenizer

    texts = [d["text"] for d in synthetic_docs(40, seed=3)]
    init = save_tiny_bert(str(tmp_path / "init"), texts)
    tokenizer = AutoTokenizer.from_pretrained(init)
    cfg = BiEncoderConfig(pooling="mean", similarity="cos", temperature=0.1, group_size=GROUP)
    cfg.lora = LoraSettings(rank=4, alpha=8.0)
    objective = ContrastiveObjective(cfg, passage_max_len=24)
    torch.manual_seed(0)
    model = objective.build(init)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    adapted_layers = {n.split(".lora_")[0] for n in trainable}
    # every layer's query, key, value and its three dense layers; the pooler never
    assert len(adapted_layers) == 6 * model.query_encoder.config.num_hidden_layers
    assert not any("pooler" in n for n in adapted_layers)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    batch = _batch(tokenizer, texts)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        queries, passages = model(**batch)
        loss = contrastive_loss(model.compute_similarity(queries, passages), GROUP)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[name]), name

    export = str(tmp_path / "export")
    objective.export(model.eval(), export, init)
    plain = AutoModel.from_pretrained(export).eval()
    assert not any("lora" in k for k in plain.state_dict())
    ids, mask = batch["d_input_ids"], batch["d_attention_mask"]
    with torch.no_grad():
        adapted = model.query_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        exported = plain(input_ids=ids, attention_mask=mask).last_hidden_state
        untrained = AutoModel.from_pretrained(init).eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    np.testing.assert_allclose(exported.numpy(), adapted.numpy(), atol=1e-5)
    assert (exported - untrained).abs().max() > 1e-3  # the adapters did change the encoder


def test_lora_targets_are_the_layer_stacks_linear_layers_only():
    import re

    pattern = target_pattern(["query", "dense"])
    assert re.fullmatch(pattern, "encoder.layer.3.attention.self.query")
    assert re.fullmatch(pattern, "encoder.layer.11.output.dense")
    assert re.fullmatch(pattern, "layers.0.mlp.dense")  # a stack named `layers`
    assert not re.fullmatch(pattern, "pooler.dense")
    assert not re.fullmatch(pattern, "encoder.layer.3.attention.self.query_proj")
    with pytest.raises(ValueError, match="lora.rank must be >= 0"):
        LoraSettings(rank=-1)


@pytest.mark.ray
@pytest.mark.release_check  # 33 s alone, 322 s in the suite beside the other process (stop 94)
def test_a_lora_run_through_the_trainer_changes_each_adapted_weight_by_a_low_rank_update(tmp_path, ray_session):
    """A short `run_finetuning` of a decoder (Qwen2: last-token pooling, the framing's EOS)
    with rank-2 adapters and weight decay 0.1, through the trainer's parameter groups and
    DeepSpeed's step: the decoder path through the trainer, which the decoder recipe's check
    runs at ZeRO-3. In the merged export every tensor not adapted (embeddings, norms,
    biases) is bit-equal to the initial model's, and every adapted weight moved from its
    initial value by an update of rank at most 2 (B A merged). Mutations: a base weight
    left trainable, or decayed by the optimiser, moves by a full-rank update (or moves where
    it must not)."""
    import json
    import os

    from safetensors.torch import load_file

    from pipeline.core import model_ref
    from pipeline.training import finetune
    from pipeline.training.train_config import TrainConfig

    docs = synthetic_docs(40, seed=3)
    init = save_tiny_decoder(str(tmp_path / "decoder"), "qwen2", [d["text"] for d in docs])
    queries, qrels = tmp_path / "queries.jsonl", tmp_path / "qrels.tsv"
    queries.write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": " ".join(docs[i]["text"].split()[:4])}) + "\n" for i in range(12))
    )
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\t{docs[i]['_id']}\t1\n" for i in range(12)))
    cfg = finetune.FinetuneConfig()
    cfg.data.queries, cfg.data.qrels, cfg.data.negatives = str(queries), str(qrels), ""
    cfg.corpus.input = write_jsonl(tmp_path / "corpus.jsonl", docs)
    cfg.corpus.output = str(tmp_path / "prepared")
    cfg.data.query_max_len, cfg.data.passage_max_len = 12, 24
    cfg.model.init = init
    cfg.retriever.group_size = 2
    cfg.retriever.lora = LoraSettings(rank=2, alpha=8.0)
    cfg.train = TrainConfig(
        output=str(tmp_path / "run"),
        num_workers=1,
        zero_stage=1,
        lr=5e-2,
        weight_decay=0.1,
        max_steps=3,
        micro_batch_size=4,
        checkpoint_every=100,
        log_every=1,
    )
    summary = finetune.run_finetuning(cfg)
    before = AutoModel.from_pretrained(init).state_dict()
    export = model_ref.materialize(summary["export_dir"])
    after = {
        k: v
        for name in os.listdir(export)
        if name.endswith(".safetensors")
        for k, v in load_file(f"{export}/{name}").items()
    }
    assert sorted(before) == sorted(after)
    adapted = {k for k in before if re.fullmatch(target_pattern(FAMILY_TARGETS["qwen2"]), k.removesuffix(".weight"))}
    assert len(adapted) == 7 * 2  # q, k, v, o and the three MLP projections of each of 2 layers
    for key in before:
        if key not in adapted:
            assert torch.equal(before[key], after[key]), key
            continue
        update = (after[key] - before[key]).double()
        assert update.abs().max() > 1e-4, key  # the adapters trained
        assert int(torch.linalg.matrix_rank(update, rtol=1e-6)) <= 2, key
