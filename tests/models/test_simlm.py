"""SimLM masking, generator sampling, decoder wiring, loss and export (models.simlm), on tiny random BERTs.

Models run in eval mode with dropout 0 unless a test says otherwise, so comparisons are
exact up to float rounding.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForMaskedLM

from models.backbone import build_mlm
from models.condenser import Condenser
from models.masking import IGNORE_INDEX, MaskingVocab
from models.mlm import MLMConfig, MLMMethod
from models.simlm import (
    DECODER_FILE,
    SimLM,
    SimLMConfig,
    SimLMMethod,
    recovery_labels,
    sample_replacements,
    select_replacements,
)
from tests.helpers import (
    MASK_ID,
    SPECIAL_IDS,
    TINY_SIZES,
    assert_drop_in_bert,
    make_tokenizer_dir,
    random_word_batch,
    tiny_backbone_config,
    tiny_masking_vocab,
    tiny_mlm,
    tiny_vocab,
)
from tests.models.test_condenser import Capture, perturb_output, tokenized_batch

V = len(tiny_vocab())
L = TINY_SIZES["num_layers"]


@pytest.fixture(scope="module")
def generator_dir(tmp_path_factory) -> str:
    """A small random MLM on the tiny vocabulary, saved as a local HF checkpoint.

    Dropout 0.1, so that a generator left in train mode would show it.
    """
    path = str(tmp_path_factory.mktemp("generator"))
    tiny_mlm(V, seed=7, num_layers=1, dropout=0.1, initializer_range=0.2).save_pretrained(path)
    return path


def make_method(generator_dir: str, **overrides) -> SimLMMethod:
    return SimLMMethod(SimLMConfig(generator=generator_dir, **overrides), tiny_masking_vocab())


def make_model(n_decoder_layers: int = 2, seed: int = 0) -> SimLM:
    # initializer_range 0.2: far-from-uniform logits, so distinct terms give distinct losses.
    return SimLM(tiny_mlm(V, seed=seed, initializer_range=0.2), n_decoder_layers).eval()


class RiggedGenerator(nn.Module):
    """Stands in for a generator MLM: the same ``logits`` (V,) at every position; records its input."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("fixed_logits", logits)
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the method a device to read
        self.seen_ids = None

    def forward(self, input_ids, attention_mask):
        self.seen_ids = input_ids.clone()
        return SimpleNamespace(logits=self.fixed_logits.expand(*input_ids.shape, -1))


def one_hot_logits(token: int) -> torch.Tensor:
    return torch.full((V,), -1e4).index_fill(0, torch.tensor([token]), 0.0)


def small_batch(method: SimLMMethod, seed: int = 0, batch_size: int = 4, seq_len: int = 24):
    wb = random_word_batch(batch_size, seq_len, seed=seed, pad_rows=0.5)
    return method.corrupt_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(seed))


# -- masking ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_batch():
    return random_word_batch(200, 128, seed=11)


@pytest.mark.parametrize("enc_rate,dec_rate", [(0.3, 0.5), (0.4, 0.6), (0.3, 0.3)])
def test_selection_rates_nesting_and_whole_words(big_batch, enc_rate, dec_rate):
    wb = big_batch
    enc, dec = select_replacements(
        wb.input_ids, wb.attention_mask, tiny_masking_vocab(), enc_rate, dec_rate, torch.Generator().manual_seed(0)
    )
    words = [(b, s, e) for b, row in enumerate(wb.words) for s, e in row]
    assert len(words) > 8000
    for selected, rate in ((enc, enc_rate), (dec, dec_rate)):
        word_rate = sum(bool(selected[b, s]) for b, s, _ in words) / len(words)
        assert abs(word_rate - rate) < 0.02, (rate, word_rate)
        assert all(bool(selected[b, s:e].all()) == bool(selected[b, s:e].any()) for b, s, e in words)
        special = torch.isin(wb.input_ids, torch.tensor(SPECIAL_IDS)) | (wb.attention_mask == 0)
        assert not (selected & special).any()
    assert not (enc & ~dec).any()  # every encoder replacement is a decoder replacement too
    if dec_rate > enc_rate:  # the extra words are spread over the rest, not only near the encoder's
        extra = sum(bool(dec[b, s] and not enc[b, s]) for b, s, _ in words)
        not_enc = sum(not bool(enc[b, s]) for b, s, _ in words)
        assert abs(extra / not_enc - (dec_rate - enc_rate) / (1 - enc_rate)) < 0.02


