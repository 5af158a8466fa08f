"""The pre-training method interface: what the training loop needs of Condenser,
coCondenser, SimLM and plain MLM.

A method is built from its config and the masking vocabulary, on the worker. The loop
calls ``make_batch`` on the CPU for each streamed micro-batch, ``backward`` on the device,
and ``export`` once at the end; ``build`` wraps an unmodified HF ``BertForMaskedLM``, so
the exported backbone is a plain ``save_pretrained`` checkpoint.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn
from transformers import BertForMaskedLM

ExampleFormat = Literal["sequences", "span_pairs"]


@runtime_checkable
class PretrainingMethod(Protocol):
    name: str
    # What the stream yields: packed/truncated token sequences, or coCondenser's span pairs.
    example_format: ExampleFormat

    def build(self, mlm: BertForMaskedLM) -> nn.Module:
        """The trained module around ``mlm`` (head or decoder added, warm-started if configured)."""

    def make_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """The method's corruption of a (B, L) batch; reproducible from ``generator``."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, detached extras to log) of one micro-batch."""

    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and ``engine.backward`` of one micro-batch; returns (detached loss, extras)."""

    def export(self, model: nn.Module, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        """Write the backbone as a drop-in HF checkpoint (plus the method's own parts); returns paths."""


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


def plain_backward(
    method: PretrainingMethod, engine, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``backward`` for a method whose loss needs no gradient cache."""
    loss, extras = method.loss(engine, batch)
    engine.backward(loss)
    return loss.detach(), extras
