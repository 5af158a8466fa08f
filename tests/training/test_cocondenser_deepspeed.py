"""coCondenser under DeepSpeed: the gradient cache across 2 workers equals one full batch.

Two real processes (gloo) each run DeepSpeed ZeRO-1 or ZeRO-2 on half of a fixed batch
of span pairs, through ``CoCondenserMethod.backward``, the code the trainer runs. Their
reduced gradients must equal those of the plain full-batch loss on one process:
per-span (head MLM + late MLM) averaged over all 2n spans, plus the span-pair
contrastive loss over all 2n spans. Dropout is 0 so both sides see the same function
(the RNG replay under dropout is tested in test_cocondenser_loss.py).
"""

from __future__ import annotations

import pytest
import torch

from models.cocondenser import (
    CoCondenserConfig,
    CoCondenserMethod,
    span_contrastive_loss,
)
from models.condenser import Condenser
from models.masking import whole_word_mask
from models.mlm_losses import sequence_mlm_losses
from pipeline.training.engine import mixed_precision_state
from tests import distributed
from tests.helpers import random_word_batch, tiny_masking_vocab, tiny_mlm, tiny_vocab

WORLD = 2
FP32_TOLERANCE, BF16_TOLERANCE = 1e-4, 3e-2  # relative gradient error; bf16 keeps 8 bits of mantissa
PAIRS_PER_WORKER = 4  # 8 spans per worker, 16 in the global batch
CASES = [  # (ZeRO stage, precision, chunk size in spans; 0 = no cache)
    # Each stage without the cache, with chunks that split partners (3: not a divisor of the 8
    # local spans) and with one chunk holding every span; bf16 with and without the cache.
    (1, "fp32", 0),
    (1, "fp32", 3),
    (2, "fp32", 0),
    (2, "fp32", 3),
    (2, "fp32", 8),
    (1, "bf16", 4),
    (2, "bf16", 0),
    (3, "fp32", 0),  # ZeRO-3: every weight partitioned; its cache coalesces the chunks' reductions
    (3, "fp32", 3),
]


def build_model() -> Condenser:
    return Condenser(tiny_mlm(len(tiny_vocab()), seed=0, initializer_range=0.2), n_head_layers=2)


def global_batch() -> dict[str, torch.Tensor]:
    """2 x WORLD x PAIRS_PER_WORKER masked spans; rows 2i and 2i+1 are partners."""
    wb = random_word_batch(2 * WORLD * PAIRS_PER_WORKER, 20, seed=5, pad_rows=0.5, inner_sep=0.0)
    ids, labels = whole_word_mask(wb.input_ids, tiny_masking_vocab(), torch.Generator().manual_seed(1), 0.3)
    return {"input_ids": ids, "attention_mask": wb.attention_mask, "labels": labels}


def _worker(rank: int, world: int, out: dict):
    n = 2 * PAIRS_PER_WORKER
    local = {k: v[rank * n : (rank + 1) * n] for k, v in global_batch().items()}
    for stage, precision, chunk in CASES:
        method = CoCondenserMethod(CoCondenserConfig(head="", chunk_size=chunk), tiny_masking_vocab())
        engine = distributed.engine(build_model(), distributed.plain_config(PAIRS_PER_WORKER, stage, precision))
        loss, extras = method.backward(engine, local)
        grads = distributed.full_gradients(engine)
        engine.step()  # one optimiser step per global batch, with no hang
        # The logged loss is this worker's MLM share plus the global contrastive loss.
        out[(rank, stage, precision, chunk)] = {
            "grads": grads if rank == 0 else None,
            "loss": float(loss),
            "contrastive": float(extras["contrastive_loss"]),
            "logged": mixed_precision_state(engine, precision),  # what the loop logs (grad_norm in bf16)
        }
        del engine