def test_labels_are_the_originals_at_every_non_special_position(generator_dir):
    method = make_method(generator_dir)
    wb = random_word_batch(6, 32, seed=5, pad_rows=0.5)
    padded_row = int((wb.attention_mask[:, -1] == 0).nonzero()[0])
    wb.input_ids[padded_row, -1] = 9  # a non-special id under padding must still get no label
    batch = method.corrupt_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(0))
    eligible = ~torch.isin(wb.input_ids, torch.tensor(SPECIAL_IDS)) & (wb.attention_mask == 1)
    expected = wb.input_ids.masked_fill(~eligible, IGNORE_INDEX)
    assert torch.equal(batch["enc_labels"], expected) and torch.equal(batch["dec_labels"], expected)
    assert torch.equal(recovery_labels(wb.input_ids, wb.attention_mask, tiny_masking_vocab()), expected)
    assert (eligible & ~batch["dec_selected"]).any()  # labels go beyond the replaced positions
    assert torch.equal(batch["input_ids"], wb.input_ids)
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "enc_selected",
        "dec_selected",
        "enc_labels",
        "dec_labels",
        "gen_seed",
    }
    assert batch["gen_seed"].dim() == 0 and batch["gen_seed"].dtype == torch.long


def test_a_step_is_reproducible_from_its_generator(generator_dir):
    method = make_method(generator_dir)
    a, b, c = (small_batch(method, seed=s) for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["input_ids"], small_batch(method, seed=3)["input_ids"])
    enc_a, dec_a = method.corrupt(a)
    enc_b, dec_b = method.corrupt(b)
    assert torch.equal(enc_a, enc_b) and torch.equal(dec_a, dec_b)
    assert a["gen_seed"] != c["gen_seed"]
    other = dict(a, gen_seed=c["gen_seed"])
    assert not torch.equal(torch.cat(method.corrupt(other)), torch.cat([enc_a, dec_a]))


# -- generator sampling -----------------------------------------------------------------------


def test_replacements_are_generator_samples_at_selected_positions_only(generator_dir):
    method = make_method(generator_dir)
    method.generator = RiggedGenerator(one_hot_logits(17))
    batch = small_batch(method, seed=1, batch_size=8, seq_len=32)
    enc_ids, dec_ids = method.corrupt(batch)
    ids = batch["input_ids"]
    for corrupted, selected in ((enc_ids, batch["enc_selected"]), (dec_ids, batch["dec_selected"])):
        assert selected.any()
        assert torch.equal(corrupted, ids.masked_fill(selected, 17))
    # The generator read each view with [MASK] at that view's selection (encoder rows first).
    seen = method.generator.seen_ids
    assert torch.equal(
        seen,
        torch.cat([ids.masked_fill(batch["enc_selected"], MASK_ID), ids.masked_fill(batch["dec_selected"], MASK_ID)]),
    )


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.25])
def test_samples_follow_the_tempered_softmax(temperature):
    logits = torch.full((V,), -1e4)
    logits[[10, 11, 12]] = torch.tensor([1.0, 0.0, -1.0])
    ids = torch.full((50, 200), 20)
    selected = torch.ones_like(ids, dtype=torch.bool)
    out = sample_replacements(
        RiggedGenerator(logits),
        ids,
        torch.ones_like(ids),
        selected,
        MASK_ID,
        temperature,
        torch.Generator().manual_seed(0),
    )
    freq = torch.bincount(out.flatten(), minlength=V).float() / out.numel()
    expected = torch.softmax(logits / temperature, -1)
    assert (freq - expected).abs().max() < 0.01, (freq[10:13], expected[10:13])


def test_a_sample_may_equal_the_original():
    ids = torch.full((4, 10), 17)
    selected = torch.ones_like(ids, dtype=torch.bool)
    out = sample_replacements(
        RiggedGenerator(one_hot_logits(17)),
        ids,
        torch.ones_like(ids),
        selected,
        MASK_ID,
        1.0,
        torch.Generator().manual_seed(0),
    )
    assert torch.equal(out, ids)


def test_real_generator_samples_from_its_masked_softmax(generator_dir):
    """With a real MLM: the empirical distribution at one position is the generator's softmax there."""
    method = make_method(generator_dir)
    row = random_word_batch(1, 16, seed=2, pad_rows=0.0).input_ids
    ids = row.repeat(4000, 1)
    selected = torch.zeros_like(ids, dtype=torch.bool)
    selected[:, 3] = True
    out = sample_replacements(
        method.generator, ids, torch.ones_like(ids), selected, MASK_ID, 1.0, torch.Generator().manual_seed(0)
    )
    assert torch.equal(out[:, [0, 1, 2, *range(4, 16)]], ids[:, [0, 1, 2, *range(4, 16)]])
    with torch.no_grad():
        probs = torch.softmax(method.generator(input_ids=row.masked_fill(selected[:1], MASK_ID)).logits[0, 3], -1)
    freq = torch.bincount(out[:, 3], minlength=V).float() / len(out)
    assert (freq - probs).abs().max() < 0.03


