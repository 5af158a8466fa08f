"""The cross-encoder re-ranker (SimLM's stage 3) and its listwise loss.

A query and a passage are read together as ``[CLS] q [SEP] d [SEP]`` (token types 0 for
``[CLS] q [SEP]``, 1 for ``d [SEP]``) by an unmodified HF
``AutoModelForSequenceClassification`` with one label, whose logit is the relevance score.
Export is ``save_pretrained``, so the result also loads in sentence-transformers'
``CrossEncoder`` and HF pipelines; ``reranker.json`` beside the weights records the
lengths it was trained with, so scoring needs no flags.

Each training query comes with a group of n passages, positive first; the loss is the
cross-entropy of the positive against its own group's n scores. There are no cross-worker
negatives: a pair's score depends on that pair alone, so each worker's local mean loss,
averaged by DeepSpeed over equal worker batches, has the full-batch gradient.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from models.backbone import load_pretrained
from models.batches import to_device
from models.memory import ActivationCost, measure_activations, saved_bytes
from models.objective import Objective

SETTINGS_FILE = "reranker.json"


@dataclass
class RerankerConfig:
    group_size: int = field(
        default=8,
        metadata={"min": 1, "help": "passages per query: 1 positive + group_size-1 negatives (SimLM uses more)"},
    )
    max_len: int = field(
        default=192,
        metadata={
            "min": 4,
            "help": "tokens of a (query, passage) pair, [CLS] and both [SEP] included; the passage is cut first",
        },
    )


@dataclass
class PairLengths:
    """How a pair is cut: the query to ``query_max_len`` and the passage to
    ``passage_max_len`` tokens (each counting its own [CLS]/[SEP]), then the pair to
    ``max_len`` by cutting the passage's tail (HF's ``truncation="only_second"``)."""

    query_max_len: int = 32
    passage_max_len: int = 160
    max_len: int = 192

    @classmethod
    def from_dict(cls, saved: dict) -> "PairLengths":
        """From a ``reranker.json``; keys this version does not know are ignored."""
        return cls(**{k: v for k, v in saved.items() if k in cls.__dataclass_fields__})

    def check(self) -> None:
        if min(self.query_max_len, self.passage_max_len) < 3:
            raise ValueError(f"query_max_len and passage_max_len must be >= 3, got {self}")
        if self.max_len < self.query_max_len + 2:
            raise ValueError(
                f"max_len {self.max_len} leaves no room for a passage after a query of up to "
                f"{self.query_max_len} tokens: it must be at least query_max_len + 2"
            )


def pair_inputs(
    q_ids: torch.Tensor,
    q_lengths: torch.Tensor,
    d_ids: torch.Tensor,
    d_lengths: torch.Tensor,
    max_len: int,
    sep_id: int,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """``[CLS] q [SEP] d [SEP]`` rows from framed queries and passages, one pair per row.

    ``q_ids`` (P, Lq) and ``d_ids`` (P, Ld) are ``[CLS] ids [SEP]`` + padding with lengths
    ``q_lengths`` / ``d_lengths``; the passage's own [CLS] is dropped. A pair longer than
    ``max_len`` loses the passage's tail and keeps its final [SEP]. The width is the longest
    pair's, so no column is all padding. Returns ``input_ids``, ``attention_mask`` and
    ``token_type_ids`` (P, width), built by gathers, without a loop over rows.
    """
    lq, ld = q_lengths.long().reshape(-1), d_lengths.long().reshape(-1)
    total = torch.clamp(lq + ld - 1, max=max_len)
    if bool((total < lq + 1).any()):
        raise ValueError(f"max_len {max_len} cuts into a query: it must exceed the longest query")
    width = int(total.max()) if total.numel() else 1
    pos = torch.arange(width, device=q_ids.device)[None, :]
    in_query = pos < lq[:, None]
    from_query = q_ids.long().gather(1, pos.clamp(max=q_ids.shape[1] - 1).expand(len(lq), -1))
    from_passage = d_ids.long().gather(1, (pos - lq[:, None] + 1).clamp(0, d_ids.shape[1] - 1))
    ids = torch.where(in_query, from_query, from_passage)
    ids = torch.where(pos == (total - 1)[:, None], torch.full_like(ids, sep_id), ids)
    valid = pos < total[:, None]
    ids = torch.where(valid, ids, torch.full_like(ids, pad_id))
    return {"input_ids": ids, "attention_mask": valid.long(), "token_type_ids": (valid & ~in_query).long()}


class CrossEncoder(nn.Module):
    """One relevance logit per (query, passage) row; ``model`` is an HF sequence classifier
    with ``num_labels == 1``, kept unmodified so export is ``save_pretrained``."""

    def __init__(self, model: PreTrainedModel, lengths: PairLengths | None = None):
        super().__init__()
        if getattr(model.config, "num_labels", None) != 1:
            raise ValueError(f"a re-ranker needs one output label, the checkpoint has {model.config.num_labels}")
        self.model = model
        self.lengths = lengths or PairLengths()
        # A model without a second token type (RoBERTa-style) reads the pair by position only.
        self.uses_token_types = getattr(model.config, "type_vocab_size", 0) >= 2

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        kwargs = {"token_type_ids": token_type_ids} if self.uses_token_types and token_type_ids is not None else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits[:, 0]

    def save(self, out_dir: str, tokenizer_dir: str | None = None) -> dict[str, str]:
        """``save_pretrained`` (safetensors) with the tokenizer and ``reranker.json``."""
        os.makedirs(out_dir, exist_ok=True)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        if tokenizer_dir:  # saved, not copied: the folder may also hold another model's weights
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
        with open(os.path.join(out_dir, SETTINGS_FILE), "w") as f:
            json.dump(asdict(self.lengths), f, indent=2)
        return {"export_dir": out_dir}


def listwise_loss(scores: torch.Tensor) -> torch.Tensor:
    """Mean over queries of ``-log softmax(scores[i])[0]``: (b, n) scores, positive first."""
    targets = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    return F.cross_entropy(scores.float(), targets)


def listwise_backward(
    engine, batch: dict[str, torch.Tensor], group_size: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's forward and ``engine.backward`` of the listwise loss.

    ``batch`` holds ``input_ids`` / ``attention_mask`` / ``token_type_ids`` of b * group_size
    pairs, each query's group contiguous and positive first. Returns the local loss and the
    share of queries whose positive scores strictly above all its negatives.
    """
    scores = engine(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).view(-1, group_size)
    loss = listwise_loss(scores)
    engine.backward(loss)
    with torch.no_grad():  # logged only
        best_negative = scores[:, 1:].max(1).values if group_size > 1 else torch.full_like(scores[:, 0], -math.inf)
        accuracy = (scores[:, 0] > best_negative).float().mean()
    return loss.detach(), {"accuracy": accuracy}


