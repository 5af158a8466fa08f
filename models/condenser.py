"""Condenser (Gao & Callan, 2021): a pre-training head that forces information into CLS.

The head is ``n_head_layers`` fresh Transformer layers that read
``[late CLS ; early tokens]``: the last layer's CLS vector followed by the token states
at the end of the early layer group (``hidden_states[skip_from][:, 1:]``). The only
route from the late layers to the head's MLM predictions is therefore the CLS vector.
Loss = MLM(head) + MLM(late layers), through the backbone's own tied ``cls`` projection;
the late MLM keeps the backbone from being corrupted by the random head early on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from models.backbone import export_backbone, family, load_module_state, save_module
from models.method import ExampleFormat, WholeWordMaskingMethod
from models.mlm_losses import masked_lm_loss, sequence_mlm_losses
from models.packing import packed_attention_mask


@dataclass
class CondenserConfig:
    n_head_layers: int = field(default=2, metadata={"min": 1, "help": "Transformer layers in the Condenser head"})
    skip_from: int = field(
        default=0,
        metadata={"min": 0, "help": "early/late split: early tokens are hidden_states[skip_from]; 0 = num_layers // 2"},
    )
    mlm_probability: float = field(
        default=0.15, metadata={"min": 0, "max": 1, "help": "whole-word masking rate (80/10/10 replacement)"}
    )
    head: str = field(default="", metadata={"help": "head weights (safetensors) to continue pre-training from"})


def init_bert_like(module: nn.Module, std: float) -> None:
    """BERT's initialisation: normal(0, initializer_range) weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            if m.bias is not None:  # ModernBERT's norms have none
                nn.init.zeros_(m.bias)


@dataclass
class CondenserOutput:
    loss: torch.Tensor
    head_mlm_loss: torch.Tensor  # scalar, or (B,) per sequence
    late_mlm_loss: torch.Tensor
    late_cls: torch.Tensor  # (B, H): the representation a retriever will use


