"""SimLM (Wang et al., 2022): a representation bottleneck trained by replaced-language-modelling.

The encoder is the full BERT; its last-layer CLS is the bottleneck. A shallow decoder
(a copy of the encoder's last ``n_decoder_layers`` layers) reads
``[encoder CLS ; embeddings(decoder input)[:, 1:]]`` with bidirectional attention, so
everything it knows about the text beyond its own, more heavily corrupted input has to
come through the CLS vector.

Both inputs are ELECTRA-style corruptions of the same text: whole words are selected
(30% for the encoder; 50% for the decoder, a superset of the encoder's) and replaced
by samples from a frozen generator MLM. Labels are the original ids at *every*
non-special position, so the task is "recover the text", not "fill the masks".
Loss = CE(encoder) + CE(decoder), both through the backbone's tied ``cls`` projection.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForMaskedLM, PreTrainedModel

from models.backbone import (
    export_backbone,
    family,
    load_module_state,
    load_pretrained,
    save_module,
)
from models.masking import IGNORE_INDEX, MaskingVocab, select_words, word_ids
from models.method import PretrainingMethod
from models.mlm_losses import masked_lm_loss

DECODER_FILE = "simlm_decoder.safetensors"


@dataclass
class SimLMConfig:
    generator: str = field(
        default="",
        metadata={
            "help": "HF masked-LM checkpoint (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME; same vocabulary) that samples the replacements; kept frozen. Empty = the job trains a 2-layer MLM on the same corpus first (<train.output>/generator), or reuses the one a previous run trained there"
        },
    )
    encoder_mask_rate: float = field(
        default=0.3, metadata={"min": 0, "max": 1, "help": "fraction of words replaced in the encoder input"}
    )
    decoder_mask_rate: float = field(
        default=0.5,
        metadata={
            "min": 0,
            "max": 1,
            "help": "fraction of words replaced in the decoder input (includes all encoder replacements)",
        },
    )
    n_decoder_layers: int = field(
        default=2, metadata={"min": 1, "help": "decoder layers, initialised from the encoder's last layers"}
    )
    decoder: str = field(default="", metadata={"help": "decoder weights (safetensors) to continue pre-training from"})
    generator_temperature: float = field(
        default=1.0, metadata={"above": 0, "help": "softmax temperature of the generator's samples"}
    )


# -- the frozen generator --------------------------------------------------------------------


def load_generator(path: str, vocab_size: int) -> nn.Module:
    """A frozen (eval, no grad) masked LM from a local checkpoint whose vocabulary matches the corpus."""
    if not path or not os.path.isdir(path):
        raise FileNotFoundError(
            f"SimLM needs a generator: a local masked-LM checkpoint directory (got {path!r}). "
            "Train one with `python jobs/pretrain.py --method mlm` (a small model) and pass its export_dir "
            "as --simlm.generator"
        )
    generator_vocab = AutoConfig.from_pretrained(path).vocab_size
    if generator_vocab != vocab_size:
        raise ValueError(
            f"SimLM generator {path!r} has vocab_size {generator_vocab} but the corpus vocabulary has {vocab_size}: "
            "the generator must use the corpus tokenizer (train it on the same prepared corpus)"
        )
    model = load_pretrained(AutoModelForMaskedLM, path)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def sample_replacements(
    generator: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    selected: torch.Tensor,
    mask_token_id: int,
    temperature: float,
    rng: torch.Generator,
) -> torch.Tensor:
    """``input_ids`` with each selected position replaced by a sample from the generator.

    The generator sees the text with [MASK] at the selected positions (as an MLM was
    trained to) and its softmax at ``temperature`` is sampled at those positions only;
    a sample may equal the original token, which is then simply kept.
    """
    out = input_ids.clone()
    if not selected.any():
        return out
    masked = input_ids.masked_fill(selected, mask_token_id)
    logits = generator(input_ids=masked, attention_mask=attention_mask).logits[selected]
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    out[selected] = torch.multinomial(probs, 1, generator=rng).squeeze(1)
    return out


# -- masking ---------------------------------------------------------------------------------


def select_replacements(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    vocab: MaskingVocab,
    encoder_rate: float,
    decoder_rate: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-word (encoder, decoder) selections with encoder ⊆ decoder.

    The decoder adds an independent draw over the words the encoder left, at the rate
    that brings each word's total chance to ``decoder_rate``:
    p_enc + (1 - p_enc) * p_extra = p_dec.
    """
    valid = attention_mask.bool()
    encoder = select_words(input_ids, vocab, encoder_rate, generator) & valid
    extra_rate = (decoder_rate - encoder_rate) / (1.0 - encoder_rate)
    decoder = encoder | (select_words(input_ids, vocab, extra_rate, generator) & valid)
    return encoder, decoder


