"""The DeepSpeed configuration of a run: a ZeRO template (package data) with its ``"auto"``
values filled from the training config."""

from __future__ import annotations

import json
import sys
from importlib import resources

from pipeline.training.train_config import TrainConfig

TEMPLATES = "zero_templates"  # package data: zero0.json .. zero3.json


def import_deepspeed(keep_mlflow: bool = False):
    """``import deepspeed`` without DeepSpeed importing MLflow, unless ``keep_mlflow``.

    DeepSpeed's autotuner, which raydense never runs, imports MLflow when it is installed:
    3 of the 7 s that ``import torch, deepspeed`` took on 2 cores, paid again by every Ray
    Train worker process. MLflow is hidden for that one import only, so it stays importable
    afterwards (a run with ``--train.tracker mlflow`` imports it normally)."""
    if keep_mlflow or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` now raises ImportError, which DeepSpeed catches
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def skip_inference_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce when its CPU backend
    starts (``deepspeed_shm_comm``: about 40 s of C++ compilation on a 2-core machine with a
    fresh extension cache, and a compiler on every CPU node). DeepSpeed uses that op only for
    its inference all-reduce; training reduces through torch.distributed, which is all a
    raydense worker calls. Marked incompatible, the op is not built and the backend runs
    without it. Call before ``deepspeed.init_distributed`` / ``deepspeed.initialize``."""
    import deepspeed.ops

    # DeepSpeed probes its ops once per process and keeps the answer in this dict.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def effective_zero_stage(train: TrainConfig, world_size: int) -> int:
    """ZeRO partitions optimiser state across workers; with one worker there is nothing to
    partition, and its gradient hooks cost ~4% of a step (bench/bench_pretrain.py), so a
    single fp32 or fp16 worker uses stage 0. A single bf16 worker uses stage 1 with fp32
    gradient accumulation (:func:`single_bf16_worker`), which DeepSpeed runs with its
    ``BF16_Optimizer``: one partition, no gradient hooks. Stage 3 is kept: it also shards
    parameters for offload."""
    if single_bf16_worker(train, world_size):
        return 1
    if world_size == 1 and train.zero_stage in (1, 2):
        return 0
    return train.zero_stage


def single_bf16_worker(train: TrainConfig, world_size: int) -> bool:
    """Whether the run is one bf16 worker at stage 0-2, which DeepSpeed would otherwise run
    at stage 0 with gradients accumulated in bf16 through ``FP16_UnfusedOptimizer``. That
    optimizer checks each parameter's gradient for overflow on the host, one device sync per
    tensor (234 for a BERT-base Condenser), which leaves a GPU idle while the host works
    through its per-tensor loops: the job ran at 0.72 of the bare model step on an H100
    (bench/README.md). ``BF16_Optimizer`` keeps fp32 master weights and fp32 gradients in
    flat buffers and syncs once, on the global norm; accumulating micro-batches in fp32 also
    stops bf16 from rounding each sum."""
    return world_size == 1 and train.precision == "bf16" and train.zero_stage in (1, 2)


def deepspeed_config(train: TrainConfig, world_size: int) -> dict:
    """Load the DeepSpeed JSON and fill each ``"auto"`` from our config."""
    stage = effective_zero_stage(train, world_size)
    if train.deepspeed_config:
        with open(train.deepspeed_config) as f:
            cfg = json.load(f)
    else:
        cfg = json.loads(resources.files("pipeline.training").joinpath(TEMPLATES, f"zero{stage}.json").read_text())
    fill = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch_size * train.grad_accum * world_size,
        "gradient_clipping": train.grad_clip,
    }
    for key, value in fill.items():
        if cfg.get(key, "auto") == "auto":
            cfg[key] = value
    for name in ("bf16", "fp16"):
        section = cfg.setdefault(name, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = train.precision == name
    if not train.deepspeed_config:
        cfg.setdefault("zero_optimization", {})["stage"] = stage
        if single_bf16_worker(train, world_size):
            cfg.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    return cfg
