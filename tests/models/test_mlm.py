"""Plain MLM pre-training (models.mlm) on a tiny random BERT: batches, loss, export."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from models.backbone import build_mlm
from models.masking import IGNORE_INDEX, MaskingVocab
from models.mlm import MaskedLM, MLMConfig, MLMMethod
from tests.helpers import (
    MASK_ID,
    assert_drop_in_bert,
    make_tokenizer_dir,
    random_word_batch,
    tiny_backbone_config,
    tiny_masking_vocab,
    tiny_mlm,
    tiny_vocab,
)
from tests.models.test_condenser import tokenized_batch

V = len(tiny_vocab())


def test_make_batch_masks_whole_words_at_the_configured_rate():
    wb = random_word_batch(100, 64, seed=2)
    method = MLMMethod(MLMConfig(mlm_probability=0.4), tiny_masking_vocab())
    batch = method.corrupt_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(0))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    labelled = batch["labels"] != IGNORE_INDEX
    starts = [(b, s, e) for b, row in enumerate(wb.words) for s, e in row]
    rate = sum(bool(labelled[b, s]) for b, s, _ in starts) / len(starts)
    assert abs(rate - 0.4) < 0.03, rate
    assert all(bool(labelled[b, s:e].all()) == bool(labelled[b, s]) for b, s, e in starts)
    assert torch.equal(batch["labels"][labelled], wb.input_ids[labelled])
    assert torch.equal(batch["input_ids"][~labelled], wb.input_ids[~labelled])
    assert (batch["input_ids"][labelled] == MASK_ID).float().mean() > 0.7  # 80/10/10, not all kept


def test_loss_equals_hf_masked_lm_loss():
    # initializer_range 0.2: far-from-uniform logits, so a wrong position set changes the loss.
    mlm = tiny_mlm(V, initializer_range=0.2).eval()
    method = MLMMethod(MLMConfig(mlm_probability=0.3), tiny_masking_vocab())
    wb = random_word_batch(4, 24, seed=1)
    batch = method.corrupt_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(1))
    loss, extra = method.loss(method.build(mlm), batch)
    with torch.no_grad():
        reference = mlm(**batch).loss  # full logits, HF's own CE with ignore_index -100
    torch.testing.assert_close(loss.detach(), reference, rtol=0, atol=1e-5)
    assert extra == {}


def test_a_batch_with_nothing_masked_gives_every_parameter_a_zero_gradient():
    """Not none: under ZeRO-2, a worker without the MLM projection's gradients would reduce
    other buckets than its peers (a gloo abort, seen with 1-row micro-batches)."""
    from models.mlm_losses import sequence_mlm_losses

    model = MLMMethod(MLMConfig(), tiny_masking_vocab()).build(tiny_mlm(V))
    wb = random_word_batch(2, 16, seed=3)
    labels = torch.full_like(wb.input_ids, IGNORE_INDEX)
    loss = model(wb.input_ids, wb.attention_mask, labels)
    states = model.lm.bert(wb.input_ids, wb.attention_mask).last_hidden_state
    per_sequence = sequence_mlm_losses(model.lm, states, labels)
    assert loss.item() == 0.0 and per_sequence.tolist() == [0.0, 0.0]
    (loss + per_sequence.sum()).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(not p.grad.any() for p in model.parameters())


def test_training_steps_lower_the_loss():
    method = MLMMethod(MLMConfig(mlm_probability=0.3), tiny_masking_vocab())
    model = method.build(tiny_mlm(V))
    wb = random_word_batch(8, 32, seed=3)
    batch = method.corrupt_batch(wb.input_ids, wb.attention_mask, torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = method.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    # A thin wrapper: the trained parameters are exactly the BERT MLM's.
    assert isinstance(model, MaskedLM) and list(model.children()) == [model.lm]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    tok_dir, out_dir = str(root / "tokenizer"), str(root / "export")
    tok = make_tokenizer_dir(tok_dir)
    torch.manual_seed(0)
    method = MLMMethod(MLMConfig(), MaskingVocab.from_tokenizer(tok))
    model = method.build(build_mlm(tiny_backbone_config(), len(tok))).eval()
    return model, tok, method.export(model, out_dir, tok_dir)


def test_export_is_a_drop_in_bert_with_its_mlm_head(exported):
    model, tok, paths = exported
    assert paths == {"export_dir": paths["export_dir"]} and os.path.isdir(paths["export_dir"])
    ids, mask = tokenized_batch(tok)
    with torch.no_grad():
        cls = model.lm.bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        assert_drop_in_bert(paths["export_dir"], ids, mask, cls)
        reloaded = AutoModelForMaskedLM.from_pretrained(paths["export_dir"]).eval()
        torch.testing.assert_close(
            reloaded(input_ids=ids, attention_mask=mask).logits,
            model.lm(input_ids=ids, attention_mask=mask).logits,
            rtol=0,
            atol=1e-5,
        )
    assert AutoTokenizer.from_pretrained(paths["export_dir"]).get_vocab() == tok.get_vocab()
    assert not any(n.endswith(".bin") for n in os.listdir(paths["export_dir"]))


def test_a_compiled_training_step_gives_the_eager_loss_and_gradients():
    """``--train.compile``: the module's blocks compiled in place (what the loop does before
    DeepSpeed wraps it) give the eager step's loss and gradients. Shapes are static until
    one changes: the second batch width compiles the blocks once more, with dynamic shapes,
    and a third width reuses those graphs."""
    import numpy as np

    from models.compiled import compile_in_place
    from models.method import PlainEngine

    def steps(compiled: bool) -> list:
        method = MLMMethod(MLMConfig(), tiny_masking_vocab())
        model = method.build(tiny_mlm(seed=1, num_layers=2))
        if compiled:
            compile_in_place(model, blocks=True)
            compile_in_place(model, blocks=True)  # a second call leaves it as it is
            # The embeddings and each layer, not the whole model with its loss.
            compiled_now = [type(m).__name__ for m in model.modules() if m._compiled_call_impl is not None]
            assert sorted(compiled_now) == ["BertEmbeddings", "BertLayer", "BertLayer"], compiled_now
        rng, out = np.random.default_rng(0), []
        for width in (16, 24, 20):
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            arrays = {"input_ids": rng.integers(5, len(tiny_vocab()), (4, width)), "length": np.full(4, width)}
            batch = method.make_batch(arrays, torch.Generator().manual_seed(0))
            model.zero_grad()
            loss, _ = method.backward(PlainEngine(model), batch)
            out.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        return out, list(model.state_dict())

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs: list[int] = []
    (eager, eager_keys), (compiled, compiled_keys) = steps(False), steps(True)
    graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[:4] == [0, 0, 0, 0] and graphs[4] > 0  # eager compiles nothing; compiled, at its first width
    assert graphs[5] > graphs[4]  # the second width: dynamic graphs
    assert graphs[6] == graphs[5]  # the third reuses them
    assert compiled_keys == eager_keys  # checkpoints and exports keep their keys
    for (loss, grads), (loss_c, grads_c) in zip(eager, compiled):
        assert loss_c == pytest.approx(loss, rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-6, msg=name)
