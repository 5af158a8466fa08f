"""Packed sequences (models/packing.py): the layout, and coCondenser's losses and gradients
from packed span pairs against the same spans padded, one to a row."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import RobertaConfig, RobertaForMaskedLM

from models.cocondenser import CoCondenserConfig, CoCondenserMethod
from models.condenser import Condenser
from models.grad_cache import fitting_chunk
from models.memory import saved_bytes
from models.method import PlainEngine
from models.packing import first_fit_decreasing, pack
from tests.helpers import CLS_ID, PAD_ID, SEP_ID, tiny_bert_config, tiny_masking_vocab, tiny_mlm, tiny_vocab


def span_pairs(n_pairs: int, seed: int, longest: int = 22) -> dict[str, np.ndarray]:
    """Span pairs as the stream frames them: (b, 2, L) ``[CLS] span [SEP] [PAD]*``, the two
    spans of a pair of one length, lengths spread from 2 to ``longest`` real tokens."""
    rng = np.random.default_rng(seed)
    width = longest + 2
    ids = np.full((n_pairs, 2, width), PAD_ID, np.int32)
    lengths = np.zeros((n_pairs, 2), np.int32)
    words = np.arange(5, len(tiny_vocab()))
    for p in range(n_pairs):
        n = int(rng.integers(2, longest + 1))
        for s in range(2):
            ids[p, s, : n + 2] = [CLS_ID, *rng.choice(words, n), SEP_ID]
            lengths[p, s] = n + 2
    return {"input_ids": ids, "length": lengths}


# -- the layout -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_decreasing_places_every_sequence_without_overlap(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 33, size=int(rng.integers(1, 60)))
    row, offset = first_fit_decreasing(lengths, 32)
    used = {}
    for i, (r, o, n) in enumerate(zip(row, offset, lengths)):
        assert 0 <= o and o + n <= 32
        cells = {(int(r), c) for c in range(o, o + n)}
        assert not cells & set(used), f"sequence {i} overlaps another"
        used.update(dict.fromkeys(cells, i))
    # No row could have taken a later row's first sequence when it was placed: at worst
    # the rows are those first-fit decreasing makes, never more than twice the optimum.
    assert row.max() + 1 <= 2 * -(-lengths.sum() // 32)
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing(np.array([33]), 32)


def test_pack_keeps_every_token_with_its_sequence():
    pairs = span_pairs(9, seed=1)
    method = CoCondenserMethod(CoCondenserConfig(span_length=22, pack_width=48, chunk_size=6), tiny_masking_vocab())
    padded = CoCondenserMethod(CoCondenserConfig(span_length=22, pack_spans=False, chunk_size=6), tiny_masking_vocab())
    packed = method.make_batch(pairs, torch.Generator().manual_seed(0))
    reference = padded.make_batch(pairs, torch.Generator().manual_seed(0))
    lengths = pairs["length"].reshape(-1)
    assert packed["input_ids"].shape[1] == 48
    assert int((packed["segments"] > 0).sum()) == lengths.sum()
    # Chunks of 6 spans, packed apart: 18 spans in 3 chunks, rows contiguous.
    assert [c[2:] for c in packed["chunks"]] == [(0, 6), (6, 12), (12, 18)]
    assert packed["chunks"][0][0] == 0 and packed["chunks"][-1][1] == packed["input_ids"].shape[0]
    for first_row, end_row, first, end in packed["chunks"]:
        for span in range(first, end):
            flat = first_row * 48 + int(packed["cls_index"][span])
            n = int(lengths[span])
            taken = slice(flat, flat + n)
            # The same corrupted tokens and labels as the padded batch's row.
            assert packed["input_ids"].flatten()[taken].tolist() == reference["input_ids"][span, :n].tolist()
            assert packed["labels"].flatten()[taken].tolist() == reference["labels"][span, :n].tolist()
            assert packed["position_ids"].flatten()[taken].tolist() == list(range(n))
            assert set(packed["sequence_index"].flatten()[taken].tolist()) == {span - first}
            assert len(set(packed["segments"].flatten()[taken].tolist())) == 1
        rows = packed["segments"][first_row:end_row]
        assert int((packed["sequence_index"][first_row:end_row] >= 0).sum()) == lengths[first:end].sum()
        # Within a row, one segment number per sequence.
        for r in range(rows.shape[0]):
            seqs = packed["sequence_index"][first_row + r]
            for s in rows[r].unique().tolist():
                if s:
                    assert seqs[rows[r] == s].unique().numel() == 1


# -- the same losses and gradients --------------------------------------------------------


def bert():
    return tiny_mlm(seed=3, initializer_range=0.2)


def roberta():
    cfg = tiny_bert_config(initializer_range=0.2).to_dict()
    cfg.update(model_type="roberta", max_position_embeddings=64 + PAD_ID + 1)
    torch.manual_seed(3)
    return RobertaForMaskedLM(RobertaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))


def step(model_factory, attn: str, cfg: CoCondenserConfig, pairs: dict) -> tuple[dict, dict]:
    """One coCondenser backward of ``pairs`` from fresh weights: (logged values, gradients)."""
    mlm = model_factory()
    mlm.config._attn_implementation = attn
    method = CoCondenserMethod(cfg, tiny_masking_vocab())
    model = method.build(mlm)
    batch = method.make_batch(pairs, torch.Generator().manual_seed(7))
    loss, extras = method.backward(PlainEngine(model), batch)
    values = {"loss": float(loss), **{k: float(v) for k, v in extras.items()}}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return values, grads


@pytest.mark.parametrize("chunk_size", [0, 6])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_factory", [bert, roberta], ids=["bert", "roberta"])
def test_packed_spans_give_the_padded_spans_loss_and_gradients(model_factory, attn, chunk_size):
    pairs = span_pairs(8, seed=2)
    padded_values, padded_grads = step(
        model_factory, attn, CoCondenserConfig(head="", span_length=22, pack_spans=False, chunk_size=chunk_size), pairs
    )
    packed_values, packed_grads = step(
        model_factory, attn, CoCondenserConfig(head="", span_length=22, pack_width=64, chunk_size=chunk_size), pairs
    )
    assert packed_values == pytest.approx(padded_values, rel=1e-5, abs=1e-6)
    assert padded_values["contrastive_loss"] > 0.1 and padded_values["head_mlm_loss"] > 0.1
    assert set(packed_grads) == set(padded_grads)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("pack_spans", [True, False], ids=["packed", "padded"])
def test_the_caches_first_pass_runs_the_backbone_alone_and_the_replay_gives_its_late_cls(pack_spans):
    """coCondenser's gradient cache needs only the late CLS vectors in its first pass: the
    head and the MLM losses run once per chunk (in the replay), not twice, and under
    dropout the replay's vectors are the first pass's, bit for bit."""
    cfg = CoCondenserConfig(
        head="", span_length=22, chunk_size=6, pack_spans=pack_spans, pack_width=64 if pack_spans else 0
    )
    method = CoCondenserMethod(cfg, tiny_masking_vocab())
    model = method.build(tiny_mlm(seed=3, initializer_range=0.2, dropout=0.2)).train()
    first_pass, replays, head_calls = [], [], []
    late_cls, forward = model.late_cls, model.forward
    model.late_cls = lambda *a, **k: first_pass.append(late_cls(*a, **k)) or first_pass[-1]
    model.forward = lambda *a, **k: replays.append(forward(*a, **k)) or replays[-1]
    model.head[0].register_forward_hook(lambda *_: head_calls.append(1))
    batch = method.make_batch(span_pairs(8, seed=2), torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    method.backward(PlainEngine(model), batch)
    assert len(first_pass) == len(replays) == len(head_calls) == 3  # 16 spans in chunks of 6
    for first, replay in zip(first_pass, replays):
        assert torch.equal(first, replay.late_cls.detach())


@pytest.mark.parametrize("pack_spans", [True, False], ids=["packed", "padded"])
def test_the_gradient_cache_gives_the_whole_batchs_loss_and_gradients(pack_spans):
    width = {"pack_spans": pack_spans, "pack_width": 64 if pack_spans else 0}
    pairs = span_pairs(8, seed=2)
    whole = step(bert, "sdpa", CoCondenserConfig(head="", span_length=22, chunk_size=0, **width), pairs)
    cached = step(bert, "sdpa", CoCondenserConfig(head="", span_length=22, chunk_size=6, **width), pairs)
    assert cached[0] == pytest.approx(whole[0], rel=1e-5, abs=1e-6)
    assert set(cached[1]) == set(whole[1])
    for name, grad in whole[1].items():
        torch.testing.assert_close(cached[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_late_cls_is_each_span_alone():
    """A span's late CLS does not depend on the spans packed beside it."""
    model = Condenser(bert(), 2).eval()
    pairs = span_pairs(6, seed=4)
    ids = torch.as_tensor(pairs["input_ids"], dtype=torch.long).reshape(12, -1)
    lengths = torch.as_tensor(pairs["length"]).reshape(12)

    def late_cls(rows: list[int]) -> torch.Tensor:
        batch = {"input_ids": ids[rows], "labels": torch.full_like(ids[rows], -100)}
        packed = pack(batch, lengths[rows], 64)
        del packed["chunks"]
        return model(**packed, per_sequence=True).late_cls

    together = late_cls(list(range(12)))
    assert pack({"input_ids": ids, "labels": ids}, lengths, 64)["input_ids"].shape[0] < 12  # rows are shared
    for span in (0, 5, 11):
        torch.testing.assert_close(late_cls([span])[0], together[span], rtol=1e-5, atol=1e-5)
    # And what a row of its own gives, unpacked.
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    unpacked = model(ids, mask, torch.full_like(ids, -100), per_sequence=True).late_cls
    torch.testing.assert_close(together, unpacked, rtol=1e-5, atol=1e-5)


