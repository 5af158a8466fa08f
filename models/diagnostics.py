"""Pure measures of an encoder's [CLS]: how its attention spreads, and how alike its vectors are.

The Condenser paper (Figure 2) reads the [CLS] attention entropy per layer: a pre-trained
bottleneck concentrates it. An MLM-trained encoder's [CLS] vectors are nearly collinear;
a bottleneck objective spreads them apart. ``jobs/analyze.py`` runs both over checkpoints.
"""

from __future__ import annotations

import torch


def cls_entropy(attentions: tuple[torch.Tensor, ...], attention_mask: torch.Tensor) -> torch.Tensor:
    """Entropy of the [CLS] query's attention over real keys, from a forward pass's
    ``attentions`` (one per layer): (batch, layers, heads), float64."""
    rows = torch.stack([att[:, :, 0, :] for att in attentions], dim=1).double()  # (B, L, H, T)
    real = attention_mask.bool()[:, None, None, :]
    # Padding keys get ~0 weight anyway; leaving them out makes that exact. xlogy(0, 0) = 0.
    return torch.where(real, -torch.xlogy(rows, rows), 0.0).sum(-1)


def pairwise_cosine(vectors: torch.Tensor, bins: int = 40) -> dict:
    """Cosine similarity of every pair of distinct rows: its mean, spread and histogram.

    An MLM-trained encoder's [CLS] vectors are nearly collinear (mean near 1): the vector
    says little about its passage. A bottleneck objective spreads them apart.
    """
    unit = torch.nn.functional.normalize(vectors.double(), dim=1)
    upper = torch.triu_indices(len(unit), len(unit), offset=1)
    cos = (unit @ unit.T)[upper[0], upper[1]]
    counts = torch.histc(cos, bins=bins, min=-1.0, max=1.0)
    return {
        "mean": cos.mean().item(),
        "std": cos.std(correction=0).item(),
        "pairs": len(cos),
        "histogram": {"edges": torch.linspace(-1, 1, bins + 1).tolist(), "counts": counts.long().tolist()},
    }
