"""LoRA fine-tuning: only the adapters train, and the export merges them into a plain encoder.

The distributed gradient of a LoRA model under DeepSpeed is checked with the other
fine-tuning cases in tests/test_finetune_deepspeed.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import synthetic_docs
from transformers import AutoModel

from models.biencoder import BiEncoderConfig, ContrastiveObjective, contrastive_loss
from models.lora import LoraSettings, target_pattern
from tests.helpers import save_tiny_bert

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
