"""Condenser head wiring, losses and export (models.condenser), on a tiny random BERT.

Models run in eval mode with dropout 0, so every comparison below is exact up to float
rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertForMaskedLM,
    BertModel,
)

from models.backbone import BackboneConfig, build_mlm
from models.condenser import Condenser, CondenserConfig, CondenserMethod
from models.masking import IGNORE_INDEX, MaskingVocab, whole_word_mask
from tests.helpers import (
    TINY_SIZES,
    make_tokenizer_dir,
    random_word_batch,
    tiny_backbone_config,
    tiny_masking_vocab,
    tiny_mlm,
    tiny_vocab,
)

V = len(tiny_vocab())
L = TINY_SIZES["num_layers"]


def make_model(skip_from: int = 0, n_head_layers: int = 2, seed: int = 0) -> Condenser:
    # initializer_range 0.2 (BERT: 0.02): a random tiny BERT then has far-from-uniform logits,
    # so the head and late losses (and any perturbation) differ clearly.
    model = Condenser(tiny_mlm(V, seed=seed, initializer_range=0.2), n_head_layers=n_head_layers, skip_from=skip_from)
    return model.eval()


def masked_batch(batch_size: int = 4, seq_len: int = 24, seed: int = 0, probability: float = 0.3):
    """(input_ids, attention_mask, labels) with padding in some rows and some masked words."""
    wb = random_word_batch(batch_size, seq_len, seed=seed, pad_rows=0.5)
    wb.attention_mask[0, seq_len // 2 :] = 0  # at least one padded row
    wb.input_ids[0, seq_len // 2 :] = 0
    wb.input_ids[0, seq_len // 2 - 1] = 3
    ids, labels = whole_word_mask(wb.input_ids, tiny_masking_vocab(), torch.Generator().manual_seed(seed), probability)
    assert (labels != IGNORE_INDEX).sum() >= 4
    return ids, wb.attention_mask, labels


class Capture:
    """Forward (pre-)hooks recording a module's first input or its output."""

    def __init__(self):
        self.value = None
        self.handles = []

    def input_of(self, module):
        def hook(mod, args, kwargs):
            self.value = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def output_of(self, module):
        def hook(mod, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.value = out.detach().clone()

        self.handles.append(module.register_forward_hook(hook))
        return self

    def remove(self):
        for h in self.handles:
            h.remove()


def perturb_output(module, positions: slice, scale: float = 1.0, seed: int = 0):
    """Add noise to ``module``'s output at sequence ``positions`` (a BertLayer returns a tensor
    in transformers 5; a tuple in 4.x)."""

    def hook(mod, args, output):
        out = output[0] if isinstance(output, tuple) else output
        noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * scale
        keep = torch.zeros_like(out)
        keep[:, positions] = 1.0
        out = out + noise * keep
        return (out,) + tuple(output[1:]) if isinstance(output, tuple) else out

    return module.register_forward_hook(hook)


def head_output(model, ids, mask, labels):
    cap = Capture().output_of(model.head[-1])
    try:
        with torch.no_grad():
            out = model(ids, mask, labels)
    finally:
        cap.remove()
    return cap.value, out


# -- head wiring -------------------------------------------------------------------------------


def test_default_skip_from_is_half_the_layers():
    assert make_model().skip_from == L // 2
    assert Condenser(tiny_mlm(V, num_layers=6), skip_from=0).skip_from == 3
    assert CondenserMethod(CondenserConfig(), tiny_masking_vocab()).build(tiny_mlm(V)).skip_from == L // 2


@pytest.mark.parametrize("skip_from", [0, 1, 3])
def test_head_input_is_late_cls_then_early_tokens(skip_from):
    model = make_model(skip_from)
    k = skip_from or L // 2
    ids, mask, labels = masked_batch()
    cap = Capture().input_of(model.head[0])
    with torch.no_grad():
        out = model(ids, mask, labels)
        ref = model.lm.bert(input_ids=ids, attention_mask=mask, output_hidden_states=True, return_dict=True)
    cap.remove()
    hidden = ref.hidden_states
    assert len(hidden) == L + 1
    head_in = cap.value
    assert head_in.shape == ref.last_hidden_state.shape
    torch.testing.assert_close(head_in[:, 0], ref.last_hidden_state[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(head_in[:, 1:], hidden[k][:, 1:], rtol=0, atol=1e-6)
    # The layers differ, so the check above pins down the layer (not just "some" layer).
    for j in range(L + 1):
        if j != k:
            assert (hidden[j][:, 1:] - head_in[:, 1:]).abs().max() > 1e-3
    torch.testing.assert_close(out.late_cls, ref.last_hidden_state[:, 0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("skip_from", [5, 4, -1])
def test_skip_from_must_split_the_layers(skip_from):
    with pytest.raises(ValueError, match=f"skip_from={skip_from} must split 4 layers into non-empty groups"):
        Condenser(tiny_mlm(V), skip_from=skip_from)


@pytest.mark.parametrize("skip_from", [0, 1, 3])
def test_only_the_late_cls_reaches_the_head(skip_from):
    model = make_model(skip_from)
    ids, mask, labels = masked_batch()
    base, base_out = head_output(model, ids, mask, labels)
    last = model.lm.bert.encoder.layer[-1]

    handle = perturb_output(last, slice(1, None))
    try:
        tokens, tokens_out = head_output(model, ids, mask, labels)
    finally:
        handle.remove()
    # The perturbation took effect on the late layer (its MLM loss moved) ...
    assert abs(tokens_out.late_mlm_loss - base_out.late_mlm_loss) > 1e-4
    torch.testing.assert_close(tokens_out.late_cls, base_out.late_cls, rtol=0, atol=0)
    # ... but the head never sees late non-CLS tokens.
    assert torch.equal(tokens, base)
    assert torch.equal(tokens_out.head_mlm_loss, base_out.head_mlm_loss)

    handle = perturb_output(last, slice(0, 1))
    try:
        cls, cls_out = head_output(model, ids, mask, labels)
    finally:
        handle.remove()
    assert (cls_out.late_cls - base_out.late_cls).abs().max() > 0.1
    # Every head position (all attend to position 0) moves with the late CLS.
    valid = mask.bool()
    assert ((cls - base).abs().amax(-1)[valid] > 1e-5).all()


def test_padding_is_invisible_to_the_head():
    model = make_model()
    ids, mask, labels = masked_batch()
    assert (mask == 0).any()
    base, base_out = head_output(model, ids, mask, labels)
    noisy_ids = ids.clone()
    noisy_ids[mask == 0] = torch.randint(5, V, (int((mask == 0).sum()),), generator=torch.Generator().manual_seed(1))
    other, other_out = head_output(model, noisy_ids, mask, labels)
    valid = mask.bool()
    torch.testing.assert_close(other[valid], base[valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(other_out.loss, base_out.loss, rtol=0, atol=1e-5)


# -- losses ------------------------------------------------------------------------------------


def reference_losses(model, ids, mask, labels):
    head_states, out = head_output(model, ids, mask, labels)
    with torch.no_grad():
        late = model.lm.bert(input_ids=ids, attention_mask=mask).last_hidden_state

        def ce(states):
            logits = model.lm.cls(states)
            assert logits.shape[-1] == V
            return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=IGNORE_INDEX)

        return ce(head_states), ce(late), out


@pytest.mark.parametrize("skip_from", [0, 1])
def test_loss_is_head_mlm_plus_late_mlm(skip_from):
    model = make_model(skip_from)
    ids, mask, labels = masked_batch(seed=3)
    head_ref, late_ref, out = reference_losses(model, ids, mask, labels)
    torch.testing.assert_close(out.head_mlm_loss, head_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.late_mlm_loss, late_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, head_ref + late_ref, rtol=0, atol=1e-5)
    # Two different terms, not one counted twice: the means differ by far more than the tolerance.
    assert abs(head_ref - late_ref) > 1e-3


def test_method_loss_matches_model():
    model = make_model()
    method = CondenserMethod(CondenserConfig(), tiny_masking_vocab())
    ids, mask, labels = masked_batch(seed=4)
    loss, metrics = method.loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    head_ref, late_ref, _ = reference_losses(model, ids, mask, labels)
    torch.testing.assert_close(loss.detach(), head_ref + late_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics["head_mlm_loss"], head_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics["late_mlm_loss"], late_ref, rtol=0, atol=1e-5)


def test_both_losses_share_the_tied_projection():
    model = make_model()
    lm = model.lm
    emb = lm.bert.embeddings.word_embeddings.weight
    assert lm.cls.predictions.decoder.weight.data_ptr() == emb.data_ptr()

    # No other vocab-sized projection anywhere in the model (head included).
    vocab_linears = [
        name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.out_features == V
    ]
    assert vocab_linears == ["lm.cls.predictions.decoder"]
    vocab_params = {p.data_ptr() for p in model.parameters() if V in p.shape}
    assert vocab_params == {emb.data_ptr(), lm.cls.predictions.bias.data_ptr()}
    assert not any(V in p.shape for p in model.head.parameters())

    ids, mask, labels = masked_batch(seed=5)
    dense = lm.cls.predictions.transform.dense.weight
    for part in ("head_mlm_loss", "late_mlm_loss"):
        model.zero_grad(set_to_none=True)
        getattr(model(ids, mask, labels), part).backward()
        assert dense.grad is not None and dense.grad.abs().sum() > 0, part
        assert emb.grad is not None and emb.grad.abs().sum() > 0, part
        head_grads = [p.grad for p in model.head.parameters()]
        if part == "head_mlm_loss":
            assert all(g is not None for g in head_grads) and sum(g.abs().sum() for g in head_grads) > 0
        else:  # the late loss does not train the head
            assert all(g is None or not g.any() for g in head_grads)


def test_nothing_masked_gives_zero_loss_and_zero_gradient():
    model = make_model()
    model.train()  # gradient path as in training (dropout is 0 anyway)
    ids, mask, _ = masked_batch()
    labels = torch.full_like(ids, IGNORE_INDEX)
    out = model(ids, mask, labels)
    for value in (out.loss, out.head_mlm_loss, out.late_mlm_loss):
        assert torch.isfinite(value) and value.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(not g.isnan().any() for g in grads)
    assert all(not g.any() for g in grads)


# -- export and continued pre-training ---------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A Condenser on a real tokenizer's vocabulary, saved with ``model.save``."""
    root = tmp_path_factory.mktemp("condenser")
    tok_dir, out_dir = str(root / "tokenizer"), str(root / "export")
    tok = make_tokenizer_dir(tok_dir)
    torch.manual_seed(0)
    model = Condenser(build_mlm(tiny_backbone_config(), len(tok))).eval()
    paths = model.save(out_dir, tok_dir)
    return model, tok, paths


def tokenized_batch(tok):
    enc = tok(["the playing model searched for the city", "a film"], padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()
    return enc["input_ids"], enc["attention_mask"]


def test_export_is_a_drop_in_bert(exported):
    model, tok, paths = exported
    out_dir = paths["export_dir"]
    ids, mask = tokenized_batch(tok)
    labels = torch.full_like(ids, IGNORE_INDEX)
    with torch.no_grad():
        late_cls = model(ids, mask, labels).late_cls
        late_states, _ = model.backbone_states(ids, mask)

        bert = AutoModel.from_pretrained(out_dir).eval()
        assert type(bert) is BertModel
        cls = bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        assert (cls - late_cls).abs().max() < 1e-5
        assert (cls - late_states[:, 0]).abs().max() < 1e-5

        mlm = AutoModelForMaskedLM.from_pretrained(out_dir).eval()
        assert type(mlm) is BertForMaskedLM
        torch.testing.assert_close(
            mlm(input_ids=ids, attention_mask=mask).logits,
            model.lm(input_ids=ids, attention_mask=mask).logits,
            rtol=0,
            atol=1e-5,
        )
        assert mlm.cls.predictions.decoder.weight.data_ptr() == mlm.bert.embeddings.word_embeddings.weight.data_ptr()

    reloaded = AutoTokenizer.from_pretrained(out_dir)
    assert reloaded.get_vocab() == tok.get_vocab()
    assert reloaded("the playing model")["input_ids"] == tok("the playing model")["input_ids"]

    # The backbone carries no head weights; the head is a separate safetensors file.
    assert any(n.endswith(".safetensors") for n in os.listdir(out_dir))
    assert not any(n.endswith(".bin") for n in os.listdir(out_dir))
    from safetensors import safe_open
    from safetensors.torch import load_file

    backbone_keys = set()
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors") and name != os.path.basename(paths["head_path"]):
            backbone_keys |= set(load_file(os.path.join(out_dir, name)))
    assert backbone_keys and not any(k.startswith("head") for k in backbone_keys)

    head_path = paths["head_path"]
    assert head_path.endswith(".safetensors") and os.path.isfile(head_path)
    with safe_open(head_path, framework="pt") as f:  # raises on a pickle / non-safetensors file
        assert set(f.keys()) == set(model.head.state_dict())


def test_head_reload_and_continued_pretraining(exported):
    model, tok, paths = exported
    vocab = MaskingVocab.from_tokenizer(tok)
    method = CondenserMethod(CondenserConfig(head=paths["head_path"]), vocab)
    torch.manual_seed(123)  # a different seed: the head must come from the file, not the init
    resumed = method.build(AutoModelForMaskedLM.from_pretrained(paths["export_dir"]))
    assert resumed.skip_from == model.skip_from and len(resumed.head) == len(model.head)
    saved = model.head.state_dict()
    for name, value in resumed.head.state_dict().items():
        assert torch.equal(value, saved[name]), name

    fresh = CondenserMethod(CondenserConfig(), vocab).build(AutoModelForMaskedLM.from_pretrained(paths["export_dir"]))
    assert not torch.equal(fresh.head[0].attention.self.query.weight, saved["0.attention.self.query.weight"])

    resumed.train()
    ids, mask = tokenized_batch(tok)
    batch = method.corrupt_batch(ids, mask, torch.Generator().manual_seed(0))
    if not (batch["labels"] != IGNORE_INDEX).any():  # tiny batch: make sure something is masked
        batch = CondenserMethod(CondenserConfig(mlm_probability=0.5), vocab).corrupt_batch(
            ids, mask, torch.Generator().manual_seed(0)
        )
    assert (batch["labels"] != IGNORE_INDEX).any()
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in resumed.head.state_dict().items()}
    for _ in range(2):
        loss, metrics = method.loss(resumed, batch)
        assert torch.isfinite(loss) and loss.item() > 0
        assert all(torch.isfinite(v) for v in metrics.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = resumed.head.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), set(before) - set(changed)


@pytest.mark.parametrize(
    "cfg",
    [
        CondenserConfig(n_head_layers=1),
        CondenserConfig(n_head_layers=3),
        CondenserConfig(skip_from=1),
        CondenserConfig(skip_from=3),
    ],
)
def test_head_with_other_shape_is_rejected(exported, cfg):
    _, tok, paths = exported
    cfg.head = paths["head_path"]
    method = CondenserMethod(cfg, MaskingVocab.from_tokenizer(tok))
    with pytest.raises(ValueError, match=r"head (has \d+ layers, model expects|was trained with skip_from=)"):
        method.build(AutoModelForMaskedLM.from_pretrained(paths["export_dir"]))


def test_build_mlm_from_local_checkpoint(exported):
    model, tok, paths = exported
    out_dir = paths["export_dir"]
    mlm = build_mlm(BackboneConfig(init=out_dir), len(tok))
    assert isinstance(mlm, BertForMaskedLM)
    assert torch.equal(mlm.bert.embeddings.word_embeddings.weight, model.lm.bert.embeddings.word_embeddings.weight)

    with pytest.raises(ValueError, match="vocab"):
        build_mlm(BackboneConfig(init=out_dir), len(tok) + 7)
    with pytest.raises(FileNotFoundError, match="not a local checkpoint directory"):
        build_mlm(BackboneConfig(init=os.path.join(out_dir, "does-not-exist")), len(tok))


def test_head_is_initialised_like_bert():
    model = Condenser(tiny_mlm(V, seed=0), n_head_layers=3)
    std = model.config.initializer_range
    assert len(model.head) == 3
    for name, p in model.head.named_parameters():
        if "LayerNorm" in name:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name
        elif name.endswith("bias"):
            assert not p.any(), name
        else:
            assert abs(p.std().item() - std) < 0.15 * std and abs(p.mean().item()) < 0.1 * std, name
    # Fresh layers, not copies of the backbone's.
    assert not torch.equal(
        model.head[0].attention.self.query.weight, model.lm.bert.encoder.layer[-1].attention.self.query.weight
    )
