"""The shape every training objective has, which the training loop calls.

Pre-training methods (:mod:`models.method`), the retriever's contrastive and distillation
objectives (:mod:`models.biencoder`, :mod:`models.distillation`) and the re-ranker's
listwise one (:mod:`models.reranker`) are built on the worker from picklable settings and
give the loop: the model (``build``), a micro-batch's tensors from the stream's arrays
(``make_batch``, on the CPU), its loss and ``engine.backward`` (``backward``, on the device),
the tokens it trained on and the export. Two parts only some have, with defaults here:
a gradient cache sized from memory (``fit_chunk``) and the activation cost that sizes
micro-batches from memory (``activation_cost``).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import nn

from models.memory import ActivationCost

ModelT = TypeVar("ModelT", bound=nn.Module)  # what an objective builds: Condenser, BiEncoder, ...


class Objective(Generic[ModelT]):
    def build(self, source: Any) -> ModelT:
        """The model, from its starting point (a masked LM, or a checkpoint folder)."""
        raise NotImplementedError

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and ``engine.backward`` for one micro-batch; returns (loss to log, extras)."""
        raise NotImplementedError

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
        raise NotImplementedError

    def export(self, model: ModelT, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        raise NotImplementedError

    def fit_chunk(self, module: ModelT, available_bytes: float, micro_batch_size: int) -> int | None:
        """The gradient cache's chunk for this much free memory (0: no cache needed), or None
        for an objective without a gradient cache."""
        return None

    def activation_cost(self, model: ModelT, width: int = 0) -> ActivationCost | None:
        """What a micro-batch keeps for its backward per row (rows of ``width`` tokens where
        the rows are the stream's), measured on ``model``'s device; None where a loss
        couples a micro-batch's rows (in-batch negatives), which must then not be split."""
        return None
