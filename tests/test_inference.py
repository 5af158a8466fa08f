"""The inference helper the encoder and the pair scorer share."""

import numpy as np
import torch

from pipeline.retrieval.inference import inference, inference_dtype, length_sorted_batches, made_in, resolved_precision


def test_batches_are_longest_first_ties_in_order_and_cover_every_item_once():
    lengths = [3, 9, 3, 1, 9, 5, 3]
    batches = list(length_sorted_batches(lengths, 3))
    assert [b.tolist() for b in batches] == [[1, 4, 5], [0, 2, 6], [3]]
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    assert list(length_sorted_batches([], 4)) == []


def test_precision_settings_per_device_and_model_size():
    # auto, as the GPUs measured (H200, 2026-11-26): fp32 on every device and model size.
    for device in ("cuda:0", "cuda", "cpu"):
        for hidden in (384, 768, 1024):
            assert inference_dtype("auto", device, hidden) == torch.float32
            assert resolved_precision("auto", device, hidden) == "fp32"
            assert made_in("auto", device, hidden) == {"precision": "fp32"}  # as recorded before half weights
    # A named precision is what it says, on any device and model.
    assert inference_dtype("fp32", "cuda:0", 768) == torch.float32 and resolved_precision("bf16", "cpu", 384) == "bf16"
    assert (
        inference_dtype("bf16", "cpu", 384) == torch.bfloat16 and inference_dtype("fp16", "cpu", 384) == torch.float16
    )
    # Half precision is now the model held in it, not autocast: its records say so.
    assert made_in("fp16", "cuda", 768) == {"precision": "fp16", "half_precision": "weights"}


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
    """made_by.json holds the precision a setting resolved to: auto's fp32 vectors of a CPU
    run are reused by a GPU run of auto (fp32 there too), not by one asked for fp16."""
    from types import SimpleNamespace

    from models.biencoder import BiEncoderConfig
    from pipeline.retrieval.encode import EncodeConfig, _made_by

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text("{}")

    def made_by(use_gpu: bool, hidden: int, precision: str = "auto") -> dict:
        cfg = EncodeConfig()
        cfg.pool.use_gpu, cfg.encoder.precision = use_gpu, precision
        probe = SimpleNamespace(
            cfg=BiEncoderConfig(), passage_tower=SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))
        )
        return _made_by(cfg, str(tmp_path / "model"), probe, str(tmp_path / "corpus"), {"shards": []})

    assert made_by(False, 768)["precision"] == made_by(True, 768)["precision"] == "fp32"
    assert made_by(False, 768) == made_by(True, 768) and made_by(False, 384) == made_by(True, 384)
    assert made_by(True, 768, "fp16")["precision"] == "fp16" and made_by(True, 768, "fp16") != made_by(False, 768)
    # Vectors from the autocast days (no half_precision key) are not taken for held-in-fp16 ones.
    assert made_by(True, 768, "fp16")["half_precision"] == "weights" and "half_precision" not in made_by(True, 768)


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
