"""What a batch's activations cost and what a worker has for them: micro-batches
(pipeline/training/worker.py) and the gradient cache's chunks (models/cocondenser.py) are
sized from the device, not from a fixed setting.

A cost is measured, not modelled: two forwards at two batch sizes, counting the bytes that
autograd keeps for the backward (:func:`saved_bytes`), fitted as ``fixed + per_item * n``.
Attention through SDPA keeps no (L, L) matrix, so the activations grow linearly in the
batch at a fixed width; the measuring batches are at full width, the worst case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import psutil
import torch

# The share of the free memory that a batch's saved activations may take: the backward's
# own transients (a layer's gradients at a time, the MLM logits) and the allocator's
# fragmentation need the rest.
ACTIVATION_SHARE = 0.5
# AdamW's two moments (fp32), and the gradient where it does not exist yet: bytes per
# trainable parameter that the first optimiser step may still allocate.
OPTIMIZER_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class ModelState:
    """Bytes per worker that training holds for the whole run beside the activations: the
    weights, their gradients and AdamW's state (two fp32 moments, and fp32 master weights
    under bf16 or fp16), each partitioned across the workers from the ZeRO stage that
    partitions it (ZeRO, Rajbhandari et al. 2020, section 5: optimiser state from stage 1,
    gradients from 2, weights at 3). The gradient cache adds its sums: an fp32 copy of the
    gradients at stages 0-2, the gradients held whole on the parameters at stage 3."""

    weights: float
    gradients: float
    optimizer: float
    grad_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.grad_cache

    def describe(self) -> str:
        parts = ("weights", "gradients", "optimizer", "grad_cache")
        return ", ".join(f"{name} {getattr(self, name) / 2**30:.2f}" for name in parts if getattr(self, name))


def model_state(
    params: int, trainable: int, stage: int, workers: int, precision: str, grad_cache: bool = False
) -> ModelState:
    """:class:`ModelState` of a model of ``params`` weights, ``trainable`` of them trained."""
    width = 4 if precision == "fp32" else 2
    master = 0 if precision == "fp32" else 4

    def shard(nbytes: float, from_stage: int) -> float:
        return nbytes / workers if stage >= from_stage else nbytes

    cache = (trainable * width if stage >= 3 else trainable * 4) if grad_cache else 0.0
    return ModelState(
        weights=shard(params * width, 3),
        gradients=shard(trainable * width, 2),
        optimizer=shard(trainable * (master + 8), 1),
        grad_cache=cache,
    )


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all weights, trainable weights) of a module, counted whole under ZeRO-3 too."""

    def size(p: torch.Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 partition's whole size

    return sum(size(p) for p in model.parameters()), sum(size(p) for p in model.parameters() if p.requires_grad)


def saved_bytes(forward: Callable[[], object], module: torch.nn.Module) -> int:
    """Bytes autograd keeps for the backward of ``forward()``, the module's own parameters
    aside: what one batch's activations hold between the forward and the backward. The
    output is dropped, so nothing is kept."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if hasattr(tensor, "ds_id"):  # a ZeRO-3 weight, gathered for this forward: not an activation
            return tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = forward()
    del out
    return sum(storages.values())


def free_memory(device, workers_on_node: int = 1) -> int:
    """Bytes a worker's activations may take: its GPU's free memory, with what torch's
    allocator holds unused, or on CPUs its share of the node's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return psutil.virtual_memory().available // max(1, workers_on_node)


def total_memory(device, workers_on_node: int = 1) -> tuple[int, str]:
    """A worker's whole memory, not what is free now, and what it is: its GPU's, or on CPUs
    its share of the node's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"a {torch.cuda.get_device_name(device)}"
    return psutil.virtual_memory().total // max(1, workers_on_node), "a CPU worker's share of its node's memory"


@dataclass(frozen=True)
class ActivationCost:
    """Bytes a batch of ``n`` items keeps for its backward: ``fixed + per_item * n``."""

    per_item: float
    fixed: float

    def bytes(self, items: int) -> float:
        return self.fixed + self.per_item * items


def measure_activations(activations: Callable[[int], int], items: int) -> ActivationCost:
    """The cost fitted from ``activations(items)`` and ``activations(2 * items)``, each the
    bytes a forward of that many items keeps (:func:`saved_bytes`)."""
    small, large = activations(items), activations(2 * items)
    per_item = max(1.0, (large - small) / items)
    return ActivationCost(per_item, max(0.0, small - items * per_item))


def fitting_micro_batch(cost: ActivationCost, budget: float, step_items: int) -> int:
    """The largest divisor of ``step_items`` (a worker's items per optimiser step) whose
    activations fit ``budget``: the step then takes the fewest equal micro-batches. One at
    least, even when a single item does not fit (the estimate is a worst case; the run
    may still fit)."""
    for micro in range(step_items, 0, -1):
        if step_items % micro == 0 and cost.bytes(micro) <= budget:
            return micro
    return 1
