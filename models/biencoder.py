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

import copy
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Literal, cast, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoTokenizer

from models.backbone import DECODER_TYPES, export_backbone, load_pretrained
from models.batches import ids_and_mask
from models.distributed import gather_with_grad, world_size
from models.framing import Framing
from models.grad_cache import engine_grad_cache_backward, fitting_chunk
from models.lora import LoraSettings, merged, with_lora
from models.memory import ACTIVATION_SHARE, measure_activations, saved_bytes
from models.objective import Objective

SETTINGS_FILE = "retriever.json"
ADAPTER_FOLDER = "adapter"  # LoRA adapters alone, beside the merged export, when asked
Pooling = Literal["cls", "mean", "last"]

ST_POOLING_FILE = os.path.join("1_Pooling", "config.json")  # a sentence-transformers model's pooling


def own_pooling(retriever_settings: dict | None, st_pooling: dict | None, model_type: str = "") -> Pooling:
    """What ``pooling: auto`` is for a checkpoint, from its optional files: the pooling its
    retriever was trained with (``retriever.json``), else its sentence-transformers pooling
    (``1_Pooling/config.json``: CLS, mean or last token), else the last token for a decoder
    and [CLS] for an encoder: the vector Condenser, coCondenser and SimLM train, and what a
    plain BERT has."""
    trained = (retriever_settings or {}).get("pooling")
    if trained in get_args(Pooling):
        return cast(Pooling, trained)
    st_pooling = st_pooling or {}
    if st_pooling.get("pooling_mode_mean_tokens") or st_pooling.get("pooling_mode") == "mean":
        return "mean"
    if st_pooling.get("pooling_mode_lasttoken") or st_pooling.get("pooling_mode") == "lasttoken":
        return "last"
    if st_pooling.get("pooling_mode_cls_token") or st_pooling.get("pooling_mode") == "cls":
        return "cls"
    return "last" if model_type in DECODER_TYPES else "cls"


def folder_pooling(folder: str) -> Pooling:
    """:func:`own_pooling` of a local checkpoint folder."""

    def read(name: str) -> dict | None:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    return own_pooling(read(SETTINGS_FILE), read(ST_POOLING_FILE), (read("config.json") or {}).get("model_type", ""))


@dataclass
class BiEncoderConfig:
    pooling: Literal["auto", "cls", "mean", "last"] = field(
        default="auto",
        metadata={
            "help": "cls: the [CLS] vector; mean: the mean of the non-padding token states; last: the last token's state, after the tokenizer's end-of-sequence token, appended if its template lacks it (decoders); auto = the starting checkpoint's own: its retriever.json, else its sentence-transformers pooling, else last for a decoder (Llama, Mistral, Qwen2) and cls for an encoder (how Condenser, coCondenser and SimLM train it)"
        },
    )
    similarity: Literal["dot", "cos"] = field(
        default="dot", metadata={"help": "dot product, or cosine divided by temperature"}
    )
    temperature: float = field(
        default=1.0, metadata={"above": 0, "help": "scores are divided by this (SimLM uses cosine / 0.02)"}
    )
    shared_encoder: bool = field(
        default=True, metadata={"help": "one encoder for queries and passages; false = separate towers"}
    )
    group_size: int = field(
        default=8, metadata={"min": 1, "help": "passages per query: 1 positive + group_size-1 hard negatives"}
    )
    chunk_size: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "gradient cache: sequences per forward chunk (queries and passages alike); 0 = sized from each worker's free memory when training starts: no cache if the micro-batch fits",
        },
    )
    # 4 by measurement (bench/bench_padding.py, MiniLM on Nave, 128 passages a batch, CPU):
    # steps/s 1.61x / 1.79x / 1.91x one bucket's with 2 / 4 / 8; 8 slices would be small for
    # a GPU's batches, and a GPU's step is host-bound at this size already.
    length_buckets: int = field(
        default=4,
        metadata={
            "min": 1,
            "help": "encode each batch as this many length-sorted slices, each padded only to its own longest sequence (same result, less padding)",
        },
    )
    query_prefix: str = field(
        default="",
        metadata={
            "help": "text put before every query, in training, encoding, mining and evaluation alike (E5: 'query: ')"
        },
    )
    passage_prefix: str = field(
        default="", metadata={"help": "text put before every passage, likewise (E5: 'passage: ')"}
    )
    lora: LoraSettings = field(default_factory=LoraSettings)  # adapters instead of full fine-tuning
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "keep only each layer's input for the backward and recompute the rest there (a decoder's activations at a fraction of the memory, for about a third more compute); the gradient cache then sizes its chunks from what is kept"
        },
    )

    def prefix(self, tower: str) -> str:
        return self.query_prefix if tower == "query" else self.passage_prefix


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """The sequence's vector, in fp32 whatever the encoder's precision: a mean over up to
    hundreds of bf16 states, then its norm, would lose digits the similarity keeps."""
    if pooling == "cls":
        return hidden[:, 0].float()
    if pooling == "mean":
        hidden = hidden.float()
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    if pooling == "last":  # each row's last unmasked position: padding on either side
        last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    raise ValueError(f"pooling {pooling!r}: expected 'cls', 'mean' or 'last'")


