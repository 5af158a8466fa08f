"""LoRA adapters on an encoder (``peft``), merged into plain weights at export.

Only the adapters train; the encoder's own weights stay frozen, so the optimiser holds a
small fraction of the state full fine-tuning does. The export merges the adapters in
(``W + B A * alpha / r``), so what leaves raydense is an ordinary HF encoder that loads
with ``AutoModel`` and in sentence-transformers, without peft.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class LoraSettings:
    rank: int = field(default=0, metadata={"help": "LoRA rank r; 0 = full fine-tuning (needs the lora extra: peft)"})
    alpha: float = field(default=16.0, metadata={"help": "LoRA scale: the update is B A * alpha / rank"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the adapters' input"})
    targets: list[str] = field(
        default_factory=lambda: ["query", "key", "value", "dense"],
        metadata={
            "help": "names of the linear layers adapted inside each transformer layer (BERT: query, key, value, dense)"
        },
    )

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0, got {self.rank}")
        if self.rank and not self.targets:
            raise ValueError("lora.targets is empty: name the linear layers to adapt")


def target_pattern(targets: list[str]) -> str:
    """The modules of the layer stack whose last name is a target (``encoder.layer.3.attention
    .self.query``), never one outside it: a pooler that no loss reaches would leave
    adapters without gradients, which data-parallel training waits on forever."""
    names = "|".join(re.escape(t) for t in targets)
    return rf"(.*\.)?layers?\.\d+\.(.*\.)?({names})"


def with_lora(encoder: nn.Module, settings: LoraSettings) -> nn.Module:
    """``encoder`` with trainable adapters on its targets and every other weight frozen."""
    from peft import LoraConfig, get_peft_model  # the lora extra; only when asked for

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft annotates int; it scales by any number
        lora_dropout=settings.dropout,
        target_modules=target_pattern(settings.targets),
    )
    adapted = get_peft_model(encoder, config)
    if not any(p.requires_grad for p in adapted.parameters()):
        raise ValueError(f"lora.targets {settings.targets}: no linear layer of the encoder has these names")
    return adapted


def merged(encoder: Any) -> Any:
    """A plain encoder equal to ``encoder`` with its adapters merged in (a copy: training
    may go on with the adapters); ``encoder`` itself when it has none."""
    if not hasattr(encoder, "merge_and_unload"):
        return encoder
    return copy.deepcopy(encoder).merge_and_unload()