def recovery_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab: MaskingVocab) -> torch.Tensor:
    """The original id at every non-special, non-padding position; -100 elsewhere."""
    keep = (word_ids(input_ids, vocab) >= 0) & attention_mask.bool()
    return input_ids.masked_fill(~keep, IGNORE_INDEX)


# -- the model -------------------------------------------------------------------------------


@dataclass
class SimLMOutput:
    loss: torch.Tensor
    enc_mlm_loss: torch.Tensor
    dec_mlm_loss: torch.Tensor
    enc_cls: torch.Tensor  # (B, H): the representation a retriever will use


class SimLM(nn.Module):
    def __init__(self, mlm: PreTrainedModel, n_decoder_layers: int = 2):
        super().__init__()
        num_layers = mlm.config.num_hidden_layers
        if not 1 <= n_decoder_layers <= num_layers:
            raise ValueError(
                f"n_decoder_layers={n_decoder_layers} must be 1..{num_layers}: "
                "the decoder is a copy of the encoder's last layers"
            )
        self.lm = mlm
        self.family = family(mlm)
        # Copies, not shared layers: the decoder trains apart from the encoder, but starts
        # from weights that already read the encoder's embedding space.
        self.decoder = nn.ModuleList(copy.deepcopy(layer) for layer in self.family.layers(mlm)[-n_decoder_layers:])

    @property
    def config(self):
        return self.lm.config

    def encoder_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.family.base(self.lm)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def decoder_states(
        self, enc_cls: torch.Tensor, dec_input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Run the decoder on ``[encoder CLS ; embeddings(dec ids)[:, 1:]]`` (enc_cls is (B, 1, H))."""
        tokens = self.family.embed(self.lm, dec_input_ids)[:, 1:]
        hidden = torch.cat([enc_cls, tokens], dim=1)
        return self.family.run_layers(self.lm, self.decoder, hidden, attention_mask)

    def forward(
        self,
        enc_input_ids: torch.Tensor,
        dec_input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        enc_labels: torch.Tensor,
        dec_labels: torch.Tensor,
    ) -> SimLMOutput:
        enc = self.encoder_states(enc_input_ids, attention_mask)
        dec = self.decoder_states(enc[:, :1], dec_input_ids, attention_mask)
        enc_loss = masked_lm_loss(self.lm, enc, enc_labels)
        dec_loss = masked_lm_loss(self.lm, dec, dec_labels)
        return SimLMOutput(enc_loss + dec_loss, enc_loss, dec_loss, enc[:, 0])

    # -- persistence -------------------------------------------------------------------

    def decoder_meta(self) -> dict:
        return {"method": "simlm", "n_decoder_layers": len(self.decoder), "hidden_size": self.config.hidden_size}

    def save(self, out_dir: str, tokenizer_dir: str | None = None) -> dict[str, str]:
        export_backbone(self.lm, out_dir, tokenizer_dir)
        decoder_path = save_module(self.decoder, os.path.join(out_dir, DECODER_FILE), self.decoder_meta())
        return {"export_dir": out_dir, "head_path": decoder_path}

    def load_decoder(self, path: str) -> None:
        state, meta = load_module_state(path)
        expected = self.decoder_meta()
        # A Condenser head has the same layer keys, so the method tag is what tells them apart.
        for key, value in expected.items():
            if meta.get(key) != value:
                raise ValueError(f"{path}: not a decoder for this model: {key}={meta.get(key)!r}, expected {value!r}")
        self.decoder.load_state_dict(state)


class SimLMMethod(PretrainingMethod[SimLM]):
    """SimLM pre-training as the trainer sees it: batches, loss, export.

    corrupt_batch (CPU) draws the selections and a sampling seed; loss (on the device) runs
    the generator there, because the generator needs the device and is not part of the
    trained module (DeepSpeed must not cast, checkpoint or optimise it).
    """

    name = "simlm"
    example_format = "sequences"  # packed/truncated token sequences, see pipeline.data.stream

    def __init__(self, cfg: SimLMConfig, vocab: MaskingVocab):
        if not 0.0 < cfg.encoder_mask_rate <= cfg.decoder_mask_rate < 1.0:
            raise ValueError(
                f"need 0 < encoder_mask_rate ({cfg.encoder_mask_rate}) <= decoder_mask_rate "
                f"({cfg.decoder_mask_rate}) < 1"
            )
        if cfg.generator_temperature <= 0:
            raise ValueError(f"generator_temperature must be > 0, got {cfg.generator_temperature}")
        self.cfg = cfg
        self.vocab = vocab
        self.generator = load_generator(cfg.generator, vocab.vocab_size)

    def build(self, mlm: PreTrainedModel) -> SimLM:
        model = SimLM(mlm, self.cfg.n_decoder_layers)
        if self.cfg.decoder:
            model.load_decoder(self.cfg.decoder)
        return model

    def corrupt_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        enc, dec = select_replacements(
            input_ids, attention_mask, self.vocab, self.cfg.encoder_mask_rate, self.cfg.decoder_mask_rate, generator
        )
        labels = recovery_labels(input_ids, attention_mask, self.vocab)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "enc_selected": enc,
            "dec_selected": dec,
            "enc_labels": labels,
            "dec_labels": labels,
            "gen_seed": torch.randint(0, 2**62, (), generator=generator),
        }

    def corrupt(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(enc_input_ids, dec_input_ids), sampled on the batch's device, reproducible from gen_seed."""
        ids = batch["input_ids"]
        if next(self.generator.parameters()).device != ids.device:
            self.generator.to(ids.device)
        rng = torch.Generator(device=ids.device).manual_seed(int(batch["gen_seed"]))
        # Both views in one generator pass; each view sees only its own [MASK]s.
        both = sample_replacements(
            self.generator,
            torch.cat([ids, ids]),
            batch["attention_mask"].repeat(2, 1),
            torch.cat([batch["enc_selected"], batch["dec_selected"]]),
            self.vocab.mask_token_id,
            self.cfg.generator_temperature,
            rng,
        )
        return both[: len(ids)], both[len(ids) :]

    def loss(self, model: SimLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        enc_ids, dec_ids = self.corrupt(batch)
        out = model(
            enc_input_ids=enc_ids,
            dec_input_ids=dec_ids,
            attention_mask=batch["attention_mask"],
            enc_labels=batch["enc_labels"],
            dec_labels=batch["dec_labels"],
        )
        eligible = (batch["enc_labels"] != IGNORE_INDEX).sum().clamp(min=1)
        return out.loss, {
            "enc_mlm_loss": out.enc_mlm_loss.detach(),
            "dec_mlm_loss": out.dec_mlm_loss.detach(),
            "enc_replace_rate": batch["enc_selected"].sum() / eligible,
            "dec_replace_rate": batch["dec_selected"].sum() / eligible,
        }

    def export(self, model: SimLM, out_dir: str, tokenizer_dir: str | None) -> dict[str, str]:
        return model.save(out_dir, tokenizer_dir)