class BiEncoder(nn.Module):
    """``encode_query`` / ``encode_passage`` / ``compute_similarity`` (Tevatron's hooks)."""

    # HF encoders (with LoRA: peft wrappers of them), whose attributes differ per family.
    query_encoder: Any
    passage_encoder: Any

    def __init__(self, query_encoder: nn.Module, passage_encoder: nn.Module | None, cfg: BiEncoderConfig):
        super().__init__()
        check_settings(cfg)
        self.cfg = cfg
        self.query_encoder = query_encoder
        # Shared towers are one module, registered once, so DeepSpeed sees each weight once.
        self.passage_encoder = None if cfg.shared_encoder else passage_encoder

    def _encode(self, encoder: nn.Module, input_ids, attention_mask) -> torch.Tensor:
        buckets = self.cfg.length_buckets
        if buckets <= 1 or input_ids.shape[0] <= buckets:
            return self._encode_slice(encoder, input_ids, attention_mask)
        order = torch.argsort(attention_mask.sum(1), descending=True)
        reps = torch.cat(
            [self._encode_slice(encoder, input_ids[idx], attention_mask[idx]) for idx in order.chunk(buckets)]
        )
        return reps[torch.argsort(order)]  # back to the input order

    def _encode_slice(self, encoder: nn.Module, input_ids, attention_mask) -> torch.Tensor:
        # Padding columns no sequence uses change nothing but the cost: drop them (on the
        # right, or on the left of a left-padded batch).
        used = attention_mask.any(0).nonzero()
        start, end = (int(used[0]), int(used[-1]) + 1) if len(used) else (0, 1)
        # Contiguous: a compiled encoder (guarding on strides) would otherwise compile again.
        input_ids, attention_mask = (
            input_ids[:, start:end].contiguous(),
            attention_mask[:, start:end].contiguous(),
        )
        hidden = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        reps = pool(hidden, attention_mask, self.cfg.pooling)
        return F.normalize(reps, dim=-1) if self.cfg.similarity == "cos" else reps

    def encode_query(self, input_ids, attention_mask) -> torch.Tensor:
        return self._encode(self.query_encoder, input_ids, attention_mask)

    @property
    def passage_tower(self) -> nn.Module:
        """The encoder passages go through: the query's when the towers are shared."""
        return self.passage_encoder or self.query_encoder

    def encode_passage(self, input_ids, attention_mask) -> torch.Tensor:
        return self._encode(self.passage_tower, input_ids, attention_mask)

    def compute_similarity(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        return (queries.float() @ passages.float().T) / self.cfg.temperature

    def forward(self, q_input_ids, q_attention_mask, d_input_ids, d_attention_mask):
        return self.encode_query(q_input_ids, q_attention_mask), self.encode_passage(d_input_ids, d_attention_mask)

    def save(self, out_dir: str, tokenizer_dir: str | None = None, max_seq_length: int | None = None) -> dict[str, str]:
        """Shared: ``out_dir`` is the encoder, and a sentence-transformers model too.
        Separate: ``out_dir/query`` and ``out_dir/passage``. ``max_seq_length``: the passage
        length it was trained with, which sentence-transformers then truncates at."""

        towers = (
            {"": self.query_encoder}
            if self.passage_encoder is None
            else {"query": self.query_encoder, "passage": self.passage_encoder}
        )
        for sub, encoder in towers.items():  # LoRA adapters merged in: a plain HF encoder
            export_backbone(merged(encoder), os.path.join(out_dir, sub), tokenizer_dir)
            if self.cfg.lora.save_adapter and hasattr(encoder, "peft_config"):
                encoder.save_pretrained(os.path.join(out_dir, sub, ADAPTER_FOLDER))
            if tokenizer_dir and self.cfg.pooling == "last":  # its EOS in the saved template: loaders append it too
                tokenizer = AutoTokenizer.from_pretrained(os.path.join(out_dir, sub))
                Framing.of(tokenizer, last_token=True).save_as_template(tokenizer, os.path.join(out_dir, sub))
        settings = {**asdict(self.cfg), "towers": sorted(t for t in towers if t)}
        with open(os.path.join(out_dir, SETTINGS_FILE), "w") as f:
            json.dump(settings, f, indent=2)
        if self.passage_encoder is None:
            write_sentence_transformers_files(out_dir, self.cfg, self.query_encoder.config.hidden_size, max_seq_length)
        return {"export_dir": out_dir}


def write_sentence_transformers_files(
    out_dir: str, cfg: BiEncoderConfig, hidden_size: int, max_seq_length: int | None
) -> None:
    """What makes a shared-encoder export a sentence-transformers model as well (its module
    list, pooling, normalisation for cosine, max length and similarity), so that
    ``SentenceTransformer(out_dir)`` encodes as raydense does. The prefixes become its
    prompts (``encode_query`` / ``encode_document``). The temperature only scales scores in
    training, not embeddings."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if cfg.similarity == "cos":
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": cfg.pooling == "cls",
        "pooling_mode_mean_tokens": cfg.pooling == "mean",
        "pooling_mode_lasttoken": cfg.pooling == "last",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "include_prompt": True,  # raydense pools over the prefix's tokens too
    }
    files = {
        "modules.json": modules,
        "sentence_bert_config.json": {"do_lower_case": False}
        | ({"max_seq_length": max_seq_length} if max_seq_length else {}),
        "config_sentence_transformers.json": {
            "prompts": {
                name: prefix
                for name, prefix in (("query", cfg.query_prefix), ("document", cfg.passage_prefix))
                if prefix
            },
            "default_prompt_name": None,
            "similarity_fn_name": "cosine" if cfg.similarity == "cos" else "dot",
        },
        os.path.join("1_Pooling", "config.json"): pooling,
    }
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)


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
        raise ValueError(
            f"{n_queries} queries need {n_queries * group_size} passages (group size {group_size}), got {n_passages}"
        )
    targets = torch.arange(n_queries, device=scores.device) * group_size
    return F.cross_entropy(scores, targets)


def global_contrastive_loss(
    model: BiEncoder, local_queries: torch.Tensor, local_passages: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The loss over every worker's queries and passages, scaled for data-parallel averaging.

    Both matrices are gathered, each worker's rows at its global rank's slot; a worker's
    gradient reaches only its own rows, and times the world size their average is the
    full-batch gradient (as in ``models.cocondenser.global_span_contrastive_loss``).
    """
    queries = gather_with_grad(local_queries.float())
    passages = gather_with_grad(local_passages.float())
    return contrastive_loss(model.compute_similarity(queries, passages), group_size) * world_size()


def check_settings(cfg: BiEncoderConfig) -> None:
    if cfg.temperature <= 0:
        raise ValueError(f"temperature must be positive, got {cfg.temperature}")
    if cfg.pooling not in get_args(Pooling):
        raise ValueError(f"pooling {cfg.pooling!r}: resolve 'auto' from the checkpoint first (folder_pooling)")


@dataclass
class ExportShape:
    """What a retriever export encodes with and how wide, read from its settings and its
    towers' ``config.json`` without their weights (a driver's question)."""

    cfg: BiEncoderConfig
    query_width: int
    passage_width: int
    towers: dict[str, str]  # "query" and, for two towers, "passage": each one's folder


def export_shape(export_dir: str, overrides: dict | None = None) -> ExportShape:
    """``overrides`` (e.g. ``{"pooling": "mean"}``) replace saved settings. A plain HF
    checkpoint has the settings given in ``overrides`` (default: its sentence-transformers
    pooling, else CLS; dot)."""
    has_settings = os.path.isfile(os.path.join(export_dir, SETTINGS_FILE))
    settings = load_settings(export_dir) if has_settings else {}
    settings.pop("lora", None)  # how it was trained: its adapters are merged into the export
    known = {f for f in BiEncoderConfig.__dataclass_fields__}
    cfg = BiEncoderConfig(**{k: v for k, v in {**settings, **(overrides or {})}.items() if k in known})
    if cfg.pooling == "auto":
        cfg.pooling = folder_pooling(export_dir)
    check_settings(cfg)
    cfg.shared_encoder = not settings.get("towers")
    towers = (
        {"query": export_dir}
        if cfg.shared_encoder
        else {name: os.path.join(export_dir, name) for name in ("query", "passage")}
    )
    widths = {}
    for name, folder in towers.items():
        with open(os.path.join(folder, "config.json")) as f:
            widths[name] = int(json.load(f)["hidden_size"])
    return ExportShape(cfg, widths["query"], widths.get("passage", widths["query"]), towers)


def load_biencoder(export_dir: str, overrides: dict | None = None) -> BiEncoder:
    """A retriever export (``retriever.json`` + one or two HF encoders) ready to encode, with
    :func:`export_shape`'s settings. Any plain HF checkpoint also loads."""
    shape = export_shape(export_dir, overrides)
    encoders = {name: load_pretrained(AutoModel, folder).eval() for name, folder in shape.towers.items()}
    return BiEncoder(encoders["query"], encoders.get("passage"), shape.cfg)


def own_group_scores(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(b, b * group_size) scores of a batch's queries against its passages -> (b, group_size):
    each query against its own group, positive first."""
    n_queries = scores.shape[0]
    rows = torch.arange(n_queries, device=scores.device)
    return scores.view(n_queries, n_queries, group_size)[rows, rows]


def positive_top1(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """How often a query's positive tops the (b, b * group_size) scores of its batch's passages."""
    targets = torch.arange(scores.shape[0], device=scores.device) * group_size
    return (scores.argmax(1) == targets).float().mean()


CoupledLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def biencoder_backward(
    engine, batch: dict[str, torch.Tensor], coupled_loss: CoupledLoss, chunk_size: int = 0
) -> torch.Tensor:
    """One micro-batch's forward and ``engine.backward`` of ``coupled_loss(queries, passages)``.

    ``batch`` holds ``q_input_ids``/``q_attention_mask`` (b, Lq) and ``d_input_ids``/
    ``d_attention_mask`` (b * group_size, Ld), each query's group contiguous, positive
    first. ``coupled_loss`` sees this worker's query and passage representations in batch
    order and may gather across workers: it runs once per call, whatever the chunking.
    With ``chunk_size`` the encoders run through the gradient cache in chunks of that many
    sequences, with the exact gradient of the whole batch. Returns the detached loss.
    """
    q = batch["q_input_ids"], batch["q_attention_mask"]
    d = batch["d_input_ids"], batch["d_attention_mask"]
    n_queries = q[0].shape[0]
    if not chunk_size or chunk_size >= max(n_queries, d[0].shape[0]):
        queries, passages = engine(q[0], q[1], d[0], d[1])
        loss = coupled_loss(queries, passages)
        engine.backward(loss)
        return loss.detach()
    # Chunks of length-sorted sequences: each is padded only to its own longest.
    q_order = torch.argsort(q[1].sum(1), descending=True)
    d_order = torch.argsort(d[1].sum(1), descending=True)
    chunks = [{"tower": "q", "ids": q[0][idx], "mask": q[1][idx]} for idx in q_order.split(chunk_size)] + [
        {"tower": "d", "ids": d[0][idx], "mask": d[1][idx]} for idx in d_order.split(chunk_size)
    ]
    # The cached representations come in chunk order; the loss reads them in batch order.
    to_batch_order = torch.argsort(torch.cat([q_order, d_order + n_queries]))

    def encode(bare, chunk):
        encode_fn = bare.encode_query if chunk["tower"] == "q" else bare.encode_passage
        return encode_fn(chunk["ids"], chunk["mask"]), torch.zeros((), device=chunk["ids"].device)

    def coupled_in_batch_order(reps: torch.Tensor) -> torch.Tensor:
        reps = reps[to_batch_order.to(reps.device)]
        return coupled_loss(reps[:n_queries], reps[n_queries:])

    loss, _ = engine_grad_cache_backward(engine, chunks, encode, coupled_in_batch_order)
    return loss


def contrastive_backward(
    engine, batch: dict[str, torch.Tensor], group_size: int, chunk_size: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`biencoder_backward` of the global contrastive loss. Returns the true
    (unscaled) global loss and the in-batch top-1 accuracy."""
    module = getattr(engine, "module", engine)
    stats: dict[str, torch.Tensor] = {}

    def coupled(queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # logged only: how often the positive tops this worker's passages
            stats["accuracy"] = positive_top1(module.compute_similarity(queries, passages), group_size)
        return global_contrastive_loss(module, queries, passages, group_size)

    loss = biencoder_backward(engine, batch, coupled, chunk_size)
    return loss / world_size(), stats


class ContrastiveObjective(Objective[BiEncoder]):
    """The bi-encoder's training objective, in the shape every objective has (build,
    make_batch, backward, count_tokens, export): the contrastive loss over in-batch,
    cross-worker and hard negatives. Batches are the group stream's arrays: queries
    ``(b, Lq)`` and their groups ``(b, n, Ld)``, with lengths."""

    def __init__(self, cfg: BiEncoderConfig, passage_max_len: int | None = None, query_max_len: int | None = None):
        self.cfg, self.passage_max_len, self.query_max_len = cfg, passage_max_len, query_max_len
        self.chunk_size = cfg.chunk_size  # 0: no cache unless fit_chunk sizes one

    def fit_chunk(self, module: BiEncoder, available_bytes: float, micro_batch_size: int) -> int:
        """With ``chunk_size`` 0, the gradient cache's chunk (in sequences) for micro-batches
        of ``micro_batch_size`` queries and their groups, on ``module``'s device, given its
        free memory: 0 (no cache) when the micro-batch's activations fit in their share of
        it, else the most passages whose activations fit beside the cache's fp32 gradient
        sums. Queries and passages at full length are measured apart (models/memory.py)."""
        if self.cfg.chunk_size or not (self.passage_max_len and self.query_max_len):
            return self.chunk_size
        device = next(module.parameters()).device
        vocab = module.query_encoder.config.vocab_size
        rng = np.random.default_rng(0)

        def cost(encode, width: int):
            def activations(rows: int) -> int:
                ids = torch.tensor(rng.integers(0, vocab, (rows, width)), device=device)
                return saved_bytes(lambda: encode(ids, torch.ones_like(ids)), module)

            return measure_activations(activations, 4)

        queries, passages = (
            cost(module.encode_query, self.query_max_len),
            cost(module.encode_passage, self.passage_max_len),
        )
        budget = available_bytes * ACTIVATION_SHARE
        n_passages = micro_batch_size * self.cfg.group_size
        if queries.bytes(micro_batch_size) + passages.bytes(n_passages) <= budget:
            self.chunk_size = 0
        else:  # the cache runs: its fp32 gradient sums take their place too
            sums = 4 * sum(p.numel() for p in module.parameters() if p.requires_grad)
            # 0 where every passage fits beside the sums: one chunk of all, which is no cache
            self.chunk_size = fitting_chunk(passages.per_item, passages.fixed + sums, budget, n_passages)
        return self.chunk_size

    def build(self, init_dir: str) -> BiEncoder:
        if self.cfg.pooling == "auto":  # the driver resolves it; a worker built alone does too
            self.cfg = replace(self.cfg, pooling=folder_pooling(init_dir))
        encoder = load_pretrained(AutoModel, init_dir)
        pooler = getattr(encoder, "pooler", None)
        if pooler is not None:  # unused by CLS/mean pooling: frozen, so no worker waits on its gradient
            pooler.requires_grad_(False)
        if self.cfg.gradient_checkpointing:  # non-reentrant: the gradient cache takes gradients with autograd.grad
            encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.cfg.lora.rank:  # frozen embeddings: the checkpointed layers' input must still want a gradient
                encoder.enable_input_require_grads()
        passage = None if self.cfg.shared_encoder else copy.deepcopy(encoder)
        if self.cfg.lora.rank:
            encoder = with_lora(encoder, self.cfg.lora)
            passage = passage if passage is None else with_lora(passage, self.cfg.lora)
        return BiEncoder(encoder, passage, self.cfg)

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        q_ids, q_mask = ids_and_mask(batch["q_input_ids"], batch["q_length"])
        d_ids, d_mask = ids_and_mask(batch["d_input_ids"], batch["d_length"])  # (b*n, L), groups contiguous
        return {"q_input_ids": q_ids, "q_attention_mask": q_mask, "d_input_ids": d_ids, "d_attention_mask": d_mask}

    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return contrastive_backward(engine, batch, self.cfg.group_size, self.chunk_size)

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
        return int(np.asarray(batch["q_length"]).sum() + np.asarray(batch["d_length"]).sum())

    def export(self, model: BiEncoder, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        return model.save(out_dir, tokenizer_dir, self.passage_max_len)
