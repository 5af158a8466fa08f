"""The task a trainer hands the loop (:class:`TrainTask`) and the DeepSpeed engine a worker
trains: the task's model (checked to fit the worker at its ZeRO stage), AdamW over decayed
and undecayed groups, the linear schedule; what a log line reads of its precision; and the
fp32 export of its weights (gathered first under ZeRO-3).
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Callable, Protocol

import numpy as np
import ray.train.torch
import torch

from models.compiled import compile_in_place
from models.memory import ActivationCost, model_state, parameter_counts, total_memory
from pipeline.core import storage
from pipeline.core.errors import ConfigError
from pipeline.training.deepspeed_config import effective_zero_stage, import_deepspeed, skip_inference_comm_op
from pipeline.training.train_config import TrainConfig


class TrainTask(Protocol):
    """What a trainer plugs into the loop. Built on the worker, from picklable settings."""

    def build_model(self) -> torch.nn.Module: ...
    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]: ...
    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and ``engine.backward`` for one micro-batch; returns (loss to log, extras)."""

    def consumed_rows(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]: ...
    def fit_to_memory(self, engine, available_bytes: int, micro_batch_size: int) -> dict:
        """Settings the task sizes from the memory its worker has free once the engine is
        up (coCondenser's gradient-cache chunk); returns them, to log."""

    def activation_cost(self, module: torch.nn.Module) -> ActivationCost | None:
        """What a micro-batch keeps for its backward, per stream row at its widest (measured
        on ``module``'s device); None where the micro-batch must not be split."""

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int: ...

    counter_names: tuple[str, ...]  # what counters() may return

    def counters(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        """Event counts to total over all workers for the summary (e.g. skipped documents)."""

    def export(self, model: torch.nn.Module, out_dir: str) -> dict[str, str]: ...


def linear_schedule(max_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    warmup = max(1, int(round(max_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup))

    return factor


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # An empty group (LoRA trains only 2-D adapters: no bias, no LayerNorm) is dropped by
    # DeepSpeed's ZeRO optimiser but not by the schedule built over it, which then fails.
    return [group for group in groups if group["params"]]


def check_model_memory(model: torch.nn.Module, train: TrainConfig, workers: int, memory_bytes: float, where: str):
    """A :class:`~pipeline.core.errors.ConfigError` naming the bytes when the model's
    weights, gradients and optimiser state alone (:func:`models.memory.model_state`) exceed
    ``memory_bytes`` per worker at the run's ZeRO stage: it could not take one step."""
    params, trainable = parameter_counts(model)
    stage = effective_zero_stage(train, workers)
    state = model_state(params, trainable, stage, workers, train.precision)
    if state.total > memory_bytes:
        raise ConfigError(
            f"the model does not fit {where}: its {params / 1e6:,.1f}M weights ({trainable / 1e6:,.1f}M trained) "
            f"need {state.total / 2**30:.2f} GiB per worker in {train.precision} at ZeRO stage {stage} across "
            f"{workers} worker(s) ({state.describe()} GiB) before any activation, and a worker has "
            f"{memory_bytes / 2**30:.2f} GiB: use ZeRO stage 3 (--train.zero_stage 3), more workers, bf16 "
            "(--train.precision bf16) or LoRA (--retriever.lora.rank)"
        )


def worker_memory(train: TrainConfig, device, workers_on_node: int) -> tuple[float, str]:
    """A worker's whole memory and its name in an error: ``--train.memory_gib`` when set."""
    if train.memory_gib:
        return train.memory_gib * 2**30, "--train.memory_gib"
    return total_memory(device, workers_on_node)


def build_engine(train: TrainConfig, task: TrainTask, deepspeed_settings: dict, workers: int, workers_on_node: int):
    """The task's model under DeepSpeed, with AdamW and the linear schedule: (engine,
    scheduler). A model whose state could not fit a worker fails here, before DeepSpeed
    places it."""
    # Named, DeepSpeed does not warn on every CPU worker that it found no GPU.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if train.use_gpu else "cpu")
    deepspeed = import_deepspeed(keep_mlflow="mlflow" in train.tracker)
    torch.set_num_threads(max(1, int(train.cpus_per_worker)))
    torch.manual_seed(train.seed)  # identical initialisation on every rank
    model = task.build_model()
    device = ray.train.torch.get_device() if train.use_gpu else torch.device("cpu")  # this worker's own GPU
    check_model_memory(model, train, workers, *worker_memory(train, device, workers_on_node))
    if train.compile:
        compile_in_place(model, blocks=True)  # before DeepSpeed wraps it: the engine calls the compiled blocks
    optimizer = torch.optim.AdamW(
        param_groups(model, train.weight_decay), lr=train.lr, eps=train.adam_eps, fused=train.use_gpu or None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(train.max_steps, train.warmup_ratio))
    skip_inference_comm_op()
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_settings
    )
    return engine, scheduler


def mixed_precision_state(engine, precision: str) -> dict[str, float]:
    """The global gradient norm of the last step (bf16, fp16) and fp16's loss scale: what
    tells a diverging low-precision run from a healthy one."""
    if precision == "fp32":
        return {}
    out = {}
    norm = engine.get_global_grad_norm()
    if norm is not None:
        out["grad_norm"] = float(norm)
    if precision == "fp16":
        scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None)
        if scale is not None:
            out["loss_scale"] = float(scale)
    return out


def export_model(task: TrainTask, engine, rank: int, destination: str) -> dict[str, str]:
    """Rank 0 exports the model with fp32 weights and uploads it; returns destination paths.

    Under ZeRO-3 each rank holds a slice of every parameter: every rank takes part in
    gathering the weights a layer at a time into rank 0's host memory (DeepSpeed's
    consolidated state dict), which loads them into a model of its own there. No device
    ever holds the whole model.
    """
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # a collective: every rank calls it
        if rank != 0:
            return {}
        module = task.build_model()
        module.load_state_dict(state)
    else:
        if rank != 0:
            return {}
        module = engine.module
    if any(p.dtype != torch.float32 for p in module.parameters()):
        module = copy.deepcopy(module).float()
    with tempfile.TemporaryDirectory(prefix="raydense-export-") as tmp:
        paths = task.export(module, tmp)
        storage.upload_dir(tmp, destination)
        uploaded = {
            k: storage.join(destination, os.path.relpath(v, tmp)) if v.startswith(tmp) else v for k, v in paths.items()
        }
    return uploaded | {"export_dir": destination}
