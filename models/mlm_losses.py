"""Masked-LM losses through the backbone's own MLM projection (BERT's ``cls`` head, RoBERTa's
``lm_head``, ...: :func:`models.backbone.family`).

Only the labelled positions are projected: vocabulary-sized logits for every position
would dominate the step's memory and time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from models.backbone import family
from models.masking import IGNORE_INDEX


def _zero_through_the_head(mlm: PreTrainedModel, states: torch.Tensor) -> torch.Tensor:
    """A zero loss (a batch with nothing masked) whose graph still reaches every parameter
    of the MLM projection, so each gets a zero gradient, not none. Under ZeRO-2 a worker's
    gradient reduction covers the parameters whose gradients it produced: had one worker
    no gradient for the projection while another had one, their collectives would not
    match (gloo aborts on the size mismatch)."""
    return family(mlm).mlm_logits(mlm, states.reshape(-1, states.shape[-1])[:1]).float().sum() * 0.0


def masked_lm_loss(mlm: PreTrainedModel, states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over the labelled positions, projecting only those (vocab-sized logits are costly)."""
    picked = labels != IGNORE_INDEX
    if not picked.any():  # a batch with nothing masked contributes zero, not NaN
        return _zero_through_the_head(mlm, states)
    logits = family(mlm).mlm_logits(mlm, states[picked])
    return F.cross_entropy(logits.float(), labels[picked])


def sequence_mlm_losses(
    mlm: PreTrainedModel,
    states: torch.Tensor,
    labels: torch.Tensor,
    sequence_index: torch.Tensor | None = None,
    n_sequences: int | None = None,
) -> torch.Tensor:
    """Mean CE over each sequence's labelled positions (0 for a sequence with none): (B,),
    a row a sequence, or with ``sequence_index`` (each position's sequence, -1 for none; a
    packed batch) ``(n_sequences,)``.

    coCondenser averages its losses per span (paper eq. 7), which also makes the loss of
    a batch split into chunks or across workers a plain sum of per-span terms.
    """
    picked = labels != IGNORE_INDEX
    if sequence_index is None:
        n_sequences = labels.shape[0]
        sequence_index = torch.arange(n_sequences, device=labels.device)[:, None].expand_as(labels)
    elif n_sequences is None:
        raise ValueError("sequence_index needs n_sequences: the packed batch's sequence count")
    per_sequence = torch.zeros(n_sequences, dtype=torch.float32, device=states.device)
    if not picked.any():
        return per_sequence + _zero_through_the_head(mlm, states)
    logits = family(mlm).mlm_logits(mlm, states[picked])
    token_losses = F.cross_entropy(logits.float(), labels[picked], reduction="none")
    sequences = sequence_index[picked]
    counts = per_sequence.index_add(0, sequences, torch.ones_like(token_losses)).clamp(min=1)
    return per_sequence.index_add(0, sequences, token_losses) / counts
