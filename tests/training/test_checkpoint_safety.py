"""Resuming from a checkpoint, in one DeepSpeed process without Ray Train: the suite's fast
check of what the long checks prove through whole runs.

- A ZeRO-3 run resumed from its checkpoint of step 2 trains steps 3 and 4 to the weights and
  losses of the run never stopped, bit for bit: the sharded fp32 masters and Adam's moments
  come back through :func:`restore_checkpoint`, as a worker restores them.
- Nothing a checkpoint folder holds is executed on resume: DeepSpeed's own files load with
  weights_only=True (its few state types allowed), so a pickle planted in the bucket fails to
  load instead of running. The seal's signature (tests/data/test_stream.py) refuses a planted
  folder before this; here the seal is signed with the run's key, as if the key had leaked,
  so the loader is what stands.

DeepSpeed runs in a spawned process (its process group must not outlive the tests), once for
the module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
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


STEPS, SAVED_AT = 4, 2


def _batch(step: int) -> dict[str, torch.Tensor]:
    words = random_word_batch(4, 16, seed=step, pad_rows=0.0)
    ids, labels = whole_word_mask(words.input_ids, tiny_masking_vocab(), torch.Generator().manual_seed(step), 0.3)
    return {"input_ids": ids, "attention_mask": words.attention_mask, "labels": labels}


def _train(method, engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        loss, _ = method.backward(engine, _batch(step))
        engine.step()
        losses.append(float(loss))
    return losses


def _checkpoint(engine, run_dir: str, step: int) -> str:
    """What a worker's save writes, without Ray Train's report: DeepSpeed's state, the
    trainer's state, the seal, the pointer."""
    folder = os.path.join(run_dir, NAME)
    engine.save_checkpoint(folder, tag=CHECKPOINT_TAG)
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"step": step}, f)
    sealed.seal(folder, "rank0", SEAL_KEY)
    write_pointer(run_dir, NAME, step)
    return folder


def _planted(stage: int, precision: str, run_dir: str, folder: str, marker: str) -> str | None:
    """Every state file replaced by a pickle that writes ``marker``, sealed with the key: the
    resume's error (None: it loaded)."""
    for state_file in sorted(os.listdir(os.path.join(folder, CHECKPOINT_TAG))):
        torch.save(Planted(marker), os.path.join(folder, CHECKPOINT_TAG, state_file))
    sealed.seal(folder, "rank0", SEAL_KEY)
    try:
        restore_checkpoint(_engine(stage, precision)[1], 0, run_dir, SEAL_KEY)
        return None
    except Exception as exc:  # what the test checks is the kind, and that nothing ran first
        return str(exc) if isinstance(exc, ArtifactError) else f"{type(exc).__name__}: {exc}"


def _worker(rank: int, world: int, out: dict, root: str):
    for stage, precision in SETTINGS:
        setting = f"zero{stage}-{precision}"
        run_dir = os.path.join(root, setting)
        method, whole = _engine(stage, precision)
        losses = _train(method, whole, 0, SAVED_AT)
        folder = _checkpoint(whole, run_dir, SAVED_AT)
        losses += _train(method, whole, SAVED_AT, STEPS)
        # A genuine checkpoint loads under the weights-only guard (the allowed types suffice),
        # and training on from it gives the uninterrupted run's steps.
        _, resumed = _engine(stage, precision)
        restored = restore_checkpoint(resumed, 0, run_dir, SEAL_KEY)
        resumed_losses = _train(method, resumed, restored.state.step, STEPS)
        same = all(torch.equal(a, b) for a, b in zip(_params(whole).values(), _params(resumed).values()))
        result: dict = {"step": restored.state.step, "losses": losses, "resumed_losses": resumed_losses}
        result["same_weights"] = same
        marker = os.path.join(root, f"planted-{setting}.txt")
        result["error"] = _planted(stage, precision, run_dir, folder, marker)
        result["planted_ran"] = os.path.exists(marker)
        out[setting] = result


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[dict, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    return distributed.spawn(_worker, 1, str(root), deepspeed=True), str(root)


def test_a_zero3_run_resumed_from_its_checkpoint_trains_on_bit_for_bit(resumed):
    """Mutation: restore_checkpoint loading DeepSpeed's state without its optimizer states
    (``load_optimizer_states=False``): Adam's moments start again, and step 3's loss and the
    final weights differ."""
    out, _ = resumed
    for setting, result in out.items():
        assert result["step"] == SAVED_AT, setting
        assert result["resumed_losses"] == result["losses"][SAVED_AT:], setting
        assert result["same_weights"], setting
        assert result["losses"][-1] != result["losses"][0]  # it trained


def test_a_planted_pickle_in_a_checkpoint_fails_to_load_and_never_runs(resumed):
    """Mutation: ``weights_only_loads`` made a no-op (DeepSpeed's own torch.load with
    weights_only=False): the planted object runs, writing its marker, before any error."""
    out, root = resumed
    for setting, result in out.items():
        assert result["planted_ran"] is False, (setting, result["error"])
        error = result["error"] or ""
        assert error.startswith(f"checkpoint {os.path.join(root, setting, NAME)}: state/"), (setting, error)
        assert " holds the global " in error and "\n" not in error, error
