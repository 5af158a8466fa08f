"""One bf16 worker (a single-GPU job) under DeepSpeed as the trainer configures it: the
optimizer DeepSpeed picks for it, the host syncs of its step, and a checkpoint resumed to the
same next step. The job's own Ray tests train in fp32 on CPU, so this path is covered here.

DeepSpeed runs in a spawned process (its process group must not outlive the test)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from models.condenser import CondenserConfig, CondenserMethod
from models.masking import whole_word_mask
from pipeline.training.deepspeed_config import deepspeed_config
from pipeline.training.engine import mixed_precision_state, param_groups
from pipeline.training.train_config import TrainConfig
from tests import distributed
from tests.helpers import random_word_batch, tiny_masking_vocab, tiny_mlm

TRAIN = TrainConfig(zero_stage=2, precision="bf16", micro_batch_size=4, grad_accum=2, grad_clip=1.0, lr=1e-3)
MICRO_BATCHES = 6  # three optimizer steps


def micro_batches() -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(MICRO_BATCHES):
        words = random_word_batch(TRAIN.micro_batch_size, 16, seed=10 + i, pad_rows=0.0)
        ids, labels = whole_word_mask(words.input_ids, tiny_masking_vocab(), torch.Generator().manual_seed(i), 0.3)
        out.append({"input_ids": ids, "attention_mask": words.attention_mask, "labels": labels})
    return out


def host_syncs(fn) -> int:
    """Device-to-host reads (``.item()``, a tensor's truth value) while ``fn`` runs: on a
    GPU each one waits for every kernel queued before it."""
    with profile(activities=[ProfilerActivity.CPU]) as session:
        fn()
    return sum(e.count for e in session.key_averages() if e.key == "aten::_local_scalar_dense")


def _worker(rank: int, world: int, out: dict, checkpoint_dir: str):
    method = CondenserMethod(CondenserConfig(n_head_layers=1), tiny_masking_vocab())
    batches = micro_batches()

    def engine_for(config: dict):
        torch.manual_seed(0)
        model = method.build(tiny_mlm(seed=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        optimizer = torch.optim.AdamW(param_groups(model, TRAIN.weight_decay), lr=TRAIN.lr)
        return distributed.engine(model, config, optimizer)

    def train(engine, first: int, last: int, save_after: int = -1) -> tuple[list[float], int]:
        losses, syncs = [], 0
        for i in range(first, last):
            loss, _ = method.backward(engine, batches[i])
            losses.append(float(loss))
            if engine.is_gradient_accumulation_boundary():
                syncs = host_syncs(engine.step)
            else:
                engine.step()
            if i == save_after:
                engine.save_checkpoint(checkpoint_dir, tag="step")
        return losses, syncs

    def state(engine) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}

    job = engine_for(deepspeed_config(TRAIN, 1))
    losses, syncs = train(job, 0, MICRO_BATCHES, save_after=3)  # saved after the second optimizer step
    out["job"] = {
        "optimizer": type(job.optimizer).__name__,
        "param_dtype": str(next(job.module.parameters()).dtype),
        "syncs": syncs,
        "losses": losses,
        "params": state(job),
        "tensors": sum(1 for _ in job.module.parameters()),
        "logged": mixed_precision_state(job, "bf16"),  # what the loop logs
    }
    resumed = engine_for(deepspeed_config(TRAIN, 1))
    resumed.load_checkpoint(checkpoint_dir, tag="step")
    losses, _ = train(resumed, 4, MICRO_BATCHES)
    out["resumed"] = {"losses": losses, "params": state(resumed)}
    # What one bf16 worker ran before: stage 0, gradients accumulated in bf16.
    before = {**deepspeed_config(TRAIN, 1), "zero_optimization": {"stage": 0}}
    before.pop("data_types")
    stage0 = engine_for(before)
    _, syncs = train(stage0, 0, 2)
    out["stage0"] = {"optimizer": type(stage0.optimizer).__name__, "syncs": syncs}


def test_one_bf16_worker_steps_with_few_host_syncs_and_resumes_to_the_same_step(tmp_path):
    out = distributed.spawn(_worker, 1, str(tmp_path / "ckpt"), deepspeed=True)
    job, resumed, stage0 = out["job"], out["resumed"], out["stage0"]

    # fp32 master weights and gradients in flat buffers; the module itself held in bf16.
    assert job["optimizer"] == "BF16_Optimizer" and job["param_dtype"] == "torch.bfloat16"
    # Its step reads the device a handful of times (the global norm), where stage 0's
    # optimizer read it at least once per parameter tensor (its overflow check).
    assert stage0["optimizer"] == "FP16_UnfusedOptimizer"
    assert job["syncs"] <= 8, job["syncs"]
    assert stage0["syncs"] >= job["tensors"], (stage0["syncs"], job["tensors"])

    # Training moves the loss, and a resume from the checkpoint of step 2 gives step 3's
    # losses and weights exactly (fp32 masters and optimizer state restored, not rebuilt
    # from the bf16 weights).
    assert job["losses"][-1] < job["losses"][0]
    assert 0 < job["logged"]["grad_norm"] < float("inf")
    assert resumed["losses"] == job["losses"][4:]
    for name, value in job["params"].items():
        assert torch.equal(resumed["params"][name], value), name
