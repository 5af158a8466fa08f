"""Loading, building and exporting the BERT backbone every method wraps.

The backbone is always an unmodified Hugging Face ``BertForMaskedLM``: the methods add
their heads beside it, never inside it, so exporting is ``save_pretrained`` and the
result loads with ``AutoModel`` / ``AutoModelForMaskedLM`` as a drop-in BERT.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForMaskedLM, BertConfig, BertForMaskedLM
from transformers.utils import logging as hf_logging


@dataclass
class BackboneConfig:
    init: str = field(
        default="",
        metadata={
            "help": "HF checkpoint to start from (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME); empty = random init from the sizes below"
        },
    )
    hidden_size: int = field(default=128, metadata={"help": "random init only"})
    num_layers: int = field(default=4, metadata={"help": "random init only"})
    num_heads: int = field(default=4, metadata={"help": "random init only"})
    intermediate_size: int = field(default=512, metadata={"help": "random init only"})
    max_position: int = field(default=512, metadata={"help": "random init only"})
    dropout: float = field(default=0.1, metadata={"help": "hidden and attention dropout (random init only)"})


# Weights a checkpoint may lack or carry beyond what the loaded class uses, as our own exports
# do: an encoder exported without its pooler, an MLM export read as an encoder (its head).
EXPECTED_MISSING = ("pooler.", "cls.predictions.decoder.bias", "classifier.")
EXPECTED_UNEXPECTED = ("cls.", "pooler.", "lm_head.")


def load_pretrained(model_class, path: str, **kwargs):
    """``model_class.from_pretrained(path)`` from safetensors when the folder has them,
    without transformers' multi-line load report: the weights a BERT export is expected to
    lack or carry beyond the class (pooler, MLM head) pass silently, anything else is named
    in one warning line."""
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = model_class.from_pretrained(
            path, use_safetensors=has_safetensors(path), output_loading_info=True, **kwargs
        )
    finally:
        hf_logging.set_verbosity(previous)
    missing = [k for k in info.get("missing_keys", []) if not k.startswith(EXPECTED_MISSING)]
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith(EXPECTED_UNEXPECTED)]
    for what, keys in (
        ("not in the checkpoint, initialised at random", missing),
        ("in the checkpoint, unused", unexpected),
    ):
        if keys:
            shown = ", ".join(sorted(keys)[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")
            warnings.warn(f"{path}: {len(keys)} weights {what}: {shown}", stacklevel=2)
    return model


def build_mlm(cfg: BackboneConfig, vocab_size: int) -> BertForMaskedLM:
    """A BERT MLM from a local checkpoint, or freshly initialised from ``cfg``.

    A checkpoint without an MLM head (e.g. a sentence-embedding MiniLM) gets a new
    randomly initialised ``cls`` head; transformers logs which weights were new.
    """
    if cfg.init:
        if not os.path.isdir(cfg.init):
            raise FileNotFoundError(f"backbone init {cfg.init!r}: not a local checkpoint directory")
        config = AutoConfig.from_pretrained(cfg.init)
        if config.model_type != "bert":
            raise ValueError(
                f"backbone init {cfg.init!r}: model_type {config.model_type!r}, expected a BERT checkpoint"
            )
        if config.vocab_size != vocab_size:
            raise ValueError(
                f"backbone init {cfg.init!r} has vocab_size {config.vocab_size} but the corpus was tokenized "
                f"with a vocabulary of {vocab_size}: prepare the corpus with this checkpoint's tokenizer"
            )
        model = load_pretrained(AutoModelForMaskedLM, cfg.init)
        if not isinstance(model, BertForMaskedLM):
            raise ValueError(f"backbone init {cfg.init!r}: loaded {type(model).__name__}, expected BertForMaskedLM")
        return model
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position,
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
    )
    return BertForMaskedLM(config)


def has_safetensors(path: str) -> bool:
    return any(name.endswith(".safetensors") for name in os.listdir(path))


def export_backbone(mlm: BertForMaskedLM, out_dir: str, tokenizer_dir: str | None = None) -> str:
    """Save the backbone as a plain HF checkpoint (safetensors), with its tokenizer."""
    os.makedirs(out_dir, exist_ok=True)
    mlm.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(out_dir, name))
    return out_dir


def save_module(module: torch.nn.Module, path: str, meta: dict) -> str:
    """Save an auxiliary module (head, decoder) as safetensors plus a JSON of its settings."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(state, path, metadata={"raydense": json.dumps(meta)})
    return path


def load_module_state(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Weights and settings saved by :func:`save_module` (safetensors: no pickle)."""

    with safe_open(path, framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("raydense", "{}"))
    return load_file(path), meta
