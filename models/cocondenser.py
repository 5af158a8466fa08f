"""coCondenser (Gao & Callan, 2022): Condenser plus a corpus-level span-pair contrastive loss.

Each document contributes two random spans; a span's positive is its partner and every
other span of the *global* batch is a negative. Similarity is the raw dot product of
last-layer CLS vectors: no normalisation, no temperature.

This module holds the loss and the cross-worker gather; the span sampling and the
trainer integration (with the gradient cache of ``models/grad_cache.py``) come with
the rest of the method.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """All-gather ``(b, H)`` rows from every worker into ``(world * b, H)``.

    Worker r's rows sit at slot r of the *global* rank (the Condenser authors used the
    local rank, which breaks across nodes). The local slot is the local tensor itself, so
    gradients flow into this worker's rows; the other slots are constants. Every worker
    must pass the same ``b``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    world, rank = dist.get_world_size(), dist.get_rank()
    slots = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(slots, local.detach().contiguous())
    slots[rank] = local
    return torch.cat(slots)


def partner_targets(n_spans: int, device=None) -> torch.Tensor:
    """Span 2i's target is 2i+1 and vice versa: ``arange(2n).view(-1, 2).flip(1)``."""
    if n_spans % 2:
        raise ValueError(f"span pairs: got an odd number of spans ({n_spans})")
    return torch.arange(n_spans, device=device).view(-1, 2).flip(1).reshape(-1)


def span_contrastive_loss(cls_vectors: torch.Tensor) -> torch.Tensor:
    """Mean over the 2n spans of -log softmax(partner), a span's own score masked out.

    ``cls_vectors`` is (2n, H) with the two spans of a document adjacent (rows 2i, 2i+1).
    """
    scores = (cls_vectors @ cls_vectors.T).float()
    self_mask = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    scores = scores.masked_fill(self_mask, float("-inf"))
    return F.cross_entropy(scores, partner_targets(scores.shape[0], scores.device))


def global_span_contrastive_loss(local_cls: torch.Tensor) -> torch.Tensor:
    """The contrastive loss over the global batch, scaled for data-parallel averaging.

    Each worker computes the same global loss, but its gradient reaches only its own
    rows. Summed over workers, those are exactly the full-batch gradient; the trainer's
    all-reduce *averages* them, so the loss is scaled by the world size here.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return span_contrastive_loss(gather_with_grad(local_cls)) * world
