"""The training settings every trainer shares (the ``train`` section of each job's config)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Literal

from pipeline.core.sections import Output

TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass
class TrainConfig(
    Output.with_defaults(
        output="runs/pretrain",
        notes={
            "output": "the run folder: checkpoints, export, logs, curves (pre-training: empty = runs/pretrain-<method>)"
        },
    )
):
    num_workers: int = field(default=1, metadata={"help": "Ray Train workers (one per GPU on a cluster)"})
    use_gpu: bool = field(default=False, metadata={"help": "one GPU per worker"})
    cpus_per_worker: float = field(default=1.0, metadata={"help": "CPUs reserved per worker (also its torch threads)"})
    zero_stage: int = field(
        default=2,
        metadata={
            "help": "DeepSpeed ZeRO stage (picks pipeline/training/zero_templates/zero<N>.json); one worker uses stage 0 instead of 1/2"
        },
    )
    deepspeed_config: str = field(
        default="", metadata={"help": "explicit DeepSpeed JSON; its 'auto' values are filled from this config"}
    )
    precision: Literal["fp32", "bf16", "fp16"] = field(
        default="fp32", metadata={"help": "fp32, bf16 (CPU with avx512_bf16, Ampere+ GPUs) or fp16 (GPU)"}
    )
    micro_batch_size: int = field(default=32, metadata={"help": "sequences per worker per forward"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimiser step"})
    size_micro_batch: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata={
            "help": "keep each worker's rows per step (micro_batch_size x grad_accum: sequences, or the re-ranker's queries) but split them into the fewest equal micro-batches whose activations fit its device's memory, measured once the model is up; a resumed run keeps the first attempt's split while it fits. Only for losses that do not couple a batch's rows (MLM, Condenser, SimLM, the re-ranker) at ZeRO stage 0-2; coCondenser sizes its gradient cache's chunk instead. auto = on with GPUs"
        },
    )
    memory_gib: float = field(
        default=0.0,
        metadata={
            "help": "memory per worker that sizing (size_micro_batch; the gradient cache's chunk_size 0 of coCondenser and the retriever) may plan with; 0 = measured: the GPU's free memory, or on CPUs the node's available memory over its workers"
        },
    )
    max_steps: int = field(default=300, metadata={"help": "optimiser steps"})
    epochs: int = field(default=0, metadata={"help": "epochs to stream; 0 = as many as max_steps needs"})
    lr: float = field(default=1e-4, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases and LayerNorm)"})
    warmup_ratio: float = field(
        default=0.1, metadata={"help": "linear warm-up over this fraction of max_steps, then linear decay"}
    )
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clipping (0 = off)"})
    seed: int = field(default=42, metadata={"min": 0, "help": "seeds initialisation, masking and file order"})
    log_every: int = field(default=10, metadata={"help": "steps between log lines"})
    checkpoint_every: int = field(
        default=100, metadata={"help": "steps between checkpoints (also the most work a failure can lose)"}
    )
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept in storage"})
    max_failures: int = field(
        default=3,
        metadata={
            "help": "worker-group restarts Ray Train may do before giving up (a node lost after a preemption notice is not counted: Ray Train restarts those without limit)"
        },
    )
    preemption_check_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds between asks whether a node of the run was told it will be preempted (a node drained with a deadline: a spot reclaim); on a notice every worker saves a checkpoint at once, so the restarted run redoes none of the steps before it. The workers agree at each ask, from the slowest worker's step time, on the step of the next one, so every worker asks at the same step however long a step takes. Keep it well inside the drain window (Ray's default on SIGTERM: 30 s). 0 = never ask (a lost node then costs the steps since the last checkpoint)"
        },
    )
    profile_steps: int = field(
        default=0,
        metadata={
            "help": "optimizer steps to profile with torch.profiler on rank 0, after 10 steps of warm-up (the run's last ones when it is shorter): <output>/profile/rank0.txt lists the operators and kernels by their own device time, rank0.trace.json.gz is a Chrome/Perfetto trace. 0 = none"
        },
    )
    resource_wait_s: float = field(
        default=120.0,
        metadata={
            "help": "on a cluster without an autoscaler, how long to wait for the workers' CPUs and GPUs while other work holds them, then fail; 0 = as long as it takes (a request no node can hold fails at once; an autoscaling cluster waits for its new nodes)"
        },
    )
    capacity_wait_s: float = field(
        default=900.0,
        metadata={
            "min": 0,
            "help": "on an autoscaling cluster, how long the workers wait to be placed (counted from the cluster's last change: a node added or lost), then the run fails naming what never came; 0 = for ever",
        },
    )
    prefetch_batches: int = field(default=4, metadata={"help": "batches Ray Data prepares ahead of each worker"})
    collate_ahead: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata={
            "help": "mask and collate the next micro-batch in a thread while this one trains; auto = on with GPUs (on CPUs the step already uses every core)"
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the trained module's repeated transformer blocks in place, shapes static until one changes (then dynamic: one more graph), before DeepSpeed wraps it; same losses and gradients. Off by default: compiling takes about a minute, and its speed against eager is in bench/README.md"
        },
    )
    data_trace: bool = field(
        default=False, metadata={"help": "write the corpus rows each worker consumed, per epoch (audit)"}
    )
    tracker: list[str] = field(
        default_factory=list,
        metadata={
            "help": "experiment trackers rank 0 writes to, several allowed: tensorboard (event files in the run folder), wandb, mlflow (credentials from their own environment variables)"
        },
    )

    def __post_init__(self):
        unknown = [t for t in self.tracker if t not in TRACKERS]
        if unknown:
            raise ValueError(f"tracker {unknown[0]!r} is not one of {', '.join(TRACKERS)}")
        at_least_one = ("num_workers", "micro_batch_size", "grad_accum", "log_every", "checkpoint_every")
        for name in at_least_one + ("keep_checkpoints",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        at_least_zero = (
            "max_steps",
            "epochs",
            "max_failures",
            "preemption_check_s",
            "profile_steps",
            "prefetch_batches",
            "resource_wait_s",
            "capacity_wait_s",
            "memory_gib",
        )
        for name in at_least_zero + ("weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps == 0 and self.epochs == 0:
            raise ValueError("max_steps and epochs are both 0: set one (max_steps 0 = as many as the epochs make)")
        for name in ("lr", "adam_eps", "cpus_per_worker"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


# The train section of every embedded default (a job or workflow run with no arguments on a
# 2-core laptop, in minutes), in one place. Each worker takes the laptop's 2 cores.
EMBEDDED_CPUS_PER_WORKER = 2
EMBEDDED: dict[str, dict] = {
    "pretrain": dict(output="", micro_batch_size=16, max_steps=200, lr=5e-4),
    "finetune": dict(output="runs/finetune", micro_batch_size=16, max_steps=0, epochs=2, lr=5e-4),
    "distill": dict(output="runs/distill", micro_batch_size=16, max_steps=0, epochs=2, lr=5e-4),
    "rerank": dict(output="runs/rerank", micro_batch_size=8, max_steps=0, epochs=1, lr=1e-4),
    # the recipe's retrievers (rounds 1 and 2, the distilled student) and its re-ranker:
    # 100 steps, enough to move the tiny model
    "recipe.retriever": dict(micro_batch_size=16, max_steps=100, lr=5e-4, checkpoint_every=50),
    "recipe.reranker": dict(micro_batch_size=8, max_steps=100, lr=1e-4, checkpoint_every=50),
    # the comparison: its BERT from scratch, then a few steps of each method and fine-tuning
    "compare.scratch": dict(micro_batch_size=32, max_steps=300, lr=5e-4),
    "compare.pretrain": dict(micro_batch_size=16, max_steps=30, lr=5e-5, checkpoint_every=50),
    "compare.finetune": dict(micro_batch_size=16, max_steps=30, lr=3e-5, checkpoint_every=50),
}


def embedded_train(name: str) -> TrainConfig:
    """The ``train`` section of the embedded default ``name`` (see ``EMBEDDED``)."""
    return TrainConfig(cpus_per_worker=EMBEDDED_CPUS_PER_WORKER, **EMBEDDED[name])


def epochs_needed(train: TrainConfig, sequences_per_epoch: int) -> int:
    if train.epochs:
        return train.epochs
    per_step = train.micro_batch_size * train.grad_accum * train.num_workers
    return max(1, math.ceil(train.max_steps * per_step / max(1, sequences_per_epoch)) + 1)


def warn_if_a_step_exceeds_an_epoch(train: TrainConfig, per_epoch: int, what: str) -> None:
    """One stderr line when a single optimiser step reads more than an epoch of ``what``:
    each step then trains on repeats of the same rows (a micro-batch meant for another corpus)."""
    per_step = train.micro_batch_size * train.grad_accum * train.num_workers
    if per_step > per_epoch:
        print(
            f"warning: one step reads {per_step} {what} (micro_batch_size x grad_accum x num_workers), "
            f"more than an epoch (~{per_epoch}): each step spans ~{per_step / max(per_epoch, 1):.1f} epochs",
            file=sys.stderr,
            flush=True,
        )
