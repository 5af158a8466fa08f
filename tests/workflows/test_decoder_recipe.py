"""A decoder retriever through the recipe on Ray: fine-tuned with LoRA and last-token
pooling, its negatives mined with its own vectors, trained again on them (2 workers at
ZeRO-3, through the gradient cache), evaluated."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from pipeline.core import storage
from pipeline.training.train_config import TrainConfig
from pipeline.workflows.recipe import RecipeConfig, run_recipe
from tests.helpers import ir_measures_of_run, retrieval_collection, save_tiny_decoder, use_collection

pytestmark = [
    pytest.mark.ray,
    pytest.mark.runs_long,
    pytest.mark.release_check,
]  # five stages on Ray: ~3 minutes on 2 cores

HIDDEN = 48  # not a width any default sizes for: the searchers must read it from the model


def test_a_decoder_is_fine_tuned_mined_with_and_evaluated_through_the_recipe(tmp_path, ray_session):
    data = retrieval_collection(tmp_path / "data", 120, 40, 20)
    init = save_tiny_decoder(str(tmp_path / "qwen2"), "qwen2", data["texts"], hidden_size=HIDDEN)
    cfg = RecipeConfig(output=str(tmp_path / "run"))
    cfg.model.init = init
    use_collection(cfg.data, data)
    cfg.data.query_max_len, cfg.data.passage_max_len = 16, 40
    cfg.pretrain.enabled = cfg.reranker.enabled = False  # pre-training and re-rankers take encoders
    for stage in (cfg.round1, cfg.round2):
        stage.retriever.group_size = 4
        stage.retriever.query_prefix, stage.retriever.passage_prefix = "query: ", "passage:"
        stage.retriever.lora.rank = 4
        stage.train = TrainConfig(micro_batch_size=8, max_steps=4, lr=1e-3, checkpoint_every=100, log_every=1)
    # Round 2 on 2 workers at ZeRO-3, each weight partitioned across them, through the gradient
    # cache (chunks of 8 sequences) with checkpointed layers and cross-worker negatives.
    cfg.round2.retriever.chunk_size, cfg.round2.retriever.gradient_checkpointing = 8, True
    cfg.round2.train.num_workers, cfg.round2.train.zero_stage, cfg.round2.train.micro_batch_size = 2, 3, 4
    cfg.mine.depth, cfg.mine.count, cfg.mine.bm25_depth, cfg.mine.bm25_count = 20, 5, 20, 5
    cfg.eval.k = 50

    summary = run_recipe(cfg)

    assert summary["ran"] == ["bm25", "zeroshot", "round1", "mine1", "round2"]
    stages = storage.read_json(os.path.join(cfg.output, "recipe.json"))["stages"]
    export = stages["round2"]["outputs"]["export"]
    settings = json.load(open(os.path.join(export, "retriever.json")))
    assert (settings["pooling"], settings["query_prefix"]) == ("last", "query: ")
    # The export's tokenizer appends the EOS the training framed with; the adapters are merged.
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer("In the beginning")["input_ids"][-1] == tokenizer.eos_token_id
    assert AutoConfig.from_pretrained(export).hidden_size == HIDDEN
    assert not any(name.startswith("adapter") for name in os.listdir(export))
    # LoRA through the trainer: the merged export's frozen weights are the checkpoint's bit for
    # bit, and each adapted projection moved by an update of rank at most 4.
    from safetensors.torch import load_file

    from models.lora import FAMILY_TARGETS, target_pattern

    before = {k.removeprefix("model."): v for k, v in load_file(os.path.join(init, "model.safetensors")).items()}
    after = load_file(os.path.join(stages["round1"]["outputs"]["export"], "model.safetensors"))
    assert set(after) <= set(before)  # the LM head is not a retriever's
    adapted = {k for k in after if re.fullmatch(target_pattern(FAMILY_TARGETS["qwen2"]), k.removesuffix(".weight"))}
    assert len(adapted) == 7 * 2  # 7 projections in each of 2 layers
    for key, value in after.items():
        if key not in adapted:
            assert torch.equal(value, before[key]), key
        else:
            update = (value - before[key]).double()
            assert update.abs().max() > 0 and int(torch.linalg.matrix_rank(update, rtol=1e-6)) <= 4, key
    # Mined with round 1's own vectors, of the model's width; evaluated by the job's metrics,
    # which ir_measures computes alike from the stored run.
    negatives = [json.loads(line) for line in open(stages["mine1"]["outputs"]["negatives"])]
    assert len(negatives) == 40 and all(len(n["negatives"]) == 5 for n in negatives)
    for stage in ("zeroshot", "round1", "round2"):
        metrics = stages[stage]["metrics"]
        expected = ir_measures_of_run(stages[stage]["outputs"]["run"], data["dev_qrels"])
        shared = sorted(set(expected) & set(metrics))  # the job reports no R@100 at --eval.k 50
        assert "MRR@10" in shared and {k: metrics[k] for k in shared} == pytest.approx({k: expected[k] for k in shared})
    manifests = [
        json.load(open(os.path.join(root, name)))
        for root, _, files in os.walk(cfg.output)
        for name in files
        if name == "manifest.json" and "embeddings" in root
    ]
    assert manifests and all(m.get("dim") == HIDDEN for m in manifests)
