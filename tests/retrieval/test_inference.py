"""The inference helper the encoder and the pair scorer share."""

import numpy as np
import pytest
import torch

from pipeline.retrieval.inference import (
    check_finite,
    inference,
    inference_dtype,
    length_sorted_batches,
    made_in,
    on_device,
    overlapped,
    resolved_precision,
)


def test_batches_are_longest_first_ties_in_order_and_cover_every_item_once():
    lengths = [3, 9, 3, 1, 9, 5, 3]
    batches = list(length_sorted_batches(lengths, 3))
    assert [b.tolist() for b in batches] == [[1, 4, 5], [0, 2, 6], [3]]
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    assert list(length_sorted_batches([], 4)) == []


def test_a_token_budget_gives_long_items_fewer_rows_a_batch():
    lengths = [10, 3, 10, 4, 2, 8, 25]
    batches = [b.tolist() for b in length_sorted_batches(lengths, 3, max_tokens=20)]
    # 25 alone (one row however long), then 2 rows of 10, 2 of <= 8, and 3 short ones.
    assert batches == [[6], [0, 2], [5, 3], [1, 4]]
    assert all(len(b) * lengths[b[0]] <= 20 for b in batches[1:])
    # The same order as without a budget: only the cuts move.
    flat = [i for b in batches for i in b]
    assert flat == [i for b in length_sorted_batches(lengths, 3) for i in b.tolist()]


def test_each_next_batch_is_launched_before_the_last_ones_output_is_read():
    """The order that lets a GPU run one batch while the host frames the next: forward(b)
    comes before the output of b - 1 is handed back, and every output comes back once, in
    order, as fp32 numpy."""
    calls = []

    def forward(batch):
        calls.append(f"forward {batch}")
        return torch.full((2, 3), float(batch), dtype=torch.float16)

    for batch, output in overlapped(iter([1, 2, 3]), forward):
        calls.append(f"output {batch}")
        assert output.dtype == np.float32 and (output == batch).all()
    assert calls == ["forward 1", "forward 2", "output 1", "forward 3", "output 2", "output 3"]
    assert list(overlapped([], forward)) == []


def test_inputs_stay_as_they_are_on_a_cpu():
    batch = {"ids": torch.arange(6).reshape(2, 3), "mask": torch.ones(2, 3, dtype=torch.long)}
    moved = on_device(batch, "cpu")
    assert moved.keys() == batch.keys() and all(torch.equal(moved[k], batch[k]) for k in batch)


def test_precision_settings_per_device_and_model_size():
    # auto, as measured (H100, 2026-11-27: BERT-base held in fp16 2.5x fp32): fp16 on GPUs,
    # fp32 on CPUs, for every model size.
    for hidden in (384, 768, 1024):
        for device in ("cuda:0", "cuda"):
            assert inference_dtype("auto", device, hidden) == torch.float16
            assert resolved_precision("auto", device, hidden) == "fp16"
            assert made_in("auto", device, hidden) == made_in("fp16", device, hidden)
        assert inference_dtype("auto", "cpu", hidden) == torch.float32
        assert made_in("auto", "cpu", hidden) == {"precision": "fp32"}  # as recorded before half weights
    # A named precision is what it says, on any device and model.
    assert inference_dtype("fp32", "cuda:0", 768) == torch.float32 and resolved_precision("bf16", "cpu", 384) == "bf16"
    assert (
        inference_dtype("bf16", "cpu", 384) == torch.bfloat16 and inference_dtype("fp16", "cpu", 384) == torch.float16
    )
    # Half precision is now the model held in it, not autocast: its records say so.
    assert made_in("fp16", "cuda", 768) == {"precision": "fp16", "half_precision": "weights"}


def test_non_finite_outputs_stop_with_the_rows_and_a_precision_to_try():
    check_finite(np.ones((3, 4), dtype=np.float32), torch.float16, "passage vectors")
    values = np.ones((5, 4), dtype=np.float32)
    values[1, 2], values[3, 0] = np.inf, np.nan
    with pytest.raises(FloatingPointError, match=r"passage vectors: 2 of 5 rows .* set precision bf16 or fp32"):
        check_finite(values, torch.float16, "passage vectors")
    with pytest.raises(FloatingPointError, match=r"re-ranker scores: 1 of 2 rows .*check the model"):
        check_finite(np.array([0.5, np.nan], dtype=np.float32), torch.float32, "re-ranker scores")