def test_a_family_that_cannot_pack_pads_instead_with_a_warning():
    method = CoCondenserMethod(CoCondenserConfig(head=""), tiny_masking_vocab())
    mlm = bert()
    mlm.config.model_type = "deberta-v2"  # only the adapter's answer matters here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        method.build(mlm)
    assert method.pack_width == 0
    assert any("cannot pack" in str(w.message) for w in caught)
    batch = method.make_batch(span_pairs(2, seed=0), torch.Generator().manual_seed(0))
    assert "attention_mask" in batch and "segments" not in batch


def test_a_row_narrower_than_a_span_is_refused():
    with pytest.raises(ValueError, match="pack_width 64 is narrower"):
        CoCondenserConfig(span_length=80, pack_width=64)
    assert CoCondenserConfig(span_length=80).packed_row_width == 128
    assert CoCondenserConfig(span_length=200).packed_row_width == 208
    assert CoCondenserConfig(span_length=80, pack_width=96).packed_row_width == 96
    assert CoCondenserConfig(span_length=80, pack_spans=False).packed_row_width == 0


# -- the gradient cache's chunk, sized from free memory -----------------------------------


def test_fitting_chunk_by_hand():
    assert fitting_chunk(per_item=10, fixed=100, available=1000, n_items=90) == 0  # 1000 fits all
    assert fitting_chunk(per_item=10, fixed=100, available=1000, n_items=91) == 90
    assert fitting_chunk(per_item=10, fixed=100, available=105, n_items=50) == 1  # never below one


