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


def saved_bytes(forward: Callable[[], object], module: torch.nn.Module) -> int:
    """Bytes autograd keeps for the backward of ``forward()``, the module's own parameters
    aside: what one batch's activations hold between the forward and the backward. The
    output is dropped, so nothing is kept."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
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
