"""The bi-encoder retriever and its contrastive loss (DPR-style, as in all three papers).

A query is scored against every passage of the global batch: its own positive, its
hard negatives, the other queries' passages, and (under data parallelism) the passages
of every worker. Each query comes with a *group* of ``group_size`` passages, positive
first, so the target of global query j is passage ``j * group_size``.

The encoder is one unmodified HF ``BertModel`` (shared towers) or two (separate query
and passage towers), so export is ``save_pretrained``; ``retriever.json`` beside the
weights records pooling, similarity and temperature, so encoding needs no flags.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.cocondenser import gather_with_grad, world_size

SETTINGS_FILE = "retriever.json"


@dataclass
class BiEncoderConfig:
    pooling: Literal["cls", "mean"] = field(default="cls", metadata={"help": "CLS vector, or the mean of the non-padding token states"})
    similarity: Literal["dot", "cos"] = field(default="dot", metadata={"help": "dot product, or cosine divided by temperature"})
    temperature: float = field(default=1.0, metadata={"help": "scores are divided by this (SimLM uses cosine / 0.02)"})
    shared_encoder: bool = field(default=True, metadata={"help": "one encoder for queries and passages; false = separate towers"})
    group_size: int = field(default=8, metadata={"help": "passages per query: 1 positive + group_size-1 hard negatives"})


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    raise ValueError(f"pooling {pooling!r}: expected 'cls' or 'mean'")


class BiEncoder(nn.Module):
    """``encode_query`` / ``encode_passage`` / ``compute_similarity`` (Tevatron's hooks)."""

    def __init__(self, query_encoder: nn.Module, passage_encoder: nn.Module | None, cfg: BiEncoderConfig):
        super().__init__()
        if cfg.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {cfg.temperature}")
        self.cfg = cfg
        self.query_encoder = query_encoder
        # Shared towers are one module, registered once, so DeepSpeed sees each weight once.
        self.passage_encoder = None if cfg.shared_encoder else passage_encoder

    def _encode(self, encoder: nn.Module, input_ids, attention_mask) -> torch.Tensor:
        hidden = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        reps = pool(hidden, attention_mask, self.cfg.pooling)
        return F.normalize(reps, dim=-1) if self.cfg.similarity == "cos" else reps

    def encode_query(self, input_ids, attention_mask) -> torch.Tensor:
        return self._encode(self.query_encoder, input_ids, attention_mask)

    def encode_passage(self, input_ids, attention_mask) -> torch.Tensor:
        return self._encode(self.passage_encoder or self.query_encoder, input_ids, attention_mask)

    def compute_similarity(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        return (queries.float() @ passages.float().T) / self.cfg.temperature

    def forward(self, q_input_ids, q_attention_mask, d_input_ids, d_attention_mask):
        return self.encode_query(q_input_ids, q_attention_mask), self.encode_passage(d_input_ids, d_attention_mask)

    def save(self, out_dir: str, tokenizer_dir: str | None = None) -> dict[str, str]:
        """Shared: ``out_dir`` is the encoder. Separate: ``out_dir/query`` and ``out_dir/passage``."""
        from models.backbone import export_backbone

        towers = {"": self.query_encoder} if self.passage_encoder is None else {
            "query": self.query_encoder, "passage": self.passage_encoder}
        for sub, encoder in towers.items():
            export_backbone(encoder, os.path.join(out_dir, sub), tokenizer_dir)
        settings = {**asdict(self.cfg), "towers": sorted(t for t in towers if t)}
        with open(os.path.join(out_dir, SETTINGS_FILE), "w") as f:
            json.dump(settings, f, indent=2)
        return {"export_dir": out_dir}


def load_settings(export_dir: str) -> dict:
    """The pooling/similarity/temperature a retriever was trained with (``retriever.json``)."""
    path = os.path.join(export_dir, SETTINGS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{export_dir}: no {SETTINGS_FILE}; is this a raydense retriever export?")
    with open(path) as f:
        return json.load(f)


def contrastive_loss(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """-log softmax of each query's positive (passage ``i * group_size``) over all passages."""
    n_queries, n_passages = scores.shape
    if n_passages != n_queries * group_size:
        raise ValueError(f"{n_queries} queries need {n_queries * group_size} passages (group size "
                         f"{group_size}), got {n_passages}")
    targets = torch.arange(n_queries, device=scores.device) * group_size
    return F.cross_entropy(scores, targets)


def global_contrastive_loss(model: BiEncoder, local_queries: torch.Tensor, local_passages: torch.Tensor,
                            group_size: int) -> torch.Tensor:
    """The loss over every worker's queries and passages, scaled for data-parallel averaging.

    Both matrices are gathered, each worker's rows at its global rank's slot; a worker's
    gradient reaches only its own rows, and times the world size their average is the
    full-batch gradient (as in ``models.cocondenser.global_span_contrastive_loss``).
    """
    queries = gather_with_grad(local_queries.float())
    passages = gather_with_grad(local_passages.float())
    return contrastive_loss(model.compute_similarity(queries, passages), group_size) * world_size()
