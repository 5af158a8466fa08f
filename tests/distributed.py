"""The tests' multi-process harness: workers spawned with a gloo process group (plain
torch.distributed, or DeepSpeed's), their results gathered, and the comparison of their
gradients with one process holding the whole batch.

Workers are spawned processes, so that no process group or DeepSpeed state outlives a
test. A worker is a module-level function ``fn(rank, world, out, *args)``; it runs inside
:func:`process_group` and writes what the test checks into ``out`` (a shared dict).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Callable

import torch
import torch.multiprocessing as mp

from pipeline.training.deepspeed_config import import_deepspeed, skip_inference_comm_op


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, world: int, *args, deepspeed: bool = False) -> dict:
    """Run ``fn(rank, world, out, *args)`` in ``world`` processes joined in one gloo group
    (initialised by DeepSpeed with ``deepspeed``); returns ``out`` as a plain dict."""
    out = mp.Manager().dict()
    mp.spawn(_in_group, args=(world, free_port(), deepspeed, fn, out, args), nprocs=world, join=True)
    return dict(out)


def _in_group(rank: int, world: int, port: int, deepspeed: bool, fn: Callable, out: dict, args: tuple) -> None:
    with process_group(rank, world, port, deepspeed):
        fn(rank, world, out, *args)


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int, deepspeed: bool):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    if deepspeed:
        skip_inference_comm_op()
        import_deepspeed().init_distributed(dist_backend="gloo")
    else:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def engine(model: torch.nn.Module, config: dict, optimizer: torch.optim.Optimizer | None = None):
    """``model`` under DeepSpeed with ``config`` (AdamW at lr 0 over its trainable
    parameters unless ``optimizer`` is given: a test compares one step's gradients)."""
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    built, *_ = import_deepspeed().initialize(model=model, optimizer=optimizer, config=config)
    return built


def plain_config(micro_batch_size: int, stage: int, precision: str) -> dict:
    """A DeepSpeed config with nothing but the micro-batch, the ZeRO stage and bf16 or fp32."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        # Every parameter partitioned at stage 3, however small (tiny test models' would all
        # stay whole under DeepSpeed's default threshold of 100,000 elements).
        "zero_optimization": {"stage": stage} | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
        "bf16": {"enabled": precision == "bf16"},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def full_gradients(built) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole gradient, in fp32, gathered under any ZeRO stage."""
    from deepspeed.utils import safe_get_full_grad

    return {
        name: safe_get_full_grad(p).float().clone() for name, p in built.module.named_parameters() if p.requires_grad
    }


def relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """|grads - reference| / |reference| over all parameters together."""
    assert set(grads) == set(reference)
    diff = torch.cat([(grads[k] - reference[k]).flatten() for k in reference])
    return float(diff.norm() / torch.cat([reference[k].flatten() for k in reference]).norm())