class Condenser(nn.Module):
    def __init__(self, mlm: PreTrainedModel, n_head_layers: int = 2, skip_from: int = 0):
        super().__init__()
        num_layers = mlm.config.num_hidden_layers
        self.skip_from = skip_from or num_layers // 2
        if not 1 <= self.skip_from < num_layers:
            raise ValueError(f"skip_from={self.skip_from} must split {num_layers} layers into non-empty groups")
        self.lm = mlm
        self.family = family(mlm)
        # Layers of the backbone's own kind, freshly initialised.
        self.head = nn.ModuleList(self.family.new_layer(mlm) for _ in range(n_head_layers))
        init_bert_like(self.head, mlm.config.initializer_range)

    @property
    def config(self):
        return self.lm.config

    def backbone_states(self, input_ids, attention_mask, position_ids=None, with_cls: bool = False):
        """(late hidden states, early token states; with ``with_cls``, the early [CLS] too)."""
        out = self.family.base(self.lm)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
            return_dict=True,
        )
        early = out.hidden_states[self.skip_from]
        return out.last_hidden_state, early if with_cls else early[:, 1:]

    def head_states(
        self, late_cls: torch.Tensor, early_tokens: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Run the head on ``[late CLS ; early tokens]`` (late_cls is (B, 1, H))."""
        hidden = torch.cat([late_cls, early_tokens], dim=1)
        return self.family.run_layers(self.lm, self.head, hidden, attention_mask)

    def forward(
        self, input_ids, attention_mask=None, labels=None, per_sequence: bool = False, **packed
    ) -> CondenserOutput:
        """Losses are token means over the batch, or with ``per_sequence`` one mean per
        sequence ((B,) tensors; ``loss`` is then their sum over both losses). A packed batch
        (models/packing.py: ``segments``, ``position_ids``, ``sequence_index``,
        ``cls_index``) is always per sequence, in ``cls_index``'s order."""
        if packed:
            return self._packed_forward(input_ids, labels, **packed)
        late, early_tokens = self.backbone_states(input_ids, attention_mask)
        head = self.head_states(late[:, :1], early_tokens, attention_mask)
        mlm_loss = sequence_mlm_losses if per_sequence else masked_lm_loss
        head_loss = mlm_loss(self.lm, head, labels)
        late_loss = mlm_loss(self.lm, late, labels)
        loss = (head_loss + late_loss).sum() if per_sequence else head_loss + late_loss
        return CondenserOutput(loss, head_loss, late_loss, late[:, 0])

    def late_cls(self, input_ids, attention_mask=None, segments=None, position_ids=None, cls_index=None, **_):
        """The late CLS vectors alone, as :meth:`forward` returns them (in ``cls_index``'s order
        for a packed batch): the backbone's layers, not the head's nor the MLM losses. The
        gradient cache's first pass needs only these. The backbone draws its dropout as in
        :meth:`forward`, so a replay of the forward from the same RNG state gives the same
        vectors."""
        base = self.family.base(self.lm)
        if segments is None:
            return base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        mask = packed_attention_mask(self.lm.config, segments, self.lm.dtype)
        positions = self.family.packed_positions(self.lm, position_ids)
        late = base(input_ids=input_ids, attention_mask=mask, position_ids=positions).last_hidden_state
        return late.flatten(0, 1)[cls_index]

    def _packed_forward(self, input_ids, labels, segments, position_ids, sequence_index, cls_index) -> CondenserOutput:
        """Each packed sequence as it runs alone: the head reads every early token but, at
        each sequence's [CLS], that sequence's late CLS (what ``[late CLS ; early tokens]``
        is for a row of its own)."""
        mask = packed_attention_mask(self.lm.config, segments, self.lm.dtype)
        positions = self.family.packed_positions(self.lm, position_ids)
        late, early = self.backbone_states(input_ids, mask, positions, with_cls=True)
        late_cls = late.flatten(0, 1)[cls_index]
        early = early.flatten(0, 1)
        head_input = early.index_copy(0, cls_index, late_cls.to(early.dtype)).view_as(late)
        head = self.family.run_layers(self.lm, self.head, head_input, mask)
        n = cls_index.shape[0]
        head_loss = sequence_mlm_losses(self.lm, head, labels, sequence_index, n)
        late_loss = sequence_mlm_losses(self.lm, late, labels, sequence_index, n)
        return CondenserOutput((head_loss + late_loss).sum(), head_loss, late_loss, late_cls)

    # -- persistence -------------------------------------------------------------------

    def head_meta(self) -> dict:
        return {"method": "condenser", "n_head_layers": len(self.head), "skip_from": self.skip_from}

    def save(self, out_dir: str, tokenizer_dir: str | None = None) -> dict[str, str]:
        export_backbone(self.lm, out_dir, tokenizer_dir)
        head_path = save_module(self.head, f"{out_dir}/condenser_head.safetensors", self.head_meta())
        return {"export_dir": out_dir, "head_path": head_path}

    def load_head(self, path: str) -> None:
        state, meta = load_module_state(path)
        if meta.get("n_head_layers", len(self.head)) != len(self.head):
            raise ValueError(f"{path}: head has {meta['n_head_layers']} layers, model expects {len(self.head)}")
        if meta.get("skip_from", self.skip_from) != self.skip_from:
            raise ValueError(
                f"{path}: head was trained with skip_from={meta['skip_from']}, model uses {self.skip_from}"
            )
        self.head.load_state_dict(state)


class CondenserMethod(WholeWordMaskingMethod[Condenser]):
    """Condenser pre-training as the trainer sees it: batches, loss, export."""

    name = "condenser"
    example_format: ExampleFormat = "sequences"  # packed/truncated token sequences, see pipeline.data.stream

    def build(self, mlm: PreTrainedModel) -> Condenser:
        model = Condenser(mlm, self.cfg.n_head_layers, self.cfg.skip_from)
        if self.cfg.head:
            model.load_head(self.cfg.head)
        return model

    def loss(self, model: Condenser, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = model(**batch)
        return out.loss, {"head_mlm_loss": out.head_mlm_loss.detach(), "late_mlm_loss": out.late_mlm_loss.detach()}

    def export(self, model: Condenser, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        return model.save(out_dir, tokenizer_dir)