def reference(batch: dict | None = None, dtype: torch.dtype = torch.float32):
    """One process, the whole global batch (or ``batch``) in one graph."""
    model = build_model().to(dtype)
    batch = batch if batch is not None else global_batch()
    out = model(batch["input_ids"], batch["attention_mask"], batch["labels"], per_sequence=True)
    n_spans = batch["input_ids"].shape[0]
    mlm = (out.head_mlm_loss + out.late_mlm_loss).sum() / n_spans
    contrastive = span_contrastive_loss(out.late_cls)
    (mlm + contrastive).backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, (mlm + contrastive).item(), contrastive.item()


@pytest.fixture(scope="module")
def distributed_results():
    return distributed.spawn(_worker, WORLD, deepspeed=True)


@pytest.mark.parametrize("stage,precision,chunk", CASES)
def test_two_deepspeed_workers_match_the_full_batch_gradient(distributed_results, stage, precision, chunk):
    ref_grads, ref_loss, ref_contrastive = reference()
    ranks = [distributed_results[(rank, stage, precision, chunk)] for rank in range(WORLD)]
    tolerance = FP32_TOLERANCE if precision == "fp32" else BF16_TOLERANCE
    assert distributed.relative_error(ranks[0]["grads"], ref_grads) < tolerance
    assert sum(r["loss"] for r in ranks) / WORLD == pytest.approx(ref_loss, rel=tolerance)
    for r in ranks:
        assert r["contrastive"] == pytest.approx(ref_contrastive, rel=tolerance)
    if precision == "bf16":  # the loop logs the step's global gradient norm: the full batch's
        norm = float(torch.cat([g.flatten() for g in ref_grads.values()]).norm())
        assert [r["logged"]["grad_norm"] for r in ranks] == pytest.approx([norm] * WORLD, rel=tolerance)
    else:
        assert all(r["logged"] == {} for r in ranks)


def test_the_bf16_bound_fits_bf16_rounding_and_catches_a_missing_gather():
    """Control for the bounds above. The whole batch in bf16 in one process stays inside
    the bf16 bound (its own rounding: 0.018), while what two workers without the
    cross-worker gather would report (each its half of the batch, the gradients then
    averaged by DeepSpeed's all-reduce) misses the reference by more than 2.5 times that
    bound (0.087 against 0.03, measured): a broken gather cannot pass even the bf16 cases."""
    ref_grads, _, _ = reference()
    bf16_grads, _, _ = reference(dtype=torch.bfloat16)
    assert distributed.relative_error(bf16_grads, ref_grads) < BF16_TOLERANCE
    spans = 2 * PAIRS_PER_WORKER
    halves = [{k: v[rank * spans : (rank + 1) * spans] for k, v in global_batch().items()} for rank in range(WORLD)]
    local = [reference(half)[0] for half in halves]
    averaged = {k: sum(grads[k] for grads in local) / WORLD for k in ref_grads}
    assert distributed.relative_error(averaged, ref_grads) > 2.5 * BF16_TOLERANCE


def test_sequence_losses_average_to_the_per_span_mean():
    model = build_model()
    batch = global_batch()
    late = model.lm.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    per_span = sequence_mlm_losses(model.lm, late, batch["labels"])
    for i in range(batch["input_ids"].shape[0]):
        picked = batch["labels"][i] != -100
        expected = (
            torch.nn.functional.cross_entropy(model.lm.cls(late[i][picked]), batch["labels"][i][picked])
            if picked.any()
            else torch.tensor(0.0)
        )
        assert per_span[i].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


class _Engine:
    """The parts of a DeepSpeed engine the refusal checks read."""

    def __init__(self, stage: int, fp16: bool):
        self.module, self.stage, self.fp16 = build_model(), stage, fp16

    def zero_optimization_stage(self):
        return self.stage

    def fp16_enabled(self):
        return self.fp16


def test_the_cache_refuses_fp16():
    method = CoCondenserMethod(CoCondenserConfig(head="", chunk_size=2), tiny_masking_vocab())
    batch = {k: v[:8] for k, v in global_batch().items()}
    with pytest.raises(ValueError, match="not fp16"):
        method.backward(_Engine(2, True), batch)
