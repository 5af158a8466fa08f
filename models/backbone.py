"""Loading, building and exporting the backbone every method wraps.

The backbone is an unmodified Hugging Face ``AutoModelForMaskedLM`` of a family with a
standard layer stack (BERT, RoBERTa / XLM-R, DeBERTa-v2/v3, ModernBERT): the methods add
their heads beside it, never inside it, so exporting is ``save_pretrained`` and the result
loads with ``AutoModel`` / ``AutoModelForMaskedLM`` as a drop-in checkpoint of its family.
Where a method needs the family's internals (its layer list, how a layer is called, the
embeddings, the MLM projection), it asks the family's :class:`Family` adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, BertConfig, BertForMaskedLM, PreTrainedModel
from transformers.activations import gelu
from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask
from transformers.utils import logging as hf_logging


@dataclass
class BackboneConfig:
    init: str = field(
        default="",
        metadata={
            "help": "HF checkpoint to start from (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME); empty = random init from the sizes below"
        },
    )
    hidden_size: int = field(default=128, metadata={"min": 1, "help": "random init only"})
    num_layers: int = field(default=4, metadata={"min": 1, "help": "random init only"})
    num_heads: int = field(default=4, metadata={"min": 1, "help": "random init only"})
    intermediate_size: int = field(default=512, metadata={"min": 1, "help": "random init only"})
    max_position: int = field(default=512, metadata={"min": 1, "help": "random init only"})
    dropout: float = field(
        default=0.1, metadata={"min": 0, "max": 1, "help": "hidden and attention dropout (random init only)"}
    )


class Family:
    """BERT's wiring, which RoBERTa and XLM-R share: ``encoder.layer``, layers called as
    ``layer(hidden, mask)`` with a 4-D additive mask, post-norm (no final norm)."""

    # Whether several sequences may share a row (models/packing.py): absolute positions
    # given per token and a 4-D mask passed through as it is.
    packs = True

    def base(self, mlm: PreTrainedModel) -> Any:  # each family's own base model class
        return mlm.base_model

    def layers(self, mlm: PreTrainedModel) -> nn.ModuleList:
        return self.base(mlm).encoder.layer

    def new_layer(self, mlm: PreTrainedModel) -> nn.Module:
        """A freshly initialised layer of the backbone's own kind (a Condenser head layer)."""
        return type(self.layers(mlm)[0])(mlm.config)

    def run_layers(self, mlm, layers, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``layers`` over ``hidden`` as the backbone runs its own, positions from 0."""
        mask = create_bidirectional_mask(config=mlm.config, inputs_embeds=hidden, attention_mask=attention_mask)
        for layer in layers:
            hidden = layer(hidden, mask)
        return hidden

    def embed(self, mlm, input_ids: torch.Tensor) -> torch.Tensor:
        return self.base(mlm).embeddings(input_ids=input_ids)

    def packed_positions(self, mlm, positions: torch.Tensor) -> torch.Tensor:
        """The ``position_ids`` of a packed batch whose sequences each count from 0."""
        if not self.packs:
            raise ValueError(f"{mlm.config.model_type}: packed sequences are not supported for this family")
        return positions

    def mlm_features(self, mlm, states: torch.Tensor) -> torch.Tensor:
        """The MLM head up to its vocabulary projection (``mlm.get_output_embeddings()``)."""
        return mlm.cls.predictions.transform(states)

    def mlm_logits(self, mlm, states: torch.Tensor, vocab_multiple: int | None = None) -> torch.Tensor:
        """The MLM head's logits of ``states`` (N, H) -> (N, vocab), as its forward gives
        them. The vocabulary projection runs padded to ``vocab_multiple`` rows (default:
        :data:`VOCAB_MULTIPLE` of the device)."""
        if vocab_multiple is None:
            vocab_multiple = VOCAB_MULTIPLE.get(states.device.type, 1)
        features, decoder = self.mlm_features(mlm, states), mlm.get_output_embeddings()
        if vocab_multiple > 1 and decoder.out_features % vocab_multiple:
            return padded_projection(features, decoder, vocab_multiple)
        return decoder(features)


# Vocabulary-wide matrix products run on the GPU's fast kernels only when each row of the
# logits starts 16-byte aligned: BERT's 30,522 columns of bf16 do not (61,044 bytes), and an
# H100 ran them on Ampere CUTLASS kernels at ~236 TFLOP/s against ~720 for the layers'
# products (bench/reports/2026-11-27-h100_condenser_512_held_profile.txt). 64 is what NVIDIA's BERT
# and GPT recipes pad to. A CPU gains nothing from it and would pay the padded copies.
VOCAB_MULTIPLE = {"cuda": 64}


def padded_projection(features: torch.Tensor, decoder: nn.Linear, multiple: int) -> torch.Tensor:
    """``decoder(features)`` computed on a vocabulary padded with zero rows to a multiple of
    ``multiple``, cut back to the real vocabulary (a view): the checkpoint keeps its own
    vocabulary, only the product's shape changes."""
    pad = -decoder.out_features % multiple
    weight = F.pad(decoder.weight, (0, 0, 0, pad))
    bias = None if decoder.bias is None else F.pad(decoder.bias, (0, pad))
    return F.linear(features, weight, bias)[:, : decoder.out_features]


class RobertaFamily(Family):
    def packed_positions(self, mlm, positions):
        # RoBERTa counts positions from padding_idx + 1, as its embeddings do themselves.
        return positions + mlm.config.pad_token_id + 1

    def mlm_features(self, mlm, states):
        head = mlm.lm_head  # RobertaLMHead.forward up to its decoder
        return head.layer_norm(gelu(head.dense(states)))


class DebertaV2Family(Family):
    """DeBERTa-v2/v3: layers take the relative positions and their embeddings."""

    packs = False  # its encoder builds its own mask from a 2-D one

    def run_layers(self, mlm, layers, hidden, attention_mask):
        encoder = self.base(mlm).encoder
        mask = encoder.get_attention_mask(attention_mask)
        relative_pos, rel_embeddings = encoder.get_rel_pos(hidden), encoder.get_rel_embedding()
        for layer in layers:
            hidden, _ = layer(hidden, mask, relative_pos=relative_pos, rel_embeddings=rel_embeddings)
        return hidden

    def mlm_logits(self, mlm, states, vocab_multiple=None):
        # Only the legacy head is BERT's: the other projects through the embeddings (its
        # get_output_embeddings() is a hidden-wide layer), and is never padded.
        if mlm.legacy:
            return super().mlm_logits(mlm, states, vocab_multiple)
        return mlm.lm_predictions(states, self.base(mlm).embeddings.word_embeddings)


class ModernBertFamily(Family):
    """ModernBERT: pre-norm layers with rotary positions, global or sliding-window
    attention per layer, and a final norm after the stack."""

    packs = False  # rotary positions and sliding windows per row, not per sequence

    def layers(self, mlm):
        return self.base(mlm).layers

    def new_layer(self, mlm):
        # Not index 0, whose attention input is not normed (it reads the normed embeddings):
        # a head layer reads residual-stream states. Global attention where the stack has it.
        types = mlm.config.layer_types
        index = next((i for i in range(1, len(types)) if types[i] == "full_attention"), min(1, len(types) - 1))
        return type(self.layers(mlm)[0])(mlm.config, index)

    def run_layers(self, mlm, layers, hidden, attention_mask):
        base = self.base(mlm)
        kwargs = {"config": mlm.config, "inputs_embeds": hidden, "attention_mask": attention_mask}
        masks = {
            "full_attention": create_bidirectional_mask(**kwargs),
            "sliding_attention": create_bidirectional_sliding_window_mask(**kwargs),
        }
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = {kind: base.rotary_emb(hidden, positions, kind) for kind in {layer.attention_type for layer in layers}}
        for layer in layers:
            hidden = layer(
                hidden, attention_mask=masks[layer.attention_type], position_embeddings=rotary[layer.attention_type]
            )
        return base.final_norm(hidden)

    def mlm_features(self, mlm, states):
        return mlm.head(states)


FAMILIES: dict[str, Family] = {
    "bert": Family(),
    "roberta": RobertaFamily(),
    "xlm-roberta": RobertaFamily(),
    "deberta-v2": DebertaV2Family(),
    "modernbert": ModernBertFamily(),
}


# Decoder LLMs a retriever may be trained from (not pre-trained: the methods are encoders').
# They read left to right, so only the last token has seen the whole text, and they are
# pooled there (RepLLaMA, E5-Mistral, gte-Qwen2).
DECODER_TYPES = ("llama", "mistral", "qwen2")
# Every family a checkpoint may be of: an encoder of FAMILIES, or a decoder.
SUPPORTED_TYPES = (*FAMILIES, *DECODER_TYPES)


def family(mlm_or_type) -> Family:
    """The adapter of a model (or a ``model_type``); a clear error for any other family."""
    model_type = mlm_or_type if isinstance(mlm_or_type, str) else mlm_or_type.config.model_type
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported: pre-training takes {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


# Weights a checkpoint may lack or carry beyond what the loaded class uses, as our own exports
# do: an encoder exported without its pooler, an MLM export read as an encoder (its head:
# BERT's cls, RoBERTa's lm_head, DeBERTa's lm_predictions, ModernBERT's head and decoder).
EXPECTED_MISSING = ("pooler.", "cls.predictions.decoder.bias", "classifier.")
EXPECTED_UNEXPECTED = ("cls.", "pooler.", "lm_head.", "lm_predictions.", "head.", "decoder.")  # MLM heads


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


class UnsupportedCheckpoint(ValueError):
    """A checkpoint raydense would load with random weights: its family is not supported,
    or its weights are not those of the model its ``config.json`` names."""


# transformers loads a checkpoint whose weights miss its config's model, initialising the
# rest at random with a warning: below this share of the model's weights, that is an error.
LEAST_LOADED_SHARE = 0.5


def check_checkpoint(path: str) -> None:
    """Raise :class:`UnsupportedCheckpoint` unless the HF folder ``path`` names a supported
    family and at least ``LEAST_LOADED_SHARE`` of that model's weights are stored there. A
    folder with a config and no weight files is an architecture (pre-training from scratch)
    and passes. Reads the weight files' headers only: the model is built on the meta device."""
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedCheckpoint(
            f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    stored = _stored_weight_names(path)
    if not stored:
        return
    try:
        with torch.device("meta"):
            model = AutoModel.from_config(AutoConfig.from_pretrained(path))
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build, whatever it raises
        raise UnsupportedCheckpoint(f"its config.json does not build a {model_type} model: {exc}") from None
    expected = [k for k in model.state_dict() if not k.startswith(EXPECTED_MISSING)]
    prefix = model.base_model_prefix + "."
    found = sum(k in stored or prefix + k in stored for k in expected)
    if found < LEAST_LOADED_SHARE * len(expected):
        raise UnsupportedCheckpoint(
            f"only {found} of the {len(expected)} weights of the {model_type} model its config.json names are "
            f"stored there: the weights are another model's (supported: {', '.join(SUPPORTED_TYPES)})"
        )


def _stored_weight_names(path: str) -> set[str]:
    names: set[str] = set()
    for name in os.listdir(path):
        file = os.path.join(path, name)
        if name.endswith(".safetensors"):
            with safe_open(file, framework="pt") as weights:
                names.update(weights.keys())
        elif name.startswith("pytorch_model") and name.endswith(".bin"):
            try:
                names.update(torch.load(file, map_location="meta", weights_only=True, mmap=True))
            except Exception:  # noqa: BLE001 - a legacy pickle mmap cannot open: transformers' load decides
                return set()
    return names


def build_mlm(cfg: BackboneConfig, vocab_size: int) -> PreTrainedModel:
    """An MLM of a supported family from a local checkpoint (or a folder holding only its
    ``config.json``: random init of that architecture), or a BERT initialised from ``cfg``.

    A checkpoint without an MLM head (e.g. a sentence-embedding MiniLM) gets a new
    randomly initialised head.
    """
    if cfg.init:
        if not os.path.isdir(cfg.init):
            raise FileNotFoundError(f"backbone init {cfg.init!r}: not a local checkpoint directory")
        config = AutoConfig.from_pretrained(cfg.init)
        family(config.model_type)
        if config.vocab_size < vocab_size:
            raise ValueError(
                f"backbone init {cfg.init!r} has vocab_size {config.vocab_size} but the corpus was tokenized "
                f"with a vocabulary of {vocab_size}: prepare the corpus with this checkpoint's tokenizer"
            )
        if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(cfg.init)):
            return AutoModelForMaskedLM.from_config(config)  # an architecture, not weights
        return load_pretrained(AutoModelForMaskedLM, cfg.init)
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


# A checkpoint larger than this is written as several safetensors files with an index, as the
# Hub's large models are: a 7B model in fp32 is six files, each uploaded and loaded alone.
EXPORT_SHARD_SIZE = "5GB"


def export_backbone(mlm: PreTrainedModel, out_dir: str, tokenizer_dir: str | None = None) -> str:
    """Save the backbone as a plain HF checkpoint (safetensors, in shards when large), with
    its tokenizer."""
    os.makedirs(out_dir, exist_ok=True)
    mlm.save_pretrained(out_dir, safe_serialization=True, max_shard_size=EXPORT_SHARD_SIZE)
    if tokenizer_dir:  # its tokenizer files only: a model folder given as one keeps its weights
        for name in os.listdir(tokenizer_dir):
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src) and not _is_model_file(name):
                shutil.copy2(src, os.path.join(out_dir, name))
    return out_dir


def _is_model_file(name: str) -> bool:
    return name in ("config.json", "generation_config.json") or name.endswith((".safetensors", ".bin", ".pt"))


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
