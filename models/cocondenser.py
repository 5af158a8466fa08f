"""coCondenser (Gao & Callan, 2022): Condenser plus a corpus-level span-pair contrastive loss.

Each document contributes two random spans (:func:`draw_span_pairs`, re-drawn every
epoch by the stream); a span's positive is its partner and every other span of the
*global* batch is a negative. Similarity is the raw dot product of last-layer CLS
vectors: no normalisation, no temperature. The total is (head MLM + late MLM +
contrastive) averaged over the 2n spans (paper eq. 7).

With ``chunk_size`` set, a step runs through the gradient cache of
``models/grad_cache.py``, so the span batch can be far larger than memory allows.

Spans are short and of every length (capped at half their document, or drawn short), so a
micro-batch's spans are packed several to a row (models/packing.py) rather than each padded
to the longest: the losses are those of the padded batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from models.backbone import family
from models.batches import LENGTH_MULTIPLE, to_device
from models.condenser import Condenser, CondenserConfig, CondenserMethod
from models.distributed import gather_with_grad, world_size
from models.grad_cache import engine_grad_cache_backward, fitting_chunk
from models.memory import ACTIVATION_SHARE, measure_activations, saved_bytes
from models.packing import chunk_of, pack

DEFAULT_PACK_WIDTH = 128


def partner_targets(n_spans: int, device=None) -> torch.Tensor:
    """Span 2i's target is 2i+1 and vice versa: ``arange(2n).view(-1, 2).flip(1)``."""
    if n_spans % 2:
        raise ValueError(f"span pairs: got an odd number of spans ({n_spans})")
    return torch.arange(n_spans, device=device).view(-1, 2).flip(1).reshape(-1)


def span_contrastive_loss(cls_vectors: torch.Tensor) -> torch.Tensor:
    """Mean over the 2n spans of -log softmax(partner), a span's own score masked out.

    ``cls_vectors`` is (2n, H) with the two spans of a document adjacent (rows 2i, 2i+1).
    """
    scores = (cls_vectors @ cls_vectors.T).float()
    self_mask = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    scores = scores.masked_fill(self_mask, float("-inf"))
    return F.cross_entropy(scores, partner_targets(scores.shape[0], scores.device))


def global_span_contrastive_loss(local_cls: torch.Tensor) -> torch.Tensor:
    """The contrastive loss over the global batch, scaled for data-parallel averaging.

    Each worker computes the same global loss, but its gradient reaches only its own
    rows. Summed over workers, those are exactly the full-batch gradient; the trainer's
    all-reduce *averages* them, so the loss is scaled by the world size here.
    """
    # fp32 for the gather (gloo has no bf16 collectives) and for the softmax.
    return span_contrastive_loss(gather_with_grad(local_cls.float())) * world_size()


# -- span pairs -------------------------------------------------------------------------


