"""A worker's batches over a fine-tuning run's epochs: each epoch's dataset shard is asked of
Ray Train only in its turn (each ask starts a split coordinator and the epoch's stream),
so the first batch waits for the first epoch alone."""

from __future__ import annotations

import types

import numpy as np
import torch

from pipeline.training import worker
from pipeline.training.train_config import TrainConfig


def _worker_over(epochs: int) -> worker.WorkerRun:
    run = object.__new__(worker.WorkerRun)  # no engine or Ray Train: only what batches() reads
    run.train = TrainConfig(micro_batch_size=2, collate_ahead="off")
    run.state = types.SimpleNamespace(micro_batch_size=2, micro_step=0)
    run.config = {"datasets": [f"train_{i:04d}" for i in range(epochs)]}
    run.task = types.SimpleNamespace(make_batch=lambda batch, generator: {"x": torch.as_tensor(batch["x"])})
    run.rank = 0
    run.window = worker.LogWindow()
    return run


def test_the_first_batch_asks_for_the_first_epochs_shard_only(monkeypatch):
    """Mutation: every epoch's shard asked for at the worker's start
    (``[lambda it=shard_batches(name, ...): it ...]`` in ``WorkerRun.batches``, the regression
    bench_finetune measured: first step 14.8 -> 22.9 s) asks 10 shards before the first batch."""
    asked: list[str] = []

    def shard_batches(name, train, micro_batch_size):
        asked.append(name)
        return iter([{"x": np.arange(4)[i : i + 2]} for i in (0, 2)])

    monkeypatch.setattr(worker, "shard_batches", shard_batches)
    batches = iter(_worker_over(epochs=10).batches())
    first, _ = next(batches)
    assert first["x"].tolist() == [0, 1]
    # The first epoch's, and at most the next one's, which starts in a thread once the
    # first batch is taken (its stream prepares while this epoch trains).
    assert asked[0] == "train_0000" and len(asked) <= 2, asked
    rest = list(batches)
    assert len(rest) == 2 * 10 - 1 and asked == [f"train_{i:04d}" for i in range(10)]