def test_inference_turns_off_autograd_and_leaves_the_dtype_to_the_model():
    layer = torch.nn.Linear(4, 4)
    with inference("cpu", torch.bfloat16):  # no autocast: an fp32 layer stays fp32
        out = layer(torch.ones(2, 4))
    assert out.dtype == torch.float32 and not out.requires_grad
    with inference("cpu", torch.bfloat16):
        assert layer.to(torch.bfloat16)(torch.ones(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_an_encoder_in_bf16_holds_its_model_in_bf16_and_pools_in_fp32(tmp_path):
    """The vectors equal pooling the bf16 model's own states in fp64 (a bf16 mean and norm
    would be ~1e-3 off), and are close to fp32 encoding."""
    from pipeline.retrieval.encode import EncoderSettings, local_encoder
    from tests.helpers import generated_texts, save_tiny_bert

    texts = generated_texts(24)
    model = save_tiny_bert(str(tmp_path / "bert"), texts)
    fp32 = local_encoder(EncoderSettings(model=model, pooling="mean", similarity="cos", batch_size=8))
    bf16 = local_encoder(EncoderSettings(model=model, pooling="mean", similarity="cos", batch_size=8, precision="bf16"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    tokens = fp32.tokenizer(texts, add_special_tokens=False)["input_ids"]
    got, reference = bf16.encode_tokens(tokens, max_len=64), fp32.encode_tokens(tokens, max_len=64)
    assert got.dtype == np.float32

    tok = bf16.tokenizer
    for i in (0, 7, 23):
        ids = torch.tensor([[tok.cls_token_id, *tokens[i][:62], tok.sep_token_id]])
        with torch.inference_mode():
            states = bf16.model.passage_tower(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        mean = states[0].double().mean(0)
        np.testing.assert_allclose(got[i], (mean / mean.norm()).numpy(), rtol=0, atol=1e-6)
    cosines = (got * reference).sum(1)  # both unit length
    assert cosines.min() > 0.999 and np.abs(got - reference).max() > 1e-5  # close, and really bf16


def test_a_compiled_encoder_gives_the_eager_embeddings_at_every_batch_width(tmp_path):
    import torch._dynamo

    from pipeline.retrieval.encode import EncoderSettings, local_encoder
    from tests.helpers import generated_texts, save_tiny_bert

    texts = generated_texts(40)
    model = save_tiny_bert(str(tmp_path / "bert"), texts)
    eager = local_encoder(EncoderSettings(model=model, pooling="mean", batch_size=8))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = local_encoder(EncoderSettings(model=model, pooling="mean", batch_size=8, compile=True))
    # Passages cut to many lengths: the length-sorted batches come in five widths.
    tokens = eager.tokenizer(texts, add_special_tokens=False)["input_ids"]
    tokens = [t[: 2 + 3 * (i % 10)] for i, t in enumerate(tokens)]
    expected = eager.encode_tokens(tokens, max_len=64)
    got = compiled.encode_tokens(tokens, max_len=64)
    # One graph for every width (it compiled, and only once).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
    assert np.abs(expected).max() > 0.1  # not vanishing vectors that would pass any tolerance


def test_encodings_record_the_precision_auto_meant_on_their_devices(tmp_path):
    """made_by.json holds the precision a setting resolved to: auto's vectors of a GPU run are
    fp16's, and not taken for a CPU run's fp32 ones (nor the reverse)."""
    from models.biencoder import BiEncoderConfig, ExportShape
    from pipeline.data.shards import PreparedCorpus
    from pipeline.retrieval.encode import EncodeConfig, _made_by

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text("{}")

    def made_by(use_gpu: bool, hidden: int, precision: str = "auto") -> dict:
        cfg = EncodeConfig()
        cfg.pool.use_gpu, cfg.encoder.precision = use_gpu, precision
        shape = ExportShape(BiEncoderConfig(), hidden, hidden, {"query": str(tmp_path / "model")})
        return _made_by(cfg, str(tmp_path / "model"), shape, PreparedCorpus(str(tmp_path / "corpus"), {"shards": []}))

    assert made_by(False, 768)["precision"] == "fp32" and made_by(True, 768)["precision"] == "fp16"
    assert made_by(False, 768) != made_by(True, 768) and made_by(False, 768) == made_by(True, 768, "fp32")
    assert made_by(True, 768) == made_by(True, 768, "fp16") and made_by(True, 384) == made_by(True, 384, "fp16")
    # Vectors from the autocast days (no half_precision key) are not taken for held-in-fp16 ones.
    assert made_by(True, 768, "fp16")["half_precision"] == "weights" and "half_precision" not in made_by(False, 768)


def test_encoder_batches_resolve_per_device_and_a_token_budget_leaves_the_vectors_alone(tmp_path):
    from pipeline.retrieval.encode import EncoderSettings, local_encoder
    from tests.helpers import generated_texts, save_tiny_bert

    assert EncoderSettings().batch_limits("cpu") == (256, 0)
    assert EncoderSettings().batch_limits("cuda:0") == (4096, 131_072)
    assert EncoderSettings(batch_size=8, batch_tokens=100).batch_limits("cuda") == (8, 100)
    with pytest.raises(ValueError, match="encoder.batch_tokens must be >= 0"):
        EncoderSettings(batch_tokens=-1)

    texts = generated_texts(30)
    model = save_tiny_bert(str(tmp_path / "bert"), texts)
    plain = local_encoder(EncoderSettings(model=model, pooling="mean", batch_size=16))
    budget = local_encoder(EncoderSettings(model=model, pooling="mean", batch_size=16, batch_tokens=60))
    tokens = plain.tokenizer(texts, add_special_tokens=False)["input_ids"]
    tokens = [t[: 3 + 2 * (i % 12)] for i, t in enumerate(tokens)]  # widths 5 to 27 framed
    seen = []
    forward = budget.model.encode_passage
    budget.model.encode_passage = lambda ids, mask: seen.append(ids.shape) or forward(ids, mask)
    got = budget.encode_tokens(tokens, max_len=64)
    assert all(rows * width <= 60 for rows, width in seen) and len(seen) > 2
    np.testing.assert_allclose(got, plain.encode_tokens(tokens, max_len=64), rtol=0, atol=1e-5)
    assert np.abs(got).max() > 0.1


def test_an_encoder_stops_on_vectors_its_precision_overflowed(tmp_path):
    from pipeline.retrieval.encode import EncoderSettings, local_encoder
    from tests.helpers import generated_texts, save_tiny_bert

    texts = generated_texts(6)
    encoder = local_encoder(EncoderSettings(model=save_tiny_bert(str(tmp_path / "bert"), texts), pooling="mean"))
    forward = encoder.model.encode_passage

    def overflowing(ids, mask):  # what an fp16 model whose activations pass 65,504 returns
        reps = forward(ids, mask)
        reps[0, 0] = float("inf")
        return reps

    encoder.model.encode_passage = overflowing
    tokens = encoder.tokenizer(texts, add_special_tokens=False)["input_ids"]
    with pytest.raises(FloatingPointError, match="passage vectors: 1 of 6 rows are not finite in torch.float32"):
        encoder.encode_tokens(tokens, max_len=32)


def test_half_precision_on_gpus_keeps_attention_off_cudnn():
    """A model held in half precision on a GPU runs attention on kernels that take any batch
    width (cuDNN's builds a graph per width); fp32 and CPUs keep PyTorch's choice, and
    leaving restores it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with inference("cuda:0", torch.float16):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    with inference("cuda:0", torch.float32), inference("cpu", torch.bfloat16):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_an_actors_busy_time_is_its_span_not_the_sum_of_overlapping_calls():
    """Two shards in flight on one actor: [0, 4] (waited for the device) and [1, 3]; another
    actor's one call [2, 7]. Busy time is 4 and 5 s, where summing calls would give 6 for the first."""
    from pipeline.retrieval.encode import actor_spans

    calls = [
        {"pid": 1, "started_at": 100.0, "finished_at": 104.0},
        {"pid": 1, "started_at": 101.0, "finished_at": 103.0},
        {"pid": 2, "started_at": 102.0, "finished_at": 107.0},
    ]
    assert actor_spans(calls) == {1: 4.0, 2: 5.0}