@dataclass
class CoCondenserConfig(CondenserConfig):
    head: str = field(
        default="auto",
        metadata={
            "help": "Condenser head to warm-start from (safetensors); 'auto' = condenser_head.safetensors beside --model.init when present, '' = a fresh head"
        },
    )
    span_length: int = field(default=80, metadata={"min": 1, "help": "tokens per span (without [CLS]/[SEP])"})
    short_span_prob: float = field(
        default=0.1,
        metadata={
            "min": 0,
            "max": 1,
            "help": "chance that a pair's spans are shorter: uniform in [min_span_length, span_length)",
        },
    )
    min_span_length: int = field(
        default=16,
        metadata={
            "min": 1,
            "help": "shortest span; documents under 2x this many tokens hold no pair and are skipped (counted)",
        },
    )
    chunk_size: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "gradient cache: spans per forward chunk; 0 = as many as the device's free memory holds, measured at start-up (no cache when the whole micro-batch fits)",
        },
    )
    pack_spans: bool = field(
        default=True,
        metadata={
            "help": "pack spans several to a row, each attending only to itself (BERT, RoBERTa; other families pad each span to the batch's longest)"
        },
    )
    pack_width: int = field(
        default=0,
        metadata={
            "help": "tokens per packed row; 0 = 128, or the longest span's frame (span_length + 2, rounded up to 8) where wider"
        },
    )

    def __post_init__(self):
        if self.pack_width and self.pack_width < self.span_length + 2:
            raise ValueError(
                f"cocondenser.pack_width {self.pack_width} is narrower than a span's frame "
                f"(span_length {self.span_length} + [CLS] and [SEP])"
            )

    @property
    def packed_row_width(self) -> int:
        """Tokens per packed row, 0 without packing."""
        if not self.pack_spans:
            return 0
        # 128 by measurement (bench_padding.py: 88, 128 and 256 wide, 128 the fastest).
        return self.pack_width or max(
            DEFAULT_PACK_WIDTH, -(-(self.span_length + 2) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        )


# -- the method -------------------------------------------------------------------------


class CoCondenserMethod(CondenserMethod):
    """coCondenser pre-training: Condenser MLM losses + span-pair contrastive loss.

    A micro-batch holds ``b`` documents as (b, 2, L) span pairs; the task flattens them
    to (2b, L) with partners adjacent, as :func:`partner_targets` expects.
    """

    name = "cocondenser"
    example_format = "span_pairs"

    def __init__(self, cfg, vocab):
        super().__init__(cfg, vocab)
        self.pack_width = cfg.packed_row_width
        self.chunk_size = cfg.chunk_size  # 0: no cache until fit_chunk sizes one

    def activation_cost(self, model, width: int = 0) -> None:
        return None  # in-batch negatives: the gradient cache, sized by fit_chunk, splits the batch instead

    def fit_chunk(self, module, available_bytes: float, micro_batch_size: int) -> int:
        """With ``chunk_size`` 0, the gradient cache's chunk (in spans) for micro-batches of
        ``micro_batch_size`` pairs on ``module``'s device, given its free memory: 0 (no
        cache) when the whole micro-batch's activations fit in their share of it, else the
        largest chunk that does beside the cache's fp32 gradient sums. The activations of full-length spans,
        laid out as batches are, are measured by two forwards (4 and 8 pairs): a worst
        case, as real batches hold shorter spans too."""
        if self.cfg.chunk_size:
            return self.chunk_size
        device = next(module.parameters()).device
        rng = np.random.default_rng(0)
        tokens = self.vocab.replacement_ids.numpy()

        def activations(spans: int) -> int:
            width, pairs = self.cfg.span_length + 2, spans // 2
            arrays = {
                "input_ids": rng.choice(tokens, (pairs, 2, width)).astype(np.int32),
                "length": np.full((pairs, 2), width, np.int32),
            }
            batch = to_device(self.make_batch(arrays, torch.Generator().manual_seed(0)), device)
            return saved_bytes(lambda: self._losses(module, batch, spans), module)

        cost = measure_activations(activations, 8)
        budget, n_spans = available_bytes * ACTIVATION_SHARE, 2 * micro_batch_size
        self.chunk_size = fitting_chunk(cost.per_item, cost.fixed, budget, n_spans)
        if self.chunk_size:  # the cache runs: its fp32 gradient sums take their place too
            sums = 4 * sum(p.numel() for p in module.parameters() if p.requires_grad)
            self.chunk_size = fitting_chunk(cost.per_item, cost.fixed + sums, budget, n_spans)
        return self.chunk_size

    def build(self, mlm) -> Condenser:
        if self.pack_width and not family(mlm).packs:
            warnings.warn(
                f"cocondenser.pack_spans: {mlm.config.model_type} cannot pack sequences; "
                "each span is padded to its batch's longest instead",
                stacklevel=2,
            )
            self.pack_width = 0
        model = Condenser(mlm, self.cfg.n_head_layers, self.cfg.skip_from)
        if self.cfg.head and self.cfg.head != "auto":
            model.load_head(self.cfg.head)
        return model

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict:
        """The span pairs (2b, L), masked, then packed into rows when packing is on."""
        tensors = super().make_batch(batch, generator)
        if not self.pack_width:
            return tensors
        lengths = tensors.pop("attention_mask").sum(dim=1)
        return pack(tensors, lengths, self.pack_width, self.chunk_size)

    @staticmethod
    def _n_spans(batch: dict) -> int:
        return batch["cls_index"].shape[0] if "cls_index" in batch else batch["input_ids"].shape[0]

    def _losses(self, model, batch: dict, n_local: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(late CLS, summed per-span MLM share of this chunk, detached parts)."""
        inputs = {k: v for k, v in batch.items() if k != "chunks"}
        out = model(**inputs, per_sequence=True)
        local = out.loss / n_local
        parts = {
            "head_mlm_loss": out.head_mlm_loss.detach().sum() / n_local,
            "late_mlm_loss": out.late_mlm_loss.detach().sum() / n_local,
        }
        return out.late_cls, local, parts

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to back-propagate on this worker. Its contrastive term is the global
        loss times the world size (see :func:`global_span_contrastive_loss`); the extras
        hold the true values, which is what gets logged."""
        late_cls, local, parts = self._losses(model, batch, self._n_spans(batch))
        contrastive = global_span_contrastive_loss(late_cls)
        return local + contrastive, self._extras(parts, local, contrastive)

    @staticmethod
    def _extras(parts: dict, local: torch.Tensor, scaled_contrastive: torch.Tensor) -> dict:
        contrastive = scaled_contrastive.detach() / world_size()
        return {**parts, "contrastive_loss": contrastive, "loss": local.detach() + contrastive}

    def _chunks(self, batch: dict) -> list[dict]:
        """The gradient cache's chunks: packed ones as packing grouped them."""
        if "chunks" in batch:
            return [chunk_of(batch, c) for c in batch["chunks"]]
        n_local, size = batch["input_ids"].shape[0], self.chunk_size or batch["input_ids"].shape[0]
        return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n_local, size)]

    def backward(self, engine, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One optimiser step's backward, through the gradient cache when ``chunk_size`` asks."""
        n_local = self._n_spans(batch)
        chunks = self._chunks(batch)
        if len(chunks) == 1:
            loss, extras = self.loss(engine, batch)
            engine.backward(loss)
            return extras.pop("loss"), extras
        parts: dict[str, torch.Tensor] = {}

        def encode(module, chunk):
            late_cls, local, chunk_parts = self._losses(module, chunk, n_local)
            for k, v in chunk_parts.items():
                parts[k] = parts.get(k, 0) + v
            return late_cls, local

        def represent(module, chunk):
            return module.late_cls(**{k: v for k, v in chunk.items() if k != "chunks"})

        contrastive, local = engine_grad_cache_backward(engine, chunks, encode, global_span_contrastive_loss, represent)
        extras = self._extras(parts, local, contrastive)
        return extras.pop("loss"), extras
