"""Retriever fine-tuning and distillation under DeepSpeed: 2 workers, plain and
gradient-cached, equal one full batch.

Two real processes (gloo) each run DeepSpeed ZeRO-1 or ZeRO-2 on half of a fixed batch
of queries and their groups, through ``models.biencoder.contrastive_backward`` or
``models.distillation.distillation_backward``, the code the trainers' tasks run. Their
reduced gradients and logged loss must equal those of the loss over the whole batch in one
process. Dropout is 0, so both sides compute the same function.
"""

from __future__ import annotations

import os

import pytest
import torch

from models.biencoder import (
    BiEncoder,
    BiEncoderConfig,
    ContrastiveObjective,
    contrastive_backward,
    contrastive_loss,
    own_group_scores,
)
from models.distillation import distillation_backward, distillation_loss
from models.lora import LoraSettings, with_lora
from tests import distributed
from tests.helpers import random_word_batch, tiny_mlm, tiny_vocab

WORLD, N_QUERIES, GROUP = 2, 3, 4  # per worker: 3 queries, 12 passages
FP32_TOLERANCE, BF16_TOLERANCE = 1e-4, 3e-2  # relative gradient error; bf16 keeps 8 bits of mantissa
ALPHA, TEACHER_TEMPERATURE = 0.2, 2.0
CASES = [  # (loss, ZeRO stage, precision, chunk size in sequences; 0 = no cache, shared encoder, LoRA)
    ("contrastive", 1, "fp32", 0, True, False),
    ("contrastive", 1, "fp32", 5, True, False),
    ("contrastive", 2, "fp32", 0, True, False),
    ("contrastive", 2, "fp32", 2, True, False),
    ("contrastive", 2, "fp32", 5, False, False),
    ("contrastive", 2, "fp32", 0, False, False),
    ("contrastive", 2, "bf16", 0, True, False),
    ("contrastive", 2, "bf16", 4, True, False),
    ("distillation", 2, "fp32", 0, True, False),
    ("distillation", 2, "fp32", 5, False, False),
    # adapters only: the frozen encoder's weights have no gradient, the adapters the full batch's
    ("contrastive", 2, "fp32", 5, True, True),
    ("contrastive", 2, "fp32", 0, False, True),
    # ZeRO-3: every weight partitioned across the workers
    ("contrastive", 3, "fp32", 0, True, False),
    ("contrastive", 3, "fp32", 0, False, False),
    ("distillation", 3, "fp32", 0, True, False),
    ("contrastive", 3, "fp32", 0, True, True),
    ("contrastive", 3, "fp32", 5, True, False),
    ("contrastive", 3, "fp32", 2, False, False),
    ("contrastive", 3, "bf16", 4, True, False),
    ("distillation", 3, "fp32", 5, True, False),
    ("contrastive", 3, "fp32", 5, True, True),
]


def run_backward(loss: str, engine, batch: dict, chunk: int):
    if loss == "contrastive":
        return contrastive_backward(engine, batch, GROUP, chunk)
    return distillation_backward(engine, batch, GROUP, ALPHA, chunk, TEACHER_TEMPERATURE)


def build(shared: bool, lora: bool = False) -> BiEncoder:
    cfg = BiEncoderConfig(pooling="mean", similarity="cos", temperature=0.1, shared_encoder=shared, group_size=GROUP)
    encoder = lambda seed: tiny_mlm(len(tiny_vocab()), seed=seed, initializer_range=0.2).bert  # noqa: E731
    towers = [encoder(0), None if shared else encoder(1)]
    if lora:
        torch.manual_seed(5)
        towers = [t if t is None else with_lora(t, LoraSettings(rank=4)) for t in towers]
        for name, p in (p for t in towers if t is not None for p in t.named_parameters()):
            if ".lora_B." in name:  # peft starts B at zero, which would leave A without a gradient
                torch.nn.init.normal_(p, std=0.2)
    return BiEncoder(towers[0], towers[1], cfg)


def global_batch() -> dict[str, torch.Tensor]:
    q = random_word_batch(WORLD * N_QUERIES, 9, seed=11, inner_sep=0.0, pad_rows=0.5)
    d = random_word_batch(WORLD * N_QUERIES * GROUP, 15, seed=12, inner_sep=0.0, pad_rows=0.5)
    teacher = torch.randn(WORLD * N_QUERIES, GROUP, generator=torch.Generator().manual_seed(13)) * 3
    return {
        "q_input_ids": q.input_ids,
        "q_attention_mask": q.attention_mask,
        "d_input_ids": d.input_ids,
        "d_attention_mask": d.attention_mask,
        "d_teacher_scores": teacher,
    }


def local_batch(rank: int) -> dict[str, torch.Tensor]:
    batch = global_batch()
    rows = {k: N_QUERIES if k.startswith("q_") or k == "d_teacher_scores" else N_QUERIES * GROUP for k in batch}
    return {k: v[rank * rows[k] : (rank + 1) * rows[k]] for k, v in batch.items()}


def _worker(rank: int, world: int, out: dict):
    for loss_name, stage, precision, chunk, shared, lora in CASES:
        engine = distributed.engine(build(shared, lora), distributed.plain_config(N_QUERIES, stage, precision))
        loss, _ = run_backward(loss_name, engine, local_batch(rank), chunk)
        grads = distributed.full_gradients(engine)
        engine.step()
        out[(rank, loss_name, stage, precision, chunk, shared, lora)] = {
            "loss": float(loss),
            "grads": grads if rank == 0 else None,
        }
        del engine


