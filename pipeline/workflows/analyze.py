"""The CLS attention-entropy diagnostic (Condenser paper, Figure 2).

For layer l, head h and passage p, take the attention distribution of the [CLS] query
(row 0) over the passage's real (non-padding) keys, ``a = attentions[l][p, h, 0, :len_p]``,
and its entropy ``H = -sum a log a`` (natural log, 0 log 0 = 0). A layer's number is the
mean of H over heads and passages. High entropy: [CLS] attends broadly over the passage;
low entropy: it attends to a few tokens (typically [CLS]/[SEP] themselves). Uniform
attention over ``len_p`` tokens scores ``log len_p``, the largest possible value.

Every checkpoint sees the same passages, each tokenized with the checkpoint's own tokenizer.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import AutoModel

from models.backbone import load_pretrained
from models.diagnostics import cls_entropy, pairwise_cosine
from pipeline.core import model_ref, storage
from pipeline.core.config import Renamed
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.plots import plot_cls_cosine, plot_cls_entropy
from pipeline.core.sample import SAMPLE_CORPUS
from pipeline.core.sections import Output
from pipeline.data.corpus import iter_documents
from pipeline.data.tokenizer import BERT_SPECIALS, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


@dataclass
class AnalyzeConfig(Output.with_defaults(output="runs/analyze", notes={"output": "entropy.json and cls_entropy.png"})):
    RENAMED: ClassVar[dict] = {"max_len": Renamed("passage_max_len")}

    checkpoints: list[str] = field(
        default_factory=list,
        metadata={
            "help": "HF checkpoint dirs or s3:// prefixes, each with its tokenizer (at least one; comma-separated)"
        },
    )
    labels: list[str] = field(
        default_factory=list,
        metadata={"help": "display names, one per checkpoint; empty = each checkpoint's folder name"},
    )
    passages: str = field(
        default=SAMPLE_CORPUS,
        metadata={"help": "corpus (file or folder, local or s3://) in any format pipeline.data.corpus reads"},
    )
    num_passages: int = field(default=256, metadata={"min": 1, "help": "how many passages to average over"})
    seed: int | None = field(
        default=0,
        metadata={
            "min": 0,
            "help": "seed of a uniform random sample of the passages (reads the whole corpus); none = the first num_passages",
        },
    )
    passage_max_len: int = field(
        default=128,
        metadata={"min": 0, "help": "tokens per passage, [CLS] and [SEP] included; longer passages are truncated"},
    )
    batch_size: int = field(
        default=32, metadata={"help": "passages per forward pass (padding does not change the result)"}
    )
    device: str = field(default="auto", metadata={"help": "torch device; auto = cuda if available, else cpu"})

    def __post_init__(self):
        if not self.checkpoints:
            raise ConfigError("give at least one checkpoint (--checkpoints DIR[,DIR...])")
        if self.labels and len(self.labels) != len(self.checkpoints):
            raise ConfigError(
                f"{len(self.labels)} labels for {len(self.checkpoints)} checkpoints: "
                "give one label per checkpoint, or none"
            )
        if len(set(self.display_labels)) != len(self.checkpoints):
            raise ConfigError(f"labels must be distinct, got {self.display_labels}: set --labels")
        for name in ("num_passages", "passage_max_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def display_labels(self) -> list[str]:
        return self.labels or [c.rstrip("/").rsplit("/", 1)[-1] for c in self.checkpoints]


def load_passages(uri: str, n: int, seed: int | None = 0) -> list[str]:
    """``n`` passage texts: a seeded uniform sample (reservoir; kept in corpus order), or the
    first ``n`` when ``seed`` is None. Fewer if the corpus is smaller."""
    docs = iter_documents(uri)
    if seed is None:
        return [doc.text for _, doc in zip(range(n), docs)]
    rng, sample = random.Random(seed), []
    for i, doc in enumerate(docs):
        if i < n:
            sample.append((i, doc.text))
        elif (j := rng.randrange(i + 1)) < n:
            sample[j] = (i, doc.text)
    return [text for _, text in sorted(sample)]


def load_checkpoint(path: str, device: str = "cpu"):
    """(model, tokenizer) from a local HF checkpoint dir: eager attention (the fused kernels do
    not return attention weights), float32, eval mode."""

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"checkpoint {path!r} is not a Hugging Face checkpoint (no config.json)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ConfigError(
            f"checkpoint {path!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); export "
            "it with its tokenizer, e.g. models.backbone.export_backbone(..., tokenizer_dir=...)"
        )
    tokenizer = load_tokenizer(path, BERT_SPECIALS)
    tokenizer.padding_side = "right"  # [CLS] must stay at position 0
    model = load_pretrained(AutoModel, path, attn_implementation="eager").float().eval().to(device)
    return model, tokenizer


@torch.no_grad()
def measure(model, tokenizer, texts: list[str], max_len: int = 128, batch_size: int = 32) -> dict:
    """Per-layer statistics of :func:`cls_entropy` over ``texts`` (the numbers in entropy.json)."""
    limit = getattr(model.config, "max_position_embeddings", max_len)
    if max_len > limit:
        raise ConfigError(f"--passage_max_len {max_len} exceeds the model's {limit} positions")
    device = next(model.parameters()).device
    entropies, lengths, cls_vectors = [], [], []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(
            texts[start : start + batch_size], padding=True, truncation=True, max_length=max_len, return_tensors="pt"
        )
        if not (enc["input_ids"][:, 0] == tokenizer.cls_token_id).all():
            raise ValueError("the tokenizer does not put [CLS] first")
        mask = enc["attention_mask"].to(device)
        out = model(input_ids=enc["input_ids"].to(device), attention_mask=mask, output_attentions=True)
        entropies.append(cls_entropy(out.attentions, mask).cpu())
        cls_vectors.append(out.last_hidden_state[:, 0].double().cpu())
        lengths.append(enc["attention_mask"].sum(1))
    ent, length = torch.cat(entropies), torch.cat(lengths).double()  # (P, L, H), (P,)
    per_passage = ent.mean(2)  # (P, L): averaged over heads
    layers = [
        {
            "layer": layer + 1,
            "mean": per_passage[:, layer].mean().item(),
            "std": per_passage[:, layer].std(correction=0).item(),
            "heads": ent[:, layer].mean(0).tolist(),
        }
        for layer in range(ent.shape[1])
    ]
    return {
        "num_passages": len(texts),
        "num_layers": ent.shape[1],
        "num_heads": ent.shape[2],
        "mean_length": length.mean().item(),
        "log_mean_length": math.log(length.mean().item()),
        "uniform_entropy": length.log().mean().item(),
        "layers": layers,
        "cls_cosine": pairwise_cosine(torch.cat(cls_vectors)),
    }


def run_analysis(cfg: AnalyzeConfig) -> dict:
    """Measure every checkpoint on the same passages; write entropy.json and cls_entropy.png."""
    # All of them before any model is loaded: fail in seconds.
    cfg.checkpoints = [model_ref.check(uri, "checkpoint") for uri in cfg.checkpoints]
    texts = load_passages(cfg.passages, cfg.num_passages, cfg.seed)
    if not texts:
        raise InputError(f"{cfg.passages}: no passages")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for uri, label in zip(cfg.checkpoints, cfg.display_labels):
        model, tokenizer = load_checkpoint(model_ref.materialize(uri, "checkpoint"), device)
        results.append(
            {"label": label, "path": uri, **measure(model, tokenizer, texts, cfg.passage_max_len, cfg.batch_size)}
        )
        del model  # free it before the next one loads
    files = {
        "json": storage.join(cfg.output, "entropy.json"),
        "plot": storage.join(cfg.output, "cls_entropy.png"),
        "cosine_plot": storage.join(cfg.output, "cls_cosine.png"),
    }
    storage.write_json(
        files["json"],
        {"passages": cfg.passages, "seed": cfg.seed, "passage_max_len": cfg.passage_max_len, "checkpoints": results},
    )
    plot_cls_entropy(results, files["plot"])
    plot_cls_cosine(results, files["cosine_plot"])
    return {
        "output": cfg.output,
        "files": files,
        "num_passages": len(texts),
        "entropy": {r["label"]: [layer["mean"] for layer in r["layers"]] for r in results},
        "cls_cosine": {r["label"]: r["cls_cosine"]["mean"] for r in results},
    }
