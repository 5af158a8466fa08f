"""Training checkpoints: the DeepSpeed engine's state with the data position of every rank.

Checkpoint layout (one Ray Train checkpoint directory per save, ``checkpoint_<step>``)::

    state/...                   DeepSpeed engine: weights, optimiser (ZeRO shards per rank), schedule
    latest                      DeepSpeed's tag file
    trainer_state.json          step, tokens, loss history (rank 0)
    position_rank<r>.json       the corpus rows rank r consumed, per epoch
    counters_rank<r>.json       rank r's task counters

On the next worker-group start, the stream reads the position of the checkpoint Ray
Train will restore (:func:`pipeline.data.position.read_position`).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field

import ray.train

from pipeline.data.position import DataPosition, write_pointer

CHECKPOINT_TAG = "state"


@dataclass
class TrainState:
    step: int = 0
    micro_step: int = 0
    tokens: int = 0
    history: list[dict] = field(default_factory=list)
    restarts: int = 0
    resumes: list[dict] = field(default_factory=list)  # one entry per restore: where from, rows repeated/skipped
    counters: dict[str, int] = field(default_factory=dict)  # this rank's share of task.counters since the start


def save_checkpoint(engine, state: TrainState, position: DataPosition, rank: int, run_dir: str, metrics: dict) -> None:
    name = f"checkpoint_{state.step:09d}"
    with tempfile.TemporaryDirectory(prefix="raydense-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=CHECKPOINT_TAG)
        with open(os.path.join(tmp, f"position_rank{rank}.json"), "w") as f:
            json.dump(position.to_json(), f)
        with open(os.path.join(tmp, f"counters_rank{rank}.json"), "w") as f:
            json.dump(state.counters, f)
        if rank == 0:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(asdict(state), f)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    if rank == 0:
        write_pointer(run_dir, name, state.step)


def restore_checkpoint(engine, rank: int) -> tuple[TrainState, DataPosition, str | None]:
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return TrainState(), DataPosition(), None
    with checkpoint.as_directory() as d:
        engine.load_checkpoint(d, tag=CHECKPOINT_TAG)
        with open(os.path.join(d, "trainer_state.json")) as f:
            state = TrainState(**json.load(f))
        position, counters = DataPosition(), {}
        for name in os.listdir(d):
            if name.startswith("position_rank"):
                with open(os.path.join(d, name)) as f:
                    position = position.merge(DataPosition.from_json(json.load(f)))
            elif name.startswith("counters_rank"):
                with open(os.path.join(d, name)) as f:
                    for key, value in json.load(f).items():
                        counters[key] = counters.get(key, 0) + value
    # Every rank restores the same totals; rank 0 alone carries them, so the final
    # all-reduce of per-rank counters counts them once (whatever the new world size).
    state.counters = counters if rank == 0 else {}
    state.restarts += 1
    return state, position, os.path.basename(checkpoint.path.rstrip("/"))