def test_the_chunk_is_the_largest_whose_activations_fit():
    method = CoCondenserMethod(CoCondenserConfig(head="", span_length=22), tiny_masking_vocab())
    model = method.build(bert())
    # Memory for all 64 spans: no cache.
    assert method.fit_chunk(model, available_bytes=2**34, micro_batch_size=32) == 0
    assert method.make_batch(span_pairs(32, seed=0), torch.Generator())["chunks"][0][2:] == (0, 64)
    # Memory for about a dozen: chunks of that many, and the batches are packed by them.
    rng = np.random.default_rng(1)

    def activations(spans: int) -> int:
        arrays = {
            "input_ids": rng.choice(method.vocab.replacement_ids.numpy(), (spans // 2, 2, 24)).astype(np.int32),
            "length": np.full((spans // 2, 2), 24, np.int32),
        }
        batch = method.make_batch(arrays, torch.Generator().manual_seed(0))
        return saved_bytes(lambda: method._losses(model, batch, spans), model)

    method.chunk_size = 0
    sums = 4 * sum(p.numel() for p in model.parameters())
    budget = sums + activations(12) + 1
    chunk = method.fit_chunk(model, available_bytes=budget / 0.5, micro_batch_size=32)
    assert 8 <= chunk <= 12
    assert activations(chunk) + sums <= budget
    assert [c[3] - c[2] for c in method.make_batch(span_pairs(32, seed=0), torch.Generator())["chunks"]][0] == chunk
    assert all(p.grad is None for p in model.parameters())
    # A fixed chunk_size is kept as it is.
    fixed = CoCondenserMethod(CoCondenserConfig(head="", span_length=22, chunk_size=6), tiny_masking_vocab())
    assert fixed.fit_chunk(model, available_bytes=2**34, micro_batch_size=32) == 6


def test_the_worker_sizes_the_chunk_only_where_the_cache_can_run():
    from models.backbone import BackboneConfig
    from pipeline.training.pretrain import PretrainTask

    cfg = CoCondenserConfig(head="", span_length=22)
    task = PretrainTask("cocondenser", cfg, BackboneConfig(), "", len(tiny_vocab()))
    task.method = CoCondenserMethod(cfg, tiny_masking_vocab())
    engine = PlainEngine(task.method.build(bert()))
    assert task.fit_to_memory(engine, 2**34, micro_batch_size=32) == {"grad_cache_chunk": None, "free_memory_gib": 16.0}
    assert task.fit_to_memory(engine, 2**21, micro_batch_size=32)["grad_cache_chunk"] >= 1

    class Fp16(PlainEngine):
        def fp16_enabled(self) -> bool:
            return True

    task.method.chunk_size = 0
    assert task.fit_to_memory(Fp16(engine.module), 2**21, micro_batch_size=32) == {}
    assert task.method.chunk_size == 0  # no cache: fp16 could not run one
