"""The streams' token-id arrays as the tensors a model reads: shared by every objective's
``make_batch``, so the pre-training methods and the group objectives frame rows alike."""

from __future__ import annotations

import numpy as np
import torch

# Rows are cut to a multiple of this: tensor-core shapes on GPUs, and few distinct shapes
# for compiled models.
LENGTH_MULTIPLE = 8


def ids_and_mask(ids: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids as (rows, L) and their attention mask from the lengths. Leading dimensions
    are flattened in order (a group's passages, a span pair's two spans stay adjacent). The
    streams frame rows at the configured max length; L is the batch's longest row instead
    (rounded up to ``LENGTH_MULTIPLE``), so no layer computes on columns that are padding
    in every row: coCondenser's 80-token spans framed at 128, or a batch of short passages.
    The arrays are copied: Ray Data hands them out of the object store read-only."""
    ids = np.asarray(ids)
    row_lengths = torch.tensor(np.asarray(lengths), dtype=torch.long).reshape(-1)
    width = ids.shape[-1]
    longest = int(row_lengths.max()) if len(row_lengths) else 0
    used = min(width, -(-max(longest, 1) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)
    tensor = torch.tensor(np.ascontiguousarray(ids[..., :used]), dtype=torch.long)
    tensor = tensor.reshape(-1, used)
    return tensor, (torch.arange(used)[None, :] < row_lengths[:, None]).long()


def to_device(batch: dict, device, non_blocking: bool = False) -> dict:
    """A made batch on ``device``: its tensors moved, its other values (a packed batch's
    ``chunks``) as they are."""
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
