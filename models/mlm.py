"""Plain masked-language-model pre-training: the "no bottleneck" baseline.

Whole-word masking with BERT's 80/10/10, loss on the last layer. Its export is a full
``AutoModelForMaskedLM`` of its family (MLM head included), so a small one trained here serves directly
as the frozen generator of SimLM (``--simlm.generator <export_dir>``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from models.backbone import export_backbone, family
from models.method import WholeWordMaskingMethod
from models.mlm_losses import masked_lm_loss


@dataclass
class MLMConfig:
    mlm_probability: float = field(
        default=0.15, metadata={"min": 0, "max": 1, "help": "whole-word masking rate (80/10/10 replacement)"}
    )


class MaskedLM(nn.Module):
    """An MLM whose forward returns the loss, projecting only the masked positions.

    (``*ForMaskedLM.forward`` would compute vocabulary-sized logits at every position.)
    """

    def __init__(self, mlm: PreTrainedModel):
        super().__init__()
        self.lm = mlm

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        states = family(self.lm).base(self.lm)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return masked_lm_loss(self.lm, states, labels)


class MLMMethod(WholeWordMaskingMethod[MaskedLM]):
    """MLM pre-training as the trainer sees it: batches, loss, export."""

    name = "mlm"
    example_format = "sequences"  # packed/truncated token sequences, see pipeline.data.stream

    def build(self, mlm: PreTrainedModel) -> MaskedLM:
        return MaskedLM(mlm)

    def loss(self, model: MaskedLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return model(**batch), {}

    def export(self, model: MaskedLM, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        # No head_path: there is no head, and the trainer's export treats every value as a path.
        return {"export_dir": export_backbone(model.lm, out_dir, tokenizer_dir)}
