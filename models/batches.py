"""The streams' token-id arrays as the tensors a model reads: shared by every objective's
``make_batch``, so the pre-training methods and the group objectives frame rows alike."""

from __future__ import annotations

import numpy as np
import torch


def ids_and_mask(ids: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids as (rows, L) and their attention mask from the lengths. Leading dimensions
    are flattened in order (a group's passages, a span pair's two spans stay adjacent). The
    arrays are copied: Ray Data hands them out of the object store read-only."""
    tensor = torch.tensor(np.ascontiguousarray(ids), dtype=torch.long)
    tensor = tensor.reshape(-1, tensor.shape[-1])
    lengths = torch.tensor(np.asarray(lengths), dtype=torch.long).reshape(-1)
    return tensor, (torch.arange(tensor.shape[1])[None, :] < lengths[:, None]).long()