def test_generator_is_frozen_and_not_part_of_the_trained_module(generator_dir):
    method = make_method(generator_dir)
    gen = method.generator
    assert not gen.training and not any(m.training for m in gen.modules())
    assert not any(p.requires_grad for p in gen.parameters())
    before = {k: v.clone() for k, v in gen.state_dict().items()}

    model = method.build(tiny_mlm(V)).train()
    assert not any(m is gen for m in model.modules())
    gen_params = {p.data_ptr() for p in gen.parameters()}
    assert not gen_params & {p.data_ptr() for p in model.parameters()}

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trained_before = model.lm.bert.encoder.layer[0].attention.self.query.weight.clone()
    for step in range(3):
        loss, _ = method.loss(model, small_batch(method, seed=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert all(p.grad is None for p in gen.parameters())
    assert all(torch.equal(v, before[k]) for k, v in gen.state_dict().items())
    assert not gen.training
    assert not torch.equal(model.lm.bert.encoder.layer[0].attention.self.query.weight, trained_before)


# -- decoder wiring ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_decoder_starts_as_a_separate_copy_of_the_last_layers(n):
    model = make_model(n)
    layers = model.lm.bert.encoder.layer
    assert len(model.decoder) == n
    for copied, original in zip(model.decoder, layers[-n:]):
        assert copied is not original
        a, b = copied.state_dict(), original.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert not {p.data_ptr() for p in copied.parameters()} & {p.data_ptr() for p in original.parameters()}
    # Training moves them apart: they get different gradients and are updated separately.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(*corrupted_pair()).loss.backward()
    opt.step()
    for copied, original in zip(model.decoder, layers[-n:]):
        assert not torch.equal(copied.output.dense.weight, original.output.dense.weight)


def test_n_decoder_layers_must_fit_the_encoder():
    for n in (0, L + 1):
        with pytest.raises(ValueError, match="n_decoder_layers"):
            SimLM(tiny_mlm(V), n)


def corrupted_pair(seed: int = 0):
    """SimLM.forward's inputs: (enc ids, dec ids, attention mask, enc labels, dec labels)."""
    wb = random_word_batch(4, 24, seed=seed, pad_rows=0.5)
    ids, mask = wb.input_ids, wb.attention_mask
    enc, dec = select_replacements(ids, mask, tiny_masking_vocab(), 0.3, 0.5, torch.Generator().manual_seed(seed))
    noise = torch.randint(5, V, ids.shape, generator=torch.Generator().manual_seed(seed + 1))
    labels = recovery_labels(ids, mask, tiny_masking_vocab())
    return torch.where(enc, noise, ids), torch.where(dec, noise.flip(0), ids), mask, labels, labels


def test_decoder_input_is_encoder_cls_then_decoder_embeddings():
    model = make_model()
    enc_ids, dec_ids, mask, labels, _ = corrupted_pair()
    cap = Capture().input_of(model.decoder[0])
    with torch.no_grad():
        out = model(enc_ids, dec_ids, mask, labels, labels)
        enc_last = model.lm.bert(input_ids=enc_ids, attention_mask=mask).last_hidden_state
        dec_emb = model.lm.bert.embeddings(input_ids=dec_ids)
        enc_emb = model.lm.bert.embeddings(input_ids=enc_ids)
    cap.remove()
    torch.testing.assert_close(cap.value[:, 0], enc_last[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(cap.value[:, 1:], dec_emb[:, 1:], rtol=0, atol=1e-6)
    assert (cap.value[:, 1:] - enc_emb[:, 1:]).abs().max() > 1e-3  # the decoder's own ids, not the encoder's
    torch.testing.assert_close(out.enc_cls, enc_last[:, 0], rtol=0, atol=1e-6)


def decoder_output(model, *inputs):
    cap = Capture().output_of(model.decoder[-1])
    try:
        with torch.no_grad():
            out = model(*inputs)
    finally:
        cap.remove()
    return cap.value, out


def test_only_the_encoder_cls_reaches_the_decoder():
    model = make_model()
    inputs = corrupted_pair(seed=1)
    base, base_out = decoder_output(model, *inputs)
    handle = perturb_output(model.lm.bert.encoder.layer[-1], slice(1, None))
    try:
        tokens, tokens_out = decoder_output(model, *inputs)
    finally:
        handle.remove()
    assert abs(tokens_out.enc_mlm_loss - base_out.enc_mlm_loss) > 1e-4  # the perturbation took effect
    assert torch.equal(tokens, base) and torch.equal(tokens_out.dec_mlm_loss, base_out.dec_mlm_loss)

    handle = perturb_output(model.lm.bert.encoder.layer[-1], slice(0, 1))
    try:
        cls, _ = decoder_output(model, *inputs)
    finally:
        handle.remove()
    assert ((cls - base).abs().amax(-1)[inputs[2].bool()] > 1e-5).all()


def test_decoder_loss_trains_the_encoder_through_the_cls():
    """The point of the bottleneck: the decoder's loss must reach the encoder (via CLS only)."""
    model = make_model()
    model(*corrupted_pair(seed=4)).dec_mlm_loss.backward()
    for layer in (model.lm.bert.encoder.layer[0], model.lm.bert.encoder.layer[-1]):
        # Encoder layers reach the decoder only through the CLS (its embeddings are shared, its layers not).
        assert layer.attention.self.query.weight.grad.abs().sum() > 0


def test_padding_is_invisible_to_encoder_and_decoder():
    model = make_model()
    enc_ids, dec_ids, mask, labels, _ = corrupted_pair(seed=2)
    assert (mask == 0).any()
    base = model(enc_ids, dec_ids, mask, labels, labels)
    pad = mask == 0
    noise = torch.randint(5, V, (2, int(pad.sum())), generator=torch.Generator().manual_seed(9))
    enc_ids, dec_ids = enc_ids.clone(), dec_ids.clone()
    enc_ids[pad], dec_ids[pad] = noise[0], noise[1]
    other = model(enc_ids, dec_ids, mask, labels, labels)
    torch.testing.assert_close(other.loss, base.loss, rtol=0, atol=1e-5)


# -- loss -------------------------------------------------------------------------------------


def test_loss_is_encoder_ce_plus_decoder_ce():
    model = make_model()
    enc_ids, dec_ids, mask, labels, _ = corrupted_pair(seed=3)
    dec_states, out = decoder_output(model, enc_ids, dec_ids, mask, labels, labels)
    with torch.no_grad():
        enc_states = model.lm.bert(input_ids=enc_ids, attention_mask=mask).last_hidden_state

        def ce(states):
            return F.cross_entropy(model.lm.cls(states).view(-1, V), labels.view(-1), ignore_index=IGNORE_INDEX)

        enc_ref, dec_ref = ce(enc_states), ce(dec_states)
    torch.testing.assert_close(out.enc_mlm_loss, enc_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.dec_mlm_loss, dec_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, enc_ref + dec_ref, rtol=0, atol=1e-5)
    assert abs(enc_ref - dec_ref) > 1e-3


def test_method_loss_uses_the_sampled_views(generator_dir):
    method = make_method(generator_dir)
    model = make_model()
    batch = small_batch(method, seed=6, batch_size=6, seq_len=32)
    loss, extra = method.loss(model, batch)
    enc_ids, dec_ids = method.corrupt(batch)
    with torch.no_grad():
        ref = model(enc_ids, dec_ids, batch["attention_mask"], batch["enc_labels"], batch["dec_labels"])
    torch.testing.assert_close(loss.detach(), ref.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(extra["enc_mlm_loss"], ref.enc_mlm_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(extra["dec_mlm_loss"], ref.dec_mlm_loss, rtol=0, atol=1e-6)
    eligible = (batch["enc_labels"] != IGNORE_INDEX).sum()
    assert extra["enc_replace_rate"].item() == pytest.approx(batch["enc_selected"].sum().item() / eligible.item())
    assert extra["dec_replace_rate"].item() == pytest.approx(batch["dec_selected"].sum().item() / eligible.item())
    assert 0 < extra["enc_replace_rate"] < extra["dec_replace_rate"] < 1
    assert not any(v.requires_grad for v in extra.values())


# -- configuration errors -----------------------------------------------------------------------


def test_missing_generator_is_a_clear_error(tmp_path):
    for path in ("", str(tmp_path / "nope")):
        with pytest.raises(FileNotFoundError, match="jobs/pretrain.py --method mlm"):
            SimLMMethod(SimLMConfig(generator=path), tiny_masking_vocab())


def test_generator_vocab_mismatch_is_a_clear_error(tmp_path):
    tiny_mlm(V + 3, num_layers=1).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=f"vocab_size {V + 3}.*{V}"):
        SimLMMethod(SimLMConfig(generator=str(tmp_path)), tiny_masking_vocab())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(encoder_mask_rate=0.6), "need 0 < encoder_mask_rate"),
        (dict(decoder_mask_rate=1.0), "need 0 < encoder_mask_rate"),
        (dict(encoder_mask_rate=0.0), "need 0 < encoder_mask_rate"),
        (dict(generator_temperature=0.0), "generator_temperature must be > 0"),
    ],
)
def test_bad_rates_are_rejected(generator_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_method(generator_dir, **overrides)


# -- export, generator from an MLM export, continued pre-training -------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An MLM export (the generator) and a SimLM export, on a real tokenizer's vocabulary."""
    root = tmp_path_factory.mktemp("simlm")
    tok_dir = str(root / "tokenizer")
    tok = make_tokenizer_dir(tok_dir)
    vocab = MaskingVocab.from_tokenizer(tok)
    torch.manual_seed(1)
    mlm_method = MLMMethod(MLMConfig(), vocab)
    small = mlm_method.build(build_mlm(tiny_backbone_config(num_layers=1), len(tok))).eval()
    generator_dir = mlm_method.export(small, str(root / "mlm"), tok_dir)["export_dir"]

    method = SimLMMethod(SimLMConfig(generator=generator_dir), vocab)
    torch.manual_seed(0)
    model = method.build(build_mlm(tiny_backbone_config(), len(tok))).eval()
    with torch.no_grad():  # as if trained: a reloaded decoder must come from the file, not a fresh copy
        for p in model.decoder.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    paths = method.export(model, str(root / "simlm"), tok_dir)
    return SimpleNamespace(tok=tok, vocab=vocab, small=small, method=method, model=model, paths=paths)


def test_mlm_export_serves_as_the_generator(exported):
    gen = exported.method.generator
    ids, mask = tokenized_batch(exported.tok)
    with torch.no_grad():
        torch.testing.assert_close(
            gen(input_ids=ids, attention_mask=mask).logits,
            exported.small.lm(input_ids=ids, attention_mask=mask).logits,
            rtol=0,
            atol=1e-5,
        )


def test_export_is_a_drop_in_bert_plus_a_decoder_file(exported):
    model, paths = exported.model, exported.paths
    assert paths == {"export_dir": paths["export_dir"], "head_path": os.path.join(paths["export_dir"], DECODER_FILE)}
    ids, mask = tokenized_batch(exported.tok)
    with torch.no_grad():
        cls = model(ids, ids, mask, torch.full_like(ids, IGNORE_INDEX), torch.full_like(ids, IGNORE_INDEX)).enc_cls
    assert_drop_in_bert(paths["export_dir"], ids, mask, cls)
    from safetensors import safe_open

    with safe_open(paths["head_path"], framework="pt") as f:
        assert set(f.keys()) == set(model.decoder.state_dict())


def test_decoder_reload_and_continued_pretraining(exported):
    paths = exported.paths
    method = SimLMMethod(
        SimLMConfig(generator=exported.method.cfg.generator, decoder=paths["head_path"]), exported.vocab
    )
    resumed = method.build(AutoModelForMaskedLM.from_pretrained(paths["export_dir"]))
    saved = exported.model.decoder.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in resumed.decoder.state_dict().items())
    fresh = SimLM(AutoModelForMaskedLM.from_pretrained(paths["export_dir"]))
    assert not torch.equal(fresh.decoder[0].output.dense.weight, saved["0.output.dense.weight"])

    ids, mask = tokenized_batch(exported.tok)
    batch = method.corrupt_batch(ids, mask, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    for _ in range(2):
        loss, extra = method.loss(resumed.train(), batch)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in extra.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(resumed.decoder[0].output.dense.weight, saved["0.output.dense.weight"])


def test_mismatched_decoder_files_are_rejected(exported, tmp_path):
    export_dir = exported.paths["export_dir"]
    for n in (1, 3):
        method = SimLMMethod(
            SimLMConfig(
                generator=exported.method.cfg.generator, n_decoder_layers=n, decoder=exported.paths["head_path"]
            ),
            exported.vocab,
        )
        with pytest.raises(ValueError, match="n_decoder_layers"):
            method.build(AutoModelForMaskedLM.from_pretrained(export_dir))
    # A Condenser head has the same layer keys and shapes: only the method tag tells it apart.
    condenser = Condenser(AutoModelForMaskedLM.from_pretrained(export_dir), n_head_layers=2)
    head_path = condenser.save(str(tmp_path))["head_path"]
    with pytest.raises(ValueError, match="method"):
        SimLM(AutoModelForMaskedLM.from_pretrained(export_dir)).load_decoder(head_path)
