"""coCondenser (Gao & Callan, 2022): Condenser plus a corpus-level span-pair contrastive loss.

Each document contributes two random spans (:func:`draw_span_pairs`, re-drawn every
epoch by the stream); a span's positive is its partner and every other span of the
*global* batch is a negative. Similarity is the raw dot product of last-layer CLS
vectors: no normalisation, no temperature. The total is (head MLM + late MLM +
contrastive) averaged over the 2n spans (paper eq. 7).

With ``chunk_size`` set, a step runs through the gradient cache of
``models/grad_cache.py``, so the span batch can be far larger than memory allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.condenser import Condenser, CondenserConfig, CondenserMethod
from models.distributed import gather_with_grad, world_size
from models.grad_cache import engine_grad_cache_backward


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
    span_length: int = field(default=80, metadata={"help": "tokens per span (without [CLS]/[SEP])"})
    short_span_prob: float = field(
        default=0.1,
        metadata={"help": "chance that a pair's spans are shorter: uniform in [min_span_length, span_length)"},
    )
    min_span_length: int = field(
        default=16,
        metadata={"help": "shortest span; documents under 2x this many tokens hold no pair and are skipped (counted)"},
    )
    chunk_size: int = field(
        default=0,
        metadata={"help": "gradient cache: spans per forward chunk; 0 = no cache (the whole micro-batch in one graph)"},
    )


# -- the method -------------------------------------------------------------------------


class CoCondenserMethod(CondenserMethod):
    """coCondenser pre-training: Condenser MLM losses + span-pair contrastive loss.

    A micro-batch holds ``b`` documents as (b, 2, L) span pairs; the task flattens them
    to (2b, L) with partners adjacent, as :func:`partner_targets` expects.
    """

    name = "cocondenser"
    example_format = "span_pairs"

    def build(self, mlm) -> Condenser:
        model = Condenser(mlm, self.cfg.n_head_layers, self.cfg.skip_from)
        if self.cfg.head and self.cfg.head != "auto":
            model.load_head(self.cfg.head)
        return model

    def _losses(self, model, batch: dict, n_local: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(late CLS, summed per-span MLM share of this chunk, detached parts)."""
        out = model(batch["input_ids"], batch["attention_mask"], batch["labels"], per_sequence=True)
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
        late_cls, local, parts = self._losses(model, batch, batch["input_ids"].shape[0])
        contrastive = global_span_contrastive_loss(late_cls)
        return local + contrastive, self._extras(parts, local, contrastive)

    @staticmethod
    def _extras(parts: dict, local: torch.Tensor, scaled_contrastive: torch.Tensor) -> dict:
        contrastive = scaled_contrastive.detach() / world_size()
        return {**parts, "contrastive_loss": contrastive, "loss": local.detach() + contrastive}

    def backward(self, engine, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One optimiser step's backward, through the gradient cache when ``chunk_size`` asks."""
        n_local = batch["input_ids"].shape[0]
        if not self.cfg.chunk_size or self.cfg.chunk_size >= n_local:
            loss, extras = self.loss(engine, batch)
            engine.backward(loss)
            return extras.pop("loss"), extras
        chunks = [
            {k: v[i : i + self.cfg.chunk_size] for k, v in batch.items()}
            for i in range(0, n_local, self.cfg.chunk_size)
        ]
        parts: dict[str, torch.Tensor] = {}

        def encode(module, chunk):
            late_cls, local, chunk_parts = self._losses(module, chunk, n_local)
            if torch.is_grad_enabled():  # the replay, not the no-grad first pass
                for k, v in chunk_parts.items():
                    parts[k] = parts.get(k, 0) + v
            return late_cls, local

        contrastive, local = engine_grad_cache_backward(engine, chunks, encode, global_span_contrastive_loss)
        extras = self._extras(parts, local, contrastive)
        return extras.pop("loss"), extras