def reference(
    shared: bool,
    loss_name: str = "contrastive",
    batch: dict | None = None,
    dtype: torch.dtype = torch.float32,
    lora: bool = False,
):
    """One process, the whole global batch (or ``batch``) in one graph."""
    model = build(shared, lora).to(dtype)
    batch = batch if batch is not None else global_batch()
    q, d = model(batch["q_input_ids"], batch["q_attention_mask"], batch["d_input_ids"], batch["d_attention_mask"])
    scores = model.compute_similarity(q, d)
    loss = contrastive_loss(scores, GROUP)
    if loss_name == "distillation":
        loss = distillation_loss(
            own_group_scores(scores, GROUP), batch["d_teacher_scores"], loss, ALPHA, TEACHER_TEMPERATURE
        )
    loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}, loss.item()


@pytest.fixture(scope="module")
def distributed_results():
    return distributed.spawn(_worker, WORLD, deepspeed=True)


@pytest.mark.parametrize("loss_name,stage,precision,chunk,shared,lora", CASES)
def test_two_deepspeed_workers_match_one_process_with_the_full_batch(
    distributed_results, loss_name, stage, precision, chunk, shared, lora
):
    ref_grads, ref_loss = reference(shared, loss_name, lora=lora)
    tolerance = FP32_TOLERANCE if precision == "fp32" else BF16_TOLERANCE
    results = [distributed_results[(rank, loss_name, stage, precision, chunk, shared, lora)] for rank in range(WORLD)]
    if lora:  # only adapters have gradients
        assert results[0]["grads"] and all(".lora_" in name for name in results[0]["grads"])
    assert distributed.relative_error(results[0]["grads"], ref_grads) < tolerance
    # The contrastive loss is global on every worker; the KL term is each worker's own
    # queries', so only the workers' mean is the full-batch loss.
    losses = [r["loss"] for r in results] if loss_name == "contrastive" else [sum(r["loss"] for r in results) / WORLD]
    assert losses == [pytest.approx(ref_loss, rel=tolerance)] * len(losses)


def test_the_bf16_bound_fits_bf16_rounding_and_catches_a_missing_gather():
    """Control for the bounds above. The whole batch in bf16 in one process stays inside
    the bf16 bound (its own rounding: 0.019), while what two workers without the gather
    would report (each its half of the batch, no cross-worker negatives, the gradients then
    averaged by DeepSpeed's all-reduce) misses the reference by more than 2.5 times that
    bound (0.099 against 0.03, measured): a broken gather cannot pass even the bf16 cases."""
    ref_grads, _ = reference(True)
    bf16_grads, _ = reference(True, dtype=torch.bfloat16)
    assert distributed.relative_error(bf16_grads, ref_grads) < BF16_TOLERANCE
    local = [reference(True, batch=local_batch(rank))[0] for rank in range(WORLD)]
    averaged = {k: sum(grads[k] for grads in local) / WORLD for k in ref_grads}
    assert distributed.relative_error(averaged, ref_grads) > 2.5 * BF16_TOLERANCE


class _DecoderTask:
    """What ``export_model`` asks of a task: the model as built, and its export."""

    def __init__(self, init: str):
        self.init = init
        self.objective = ContrastiveObjective(BiEncoderConfig(pooling="last", group_size=GROUP), 24)

    def build_model(self):
        torch.manual_seed(0)
        return self.objective.build(self.init)

    def export(self, model, out_dir):
        return self.objective.export(model, out_dir, self.init)


def _export_worker(rank: int, world: int, out: dict, init: str, destination: str):
    import deepspeed

    import models.backbone
    from pipeline.training.engine import export_model

    models.backbone.EXPORT_SHARD_SIZE = "40KB"  # a large model's shards, at the tiny model's scale
    task = _DecoderTask(init)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = distributed.engine(model, distributed.plain_config(N_QUERIES, 3, "fp32"), optimizer)
    batch = local_batch(rank)
    contrastive_backward(engine, batch, GROUP)
    engine.step()  # the weights moved from the checkpoint's
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {k.removeprefix("query_encoder."): v.clone() for k, v in engine.module.state_dict().items()}
    export_model(task, engine, rank, destination)
    if rank == 0:
        out["trained"] = trained


def test_a_zero3_export_holds_the_trained_weights_gathered_on_one_rank_in_shards(tmp_path):
    """Two ZeRO-3 workers, one step: the export, gathered a layer at a time into rank 0's
    host memory, holds exactly the weights the partitions hold, written as several
    safetensors files with their index, which ``AutoModel`` loads."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    from tests.helpers import sample_texts, save_tiny_decoder

    init = save_tiny_decoder(str(tmp_path / "init"), "llama", sample_texts(200), vocab_size=len(tiny_vocab()))
    destination = str(tmp_path / "export")
    trained = distributed.spawn(_export_worker, WORLD, init, destination, deepspeed=True)["trained"]
    shards = sorted(name for name in os.listdir(destination) if name.endswith(".safetensors"))
    assert len(shards) > 1 and os.path.isfile(os.path.join(destination, "model.safetensors.index.json"))
    exported = {k: v for name in shards for k, v in load_file(os.path.join(destination, name)).items()}
    before = AutoModel.from_pretrained(init).state_dict()
    assert sorted(exported) == sorted(before)
    for key, value in exported.items():
        assert torch.equal(value, trained[key]), key
    assert any(not torch.equal(exported[k], before[k]) for k in exported)  # the step moved them
    loaded = AutoModel.from_pretrained(destination).state_dict()
    assert all(torch.equal(loaded[k], exported[k]) for k in exported)
