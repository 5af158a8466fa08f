"""The pre-training method interface: what the training loop needs of Condenser,
coCondenser, SimLM and plain MLM.

A method has the shape every training objective has (the contrastive, listwise and
distillation objectives too): ``build``, ``make_batch`` (the stream's arrays to tensors, on
the CPU), ``backward`` (on the device), ``count_tokens`` and ``export``. A method is built
from its config and the masking vocabulary, on the worker; ``build`` wraps an unmodified HF
``AutoModelForMaskedLM`` (models/backbone.py), so the exported backbone is a plain ``save_pretrained`` checkpoint.
What a method adds is its corruption of a (B, L) batch (``corrupt_batch``) and its ``loss``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from models.batches import ids_and_mask, to_device
from models.masking import MaskingVocab, whole_word_mask
from models.memory import ActivationCost, measure_activations, saved_bytes
from models.objective import ModelT, Objective

ExampleFormat = Literal["sequences", "span_pairs"]


class PretrainingMethod(Objective[ModelT]):
    name: str
    # What the stream yields: packed/truncated token sequences, or coCondenser's span pairs.
    example_format: ExampleFormat
    vocab: MaskingVocab  # set by each method

    def build(self, mlm: PreTrainedModel) -> ModelT:
        """The trained module around ``mlm`` (head or decoder added, warm-started if configured)."""
        raise NotImplementedError

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A streamed micro-batch (``input_ids`` and ``length``; span pairs as (b, 2, L),
        flattened to (2b, L) with partners adjacent), corrupted by the method."""
        input_ids, attention_mask = ids_and_mask(batch["input_ids"], batch["length"])
        return self.corrupt_batch(input_ids, attention_mask, generator)

    def corrupt_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """The method's corruption of a (B, L) batch; reproducible from ``generator``."""
        raise NotImplementedError

    def loss(self, model: ModelT, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, detached extras to log) of one micro-batch."""
        raise NotImplementedError

    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and ``engine.backward`` of one micro-batch; returns (detached loss, extras).
        A method whose loss needs a gradient cache overrides it."""
        loss, extras = self.loss(engine, batch)
        engine.backward(loss)
        return loss.detach(), extras

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
        return int(np.asarray(batch["length"]).sum())

    def activation_cost(self, model: ModelT, width: int = 0) -> ActivationCost | None:
        """What a micro-batch keeps for its backward, per sequence of ``width`` tokens,
        measured on ``model``'s device (models/memory.py): what sizes micro-batches from
        memory. None for a loss that couples a micro-batch's sequences (coCondenser's
        in-batch negatives): splitting its batch would change the loss."""
        device = next(model.parameters()).device
        tokens = self.vocab.replacement_ids.numpy()
        rng = np.random.default_rng(0)

        def activations(rows: int) -> int:
            arrays = {
                "input_ids": rng.choice(tokens, (rows, width)).astype(np.int32),
                "length": np.full(rows, width, np.int32),
            }
            batch = to_device(self.make_batch(arrays, torch.Generator().manual_seed(0)), device)
            return saved_bytes(lambda: self.loss(model, batch)[0], model)

        return measure_activations(activations, 2)

    def export(self, model: ModelT, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        """Write the backbone as a drop-in HF checkpoint (plus the method's own parts); returns paths."""
        raise NotImplementedError


class WholeWordMaskingMethod(PretrainingMethod[ModelT]):
    """Base of the methods whose batches are whole-word-masked MLM inputs (Condenser,
    coCondenser, plain MLM): ``cfg.mlm_probability`` of the words, BERT's 80/10/10."""

    def __init__(self, cfg, vocab: MaskingVocab):
        self.cfg = cfg
        self.vocab = vocab

    def corrupt_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        masked, labels = whole_word_mask(input_ids, self.vocab, generator, self.cfg.mlm_probability)
        return {"input_ids": masked, "attention_mask": attention_mask, "labels": labels}


class PlainEngine:
    """The surface of a DeepSpeed engine that the methods' ``backward`` uses, over a plain
    module in one process (benchmarks, notebooks): forward, ``backward``, no ZeRO, no fp16."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_optimization_stage(self) -> int:
        return 0

    def fp16_enabled(self) -> bool:
        return False