def check_max_len(config, max_len: int, name: str) -> None:
    """A pair of ``max_len`` tokens must fit the model's position embeddings."""
    positions = getattr(config, "max_position_embeddings", max_len)
    if max_len > positions:
        raise ValueError(f"{name}: max_len {max_len} exceeds the model's {positions} positions")


def build_reranker(init: str, lengths: PairLengths | None = None) -> CrossEncoder:
    """A re-ranker from any local HF checkpoint: a BERT encoder gets a fresh one-logit head
    (transformers logs which weights are new); a one-label classifier is used as it is."""

    config = AutoConfig.from_pretrained(init)
    if lengths is not None:
        check_max_len(config, lengths.max_len, init)
    classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if classifier and config.num_labels != 1:
        raise ValueError(f"{init} is a classifier with {config.num_labels} labels; a re-ranker needs one")
    model = load_pretrained(AutoModelForSequenceClassification, init, num_labels=1)
    return CrossEncoder(model, lengths)


def load_settings(export_dir: str) -> PairLengths | None:
    """The lengths a re-ranker was trained with (``reranker.json``), or None for a plain checkpoint."""
    path = os.path.join(export_dir, SETTINGS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return PairLengths.from_dict(json.load(f))


def load_reranker(export_dir: str) -> CrossEncoder:
    """A re-ranker export (or any one-label HF sequence classifier) in eval mode, with the
    lengths of its ``reranker.json`` (defaults for a plain checkpoint)."""

    if not os.path.isfile(os.path.join(export_dir, "config.json")):
        raise FileNotFoundError(f"{export_dir}: no config.json; is this a re-ranker export?")
    model = load_pretrained(AutoModelForSequenceClassification, export_dir)
    return CrossEncoder(model, load_settings(export_dir)).eval()


class ListwiseObjective(Objective[CrossEncoder]):
    """The cross-encoder's training objective, in the shape every objective has: each query
    with its group of passages as ``[CLS] q [SEP] d [SEP]`` pairs, cut as ``lengths`` says,
    and the listwise loss over the group (positive first)."""

    def __init__(self, group_size: int, lengths: PairLengths, sep_id: int, pad_id: int):
        self.group_size, self.lengths, self.sep_id, self.pad_id = group_size, lengths, sep_id, pad_id

    def build(self, init_dir: str) -> CrossEncoder:
        return build_reranker(init_dir, self.lengths)

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        q_ids = torch.tensor(np.ascontiguousarray(batch["q_input_ids"]), dtype=torch.long)  # (b, Lq)
        d_ids = torch.tensor(np.ascontiguousarray(batch["d_input_ids"]), dtype=torch.long)  # (b, n, Ld)
        b, n = d_ids.shape[:2]
        q_len = torch.tensor(np.asarray(batch["q_length"]), dtype=torch.long).reshape(-1)
        d_len = torch.tensor(np.asarray(batch["d_length"]), dtype=torch.long).reshape(-1)
        # Row i * n + j is query i with its j-th passage: groups contiguous, positive first.
        return pair_inputs(
            q_ids.repeat_interleave(n, 0),
            q_len.repeat_interleave(n),
            d_ids.reshape(b * n, -1),
            d_len,
            self.lengths.max_len,
            self.sep_id,
            self.pad_id,
        )

    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return listwise_backward(engine, batch, self.group_size)

    def activation_cost(self, model: CrossEncoder, width: int = 0) -> ActivationCost:
        """What a micro-batch keeps for its backward per query: its group of pairs, each at
        full length (models/memory.py). A query's loss reads its own group only, so its
        micro-batches may be split."""
        device = next(model.parameters()).device
        rng = np.random.default_rng(0)
        vocab = model.model.config.vocab_size
        lq, ld = self.lengths.query_max_len, self.lengths.passage_max_len

        def activations(queries: int) -> int:
            arrays = {
                "q_input_ids": rng.integers(0, vocab, (queries, lq)),
                "q_length": np.full(queries, lq),
                "d_input_ids": rng.integers(0, vocab, (queries, self.group_size, ld)),
                "d_length": np.full((queries, self.group_size), ld),
            }
            batch = to_device(self.make_batch(arrays, torch.Generator()), device)

            def loss() -> torch.Tensor:
                scores = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
                return listwise_loss(scores.view(-1, self.group_size))

            return saved_bytes(loss, model)

        return measure_activations(activations, 2)

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
        q_len = np.asarray(batch["q_length"]).reshape(-1, 1).astype(np.int64)
        d_len = np.asarray(batch["d_length"]).reshape(len(q_len), -1).astype(np.int64)
        return int(np.minimum(q_len + d_len - 1, self.lengths.max_len).sum())

    def export(self, model: CrossEncoder, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        return model.save(out_dir, tokenizer_dir)
