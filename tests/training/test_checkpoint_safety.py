"""Nothing a checkpoint folder holds is executed on resume: DeepSpeed's own files load with
weights_only=True (its few state types allowed), so a pickle planted in the bucket fails to
load instead of running. The seal's signature (tests/data/test_stream.py) refuses a planted
folder before this; here the seal is signed with the run's key, as if the key had leaked,
so the loader is what stands.

DeepSpeed runs in a spawned process (its process group must not outlive the test)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from models.condenser import CondenserConfig, CondenserMethod
from models.masking import whole_word_mask
from pipeline.core import sealed
from pipeline.core.errors import ArtifactError
from pipeline.data.position import write_pointer
from pipeline.training.checkpoints import CHECKPOINT_TAG, restore_checkpoint
from pipeline.training.deepspeed_config import deepspeed_config
from pipeline.training.engine import param_groups
from pipeline.training.train_config import TrainConfig
from tests import distributed
from tests.helpers import SEAL_KEY, random_word_batch, tiny_masking_vocab, tiny_mlm

NAME = "checkpoint_000000001"
# ZeRO-3 in fp32 pickles ZeroStageEnum and LossScaler into its optimizer state; ZeRO-1 in
# bf16 pickles fragment_address: between them, every type DeepSpeed's state is allowed.
SETTINGS = [(3, "fp32"), (1, "bf16")]


class Planted:
    """What an attacker writes in place of a state file: unpickling it writes ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


def _engine(stage: int, precision: str):
    method = CondenserMethod(CondenserConfig(n_head_layers=1), tiny_masking_vocab())
    torch.manual_seed(0)
    model = method.build(tiny_mlm(seed=1))
    train = TrainConfig(zero_stage=stage, precision=precision, micro_batch_size=4, grad_accum=1, lr=1e-3)
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-3)
    return method, distributed.engine(model, deepspeed_config(train, 1), optimizer)


def _params(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _worker(rank: int, world: int, out: dict, root: str):
    for stage, precision in SETTINGS:
        run_dir = os.path.join(root, f"zero{stage}-{precision}")
        folder = os.path.join(run_dir, NAME)
        method, trained = _engine(stage, precision)
        words = random_word_batch(4, 16, seed=1, pad_rows=0.0)
        ids, labels = whole_word_mask(words.input_ids, tiny_masking_vocab(), torch.Generator().manual_seed(0), 0.3)
        method.backward(trained, {"input_ids": ids, "attention_mask": words.attention_mask, "labels": labels})
        trained.step()
        trained.save_checkpoint(folder, tag=CHECKPOINT_TAG)
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            json.dump({"step": 1}, f)
        sealed.seal(folder, "rank0", SEAL_KEY)
        write_pointer(run_dir, NAME, 1)
        # A genuine checkpoint loads under the weights-only guard: the allowed types suffice.
        _, resumed = _engine(stage, precision)
        restored = restore_checkpoint(resumed, 0, run_dir, SEAL_KEY)
        same = all(torch.equal(a, b) for a, b in zip(_params(trained).values(), _params(resumed).values()))
        result: dict = {"step": restored.state.step, "same_weights": same}
        marker = os.path.join(root, f"planted-{stage}.txt")
        for state_file in sorted(os.listdir(os.path.join(folder, CHECKPOINT_TAG))):
            torch.save(Planted(marker), os.path.join(folder, CHECKPOINT_TAG, state_file))
        sealed.seal(folder, "rank0", SEAL_KEY)
        try:
            restore_checkpoint(_engine(stage, precision)[1], 0, run_dir, SEAL_KEY)
            result["error"] = None
        except Exception as exc:  # what the test checks is the kind, and that nothing ran first
            result["error"] = str(exc) if isinstance(exc, ArtifactError) else f"{type(exc).__name__}: {exc}"
        result["planted_ran"] = os.path.exists(marker)
        out[f"zero{stage}-{precision}"] = result


def test_a_planted_pickle_in_a_checkpoint_fails_to_load_and_never_runs(tmp_path):
    """Mutation: ``weights_only_loads`` made a no-op (DeepSpeed's own torch.load with
    weights_only=False): the planted object runs, writing its marker, before any error."""
    out = distributed.spawn(_worker, 1, str(tmp_path), deepspeed=True)
    for setting, result in out.items():
        assert result["step"] == 1 and result["same_weights"], (setting, result)
        assert result["planted_ran"] is False, (setting, result["error"])
        error = result["error"] or ""
        assert error.startswith(f"checkpoint {tmp_path / setting / NAME}: state/"), (setting, error)
        assert " holds the global " in error and "\n" not in error, error
