"""Collectives that keep gradients: what a loss over the global batch needs across workers."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """All-gather ``(b_r, H)`` rows from every worker into ``(sum b_r, H)``.

    Worker r's rows sit at slot r of the *global* rank (the Condenser authors used the
    local rank, which breaks across nodes). The local slot is the local tensor itself, so
    gradients flow into this worker's rows; the other slots are constants. Workers may
    hold different numbers of rows (the last batch of a stream): sizes are exchanged
    first and the rows padded for the gather, two collectives per call.
    """
    world = world_size()
    if world == 1:
        return local
    rank = dist.get_rank()
    size = torch.tensor([local.shape[0]], dtype=torch.long, device=local.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    rows = [int(s) for s in sizes]
    padded = local.new_zeros((max(rows), *local.shape[1:]))
    padded[: local.shape[0]] = local.detach()
    slots = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(slots, padded)
    slots = [slot[:n] for slot, n in zip(slots, rows)]
    slots[rank] = local
    return torch.cat(slots)
