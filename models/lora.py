"""LoRA adapters on an encoder or a decoder (``peft``), merged into plain weights at export.

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
    alpha: float = field(default=16.0, metadata={"min": 0, "help": "LoRA scale: the update is B A * alpha / rank"})
    dropout: float = field(default=0.0, metadata={"min": 0, "max": 1, "help": "dropout on the adapters' input"})
    targets: list[str] = field(
        default_factory=list,
        metadata={
            "help": "names of the linear layers adapted inside each transformer layer; empty = the family's attention and MLP projections (BERT: query, key, value, dense; Llama, Mistral, Qwen2: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
        },
    )

    save_adapter: bool = field(
        default=False,
        metadata={
            "help": "also save the adapters alone, as peft's adapter folder (<export>/adapter: PeftModel.from_pretrained over the initial checkpoint loads it); the export itself is always merged"
        },
    )

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0, got {self.rank}")


# Each family's attention and MLP projections: what LoRA adapts unless told otherwise.
FAMILY_TARGETS = {
    "bert": ["query", "key", "value", "dense"],
    "roberta": ["query", "key", "value", "dense"],
    "xlm-roberta": ["query", "key", "value", "dense"],
    "deberta-v2": ["query_proj", "key_proj", "value_proj", "dense"],
    "modernbert": ["Wqkv", "Wo", "Wi"],
    **dict.fromkeys(
        ("llama", "mistral", "qwen2"), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
}


def lora_targets(settings: LoraSettings, model_type: str) -> list[str]:
    if settings.targets:
        return settings.targets
    if model_type not in FAMILY_TARGETS:
        raise ValueError(f"lora.targets: name the linear layers to adapt in a {model_type} model")
    return FAMILY_TARGETS[model_type]


def target_pattern(targets: list[str]) -> str:
    """The modules of the layer stack whose last name is a target (``encoder.layer.3.attention
    .self.query``), never one outside it: a pooler that no loss reaches would leave
    adapters without gradients, which data-parallel training waits on forever."""
    names = "|".join(re.escape(t) for t in targets)
    return rf"(.*\.)?layers?\.\d+\.(.*\.)?({names})"


def with_lora(encoder: Any, settings: LoraSettings) -> nn.Module:
    """``encoder`` with trainable adapters on its targets and every other weight frozen."""
    from peft import LoraConfig, get_peft_model  # the lora extra; only when asked for

    targets = lora_targets(settings, encoder.config.model_type)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft annotates int; it scales by any number
        lora_dropout=settings.dropout,
        target_modules=target_pattern(targets),
    )
    adapted = get_peft_model(encoder, config)
    if not any(p.requires_grad for p in adapted.parameters()):
        raise ValueError(f"lora.targets {targets}: no linear layer of the encoder has these names")
    return adapted


def merged(encoder: Any) -> Any:
    """A plain encoder equal to ``encoder`` with its adapters merged in (a copy: training
    may go on with the adapters); ``encoder`` itself when it has none."""
    if not hasattr(encoder, "merge_and_unload"):
        return encoder
    return copy.deepcopy(encoder).merge_and_unload()
