"""Training checkpoints: the DeepSpeed engine's state with the data position of every rank.

Checkpoint layout (one Ray Train checkpoint directory per save, ``checkpoint_<step>``)::

    state/...                   DeepSpeed engine: weights, optimiser (ZeRO shards per rank), schedule
    latest                      DeepSpeed's tag file
    trainer_state.json          step, tokens, loss history (rank 0)
    position_rank<r>.json       the corpus rows rank r consumed, per epoch
    counters_rank<r>.json       rank r's task counters
    seal_rank<r>.json           the files rank r wrote, hashed and signed (pipeline.core.sealed)

On the next worker-group start, the stream reads the position of the checkpoint Ray
Train will restore (:func:`pipeline.data.position.read_position`).

Nothing read back is executed. raydense's own files are JSON; a resume first checks every
seal's signature (a folder planted in the bucket is refused), then its hashes, and DeepSpeed's
``state/*.pt`` files load with ``torch.load(weights_only=True)``, allowing only the few types
DeepSpeed's own state holds (:func:`_deepspeed_state_types`), where DeepSpeed itself
unpickles whatever a file holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import tempfile
from dataclasses import asdict, dataclass, field

import ray.train
import torch

from pipeline.core import sealed, storage
from pipeline.core.errors import ArtifactError
from pipeline.data.position import (
    DataPosition,
    checkpoint_folders,
    checkpoint_order,
    checkpoint_step,
    restorable_checkpoint,
    write_pointer,
)

CHECKPOINT_TAG = "state"


def _deepspeed_state_types() -> list[type]:
    """The classes DeepSpeed pickles into its checkpoints besides tensors and builtins
    (found by loading every ZeRO stage's and precision's files with weights_only=True)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


class _WeightsOnlyLoads:
    """The engine's checkpoint engine, its loads made with ``weights_only=True``."""

    def __init__(self, inner, local_dir: str, name: str):
        self.inner, self.local_dir, self.name = inner, local_dir, name

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def load(self, path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(_deepspeed_state_types()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            what = f"the global {found.group(1)}" if found else "what no checkpoint holds"
            raise ArtifactError(
                f"checkpoint {self.name}: {os.path.relpath(path, self.local_dir)} holds {what}, which "
                "DeepSpeed's state never does: not loading it (remove the folder to resume from an earlier one)"
            ) from None


@contextlib.contextmanager
def weights_only_loads(engine, local_dir: str, name: str):
    """While it is open, ``engine.load_checkpoint`` unpickles only tensors, builtins and
    DeepSpeed's own state types (``name``: the checkpoint, for the message)."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _WeightsOnlyLoads(inner, local_dir, name)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


@dataclass
class TrainState:
    step: int = 0
    micro_step: int = 0
    tokens: int = 0
    history: list[dict] = field(default_factory=list)
    restarts: int = 0
    resumes: list[dict] = field(default_factory=list)  # one entry per restore: where from, rows repeated/skipped
    preemptions: list[dict] = field(default_factory=list)  # one entry per preemption notice: its step, nodes, deadline
    counters: dict[str, int] = field(default_factory=dict)  # this rank's share of task.counters since the start
    micro_batch_size: int = 0  # the micro-batch the run trains with: a resume keeps a sized one (0: not yet chosen)


def save_checkpoint(
    engine,
    state: TrainState,
    position: DataPosition,
    rank: int,
    run_dir: str,
    metrics: dict,
    key: sealed.SealKey,
    suffix: str = "",
) -> None:
    """``suffix``: set after a resume that passed over damaged checkpoints of later steps,
    which this attempt saves again under new names."""
    name = f"checkpoint_{state.step:09d}{suffix}"
    with tempfile.TemporaryDirectory(prefix="raydense-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=CHECKPOINT_TAG)
        with open(os.path.join(tmp, f"position_rank{rank}.json"), "w") as f:
            json.dump(position.to_json(), f)
        with open(os.path.join(tmp, f"counters_rank{rank}.json"), "w") as f:
            json.dump(state.counters, f)
        if rank == 0:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(asdict(state), f)
        sealed.seal(tmp, f"rank{rank}", key)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    if rank == 0:
        write_pointer(run_dir, name, state.step)


@dataclass
class Restored:
    state: TrainState
    position: DataPosition
    checkpoint: str | None  # the folder restored from (None: a fresh start)
    # "" unless folders of later steps exist (damaged ones passed over): then what this
    # attempt's checkpoints append to their names, "-r<n>" with an n no folder has, since a
    # folder Ray Train registered is never rewritten.
    name_suffix: str


def restore_checkpoint(engine, rank: int, run_dir: str, key: sealed.SealKey) -> Restored:
    name = restorable_checkpoint(run_dir)
    if name is None:
        return Restored(TrainState(), DataPosition(), None, "")
    uri = storage.join(run_dir, name)
    loc = storage.resolve(uri)
    checkpoint = (
        ray.train.Checkpoint(loc.path, filesystem=storage.sdk_retrying_filesystem())
        if storage.is_s3(uri)
        else ray.train.Checkpoint(uri)
    )
    with checkpoint.as_directory() as d:
        problem = sealed.verify(d, key, uri)
        if problem is not None:
            # Marked, then this start fails: the next one (Ray Train's retry, or a rerun)
            # resumes from an earlier checkpoint, as the stream will then too.
            sealed.mark_damaged(uri, problem)
            raise RuntimeError(f"checkpoint {uri} is damaged ({problem}); the next attempt resumes from an earlier one")
        with weights_only_loads(engine, d, uri):
            engine.load_checkpoint(d, tag=CHECKPOINT_TAG)
        with open(os.path.join(d, "trainer_state.json")) as f:
            state = TrainState(**json.load(f))
        position, counters = DataPosition(), {}
        for file in os.listdir(d):
            if file.startswith("position_rank"):
                with open(os.path.join(d, file)) as f:
                    position = position.merge(DataPosition.from_json(json.load(f)))
            elif file.startswith("counters_rank"):
                with open(os.path.join(d, file)) as f:
                    for key, value in json.load(f).items():
                        counters[key] = counters.get(key, 0) + value
    # Every rank restores the same totals; rank 0 alone carries them, so the final
    # all-reduce of per-rank counters counts them once (whatever the new world size).
    state.counters = counters if rank == 0 else {}
    state.restarts += 1
    folders = checkpoint_folders(run_dir)
    suffix = ""
    if any(checkpoint_step(n) > state.step for n in folders):
        suffix = f"-r{1 + max(checkpoint_order(n)[1] for n in folders)}"
    return Restored(state, position, name, suffix)
