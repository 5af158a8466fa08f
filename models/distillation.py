"""Distillation of a cross-encoder into the bi-encoder (SimLM's last stage).

The student retriever learns to reproduce the teacher's distribution over each query's
group: ``KL(softmax(teacher / T) || softmax(student))``, plus ``alpha`` times the usual
contrastive loss over the global batch (SimLM: alpha = 0.2). Or, with ``teacher_loss:
listmle``, the teacher's ranking rather than its scores: ListMLE (Xia et al. 2008), the
negative log-likelihood of the teacher's order of the group under the Plackett-Luce model
of the student's scores; only the order counts, so ``teacher_temperature`` does not. The teacher's scores are
those the re-ranker gave the group's passages (read from the scoring stage's run); the
student's are the retriever's own similarities (cosine already divided by its
temperature), so only the teacher gets ``teacher_temperature``.

Data parallelism: the KL couples a query with its own group only, so each worker takes it
over its own queries (a batch mean) and DeepSpeed's gradient average makes it the mean over
the global batch. The contrastive term is global and scaled by the world size, exactly as
in plain fine-tuning (:func:`models.biencoder.global_contrastive_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from models.biencoder import (
    BiEncoderConfig,
    ContrastiveObjective,
    biencoder_backward,
    global_contrastive_loss,
    own_group_scores,
    positive_top1,
)
from models.distributed import world_size


@dataclass
class DistillationConfig:
    alpha: float = field(
        default=0.2, metadata={"min": 0, "help": "weight of the contrastive loss added to the KL term (SimLM: 0.2)"}
    )
    teacher_temperature: float = field(
        default=1.0, metadata={"above": 0, "help": "the teacher's scores are divided by this before their softmax"}
    )
    teacher_loss: Literal["kl", "listmle"] = field(
        default="kl",
        metadata={
            "help": "kl = KL to the softmax of the teacher's scores; listmle = the likelihood of the teacher's ranking of the group (its order only)"
        },
    )


def teacher_kl(
    student_group_scores: torch.Tensor, teacher_scores: torch.Tensor, teacher_temperature: float = 1.0
) -> torch.Tensor:
    """``KL(softmax(teacher / T) || softmax(student))`` per query over its group, averaged
    over the queries. Both are (b, group_size), positive first."""
    if student_group_scores.shape != teacher_scores.shape:
        raise ValueError(
            f"student scores {tuple(student_group_scores.shape)} and teacher scores "
            f"{tuple(teacher_scores.shape)} must have the same (queries, group size) shape"
        )
    student = F.log_softmax(student_group_scores.float(), dim=-1)
    teacher = F.log_softmax(teacher_scores.float() / teacher_temperature, dim=-1)
    return F.kl_div(student, teacher, reduction="batchmean", log_target=True)


def teacher_listmle(student_group_scores: torch.Tensor, teacher_scores: torch.Tensor) -> torch.Tensor:
    """ListMLE of the teacher's ranking per query over its group, averaged over the queries:
    with ``pi`` the teacher's order (best first; ties kept in group order),
    ``sum_i [logsumexp(s[pi_i:]) - s[pi_i]]`` of the student's scores ``s``."""
    if student_group_scores.shape != teacher_scores.shape:
        raise ValueError(
            f"student scores {tuple(student_group_scores.shape)} and teacher scores "
            f"{tuple(teacher_scores.shape)} must have the same (queries, group size) shape"
        )
    order = torch.sort(teacher_scores.float(), dim=-1, descending=True, stable=True).indices
    ranked = torch.gather(student_group_scores.float(), -1, order)
    below = torch.logcumsumexp(ranked.flip(-1), dim=-1).flip(-1)  # logsumexp of each rank and those after it
    return (below - ranked).sum(-1).mean()


def teacher_term(
    student_group_scores: torch.Tensor, teacher_scores: torch.Tensor, teacher_loss: str, teacher_temperature: float
) -> torch.Tensor:
    if teacher_loss == "listmle":
        return teacher_listmle(student_group_scores, teacher_scores)
    return teacher_kl(student_group_scores, teacher_scores, teacher_temperature)


def distillation_loss(
    student_group_scores: torch.Tensor,
    teacher_scores: torch.Tensor,
    ce_loss: torch.Tensor,
    alpha: float,
    teacher_temperature: float = 1.0,
    teacher_loss: str = "kl",
) -> torch.Tensor:
    """The teacher's term (KL or ListMLE) plus ``alpha`` times the contrastive loss ``ce_loss``."""
    return teacher_term(student_group_scores, teacher_scores, teacher_loss, teacher_temperature) + alpha * ce_loss


def distillation_backward(
    engine,
    batch: dict[str, torch.Tensor],
    group_size: int,
    alpha: float,
    chunk_size: int = 0,
    teacher_temperature: float = 1.0,
    teacher_loss: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's forward and ``engine.backward`` of the distillation loss.

    ``batch`` is :func:`models.biencoder.biencoder_backward`'s plus ``d_teacher_scores``
    (b, group_size), aligned with each query's group. Returns this worker's
    ``teacher + alpha * ce`` (the teacher's term over its own queries, the CE over the global
    batch) and, to log, the teacher's term under its name (``kl`` or ``listmle``), ``ce`` and
    the in-batch top-1 ``accuracy``.
    """
    module = getattr(engine, "module", engine)
    teacher = batch["d_teacher_scores"]
    stats: dict[str, torch.Tensor] = {}

    def coupled(queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        local_scores = module.compute_similarity(queries, passages)  # (b, b * group_size)
        student = own_group_scores(local_scores, group_size)
        ce = global_contrastive_loss(module, queries, passages, group_size)  # scaled by the world size
        with torch.no_grad():
            stats[teacher_loss] = teacher_term(student, teacher, teacher_loss, teacher_temperature)
            stats["ce"] = ce / world_size()
            stats["accuracy"] = positive_top1(local_scores, group_size)
        return distillation_loss(student, teacher, ce, alpha, teacher_temperature, teacher_loss)

    biencoder_backward(engine, batch, coupled, chunk_size)
    return stats[teacher_loss] + alpha * stats["ce"], stats


class DistillationObjective(ContrastiveObjective):
    """The bi-encoder's objective with the teacher's scores in the batch: ``KL + alpha * CE``."""

    def __init__(
        self,
        cfg: BiEncoderConfig,
        distill: DistillationConfig,
        passage_max_len: int | None = None,
        query_max_len: int | None = None,
    ):
        super().__init__(cfg, passage_max_len, query_max_len)
        self.distill = distill

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        tensors = super().make_batch(batch, generator)
        tensors["d_teacher_scores"] = torch.tensor(np.asarray(batch["d_teacher_scores"]), dtype=torch.float32)
        return tensors

    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg, distill = self.cfg, self.distill
        return distillation_backward(
            engine,
            batch,
            cfg.group_size,
            distill.alpha,
            self.chunk_size,
            distill.teacher_temperature,
            distill.teacher_loss,
        )
