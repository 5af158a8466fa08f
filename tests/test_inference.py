"""The inference helper the encoder and the pair scorer share."""

import numpy as np
import torch

from pipeline.retrieval.inference import autocast_dtype, inference, length_sorted_batches


def test_batches_are_longest_first_ties_in_order_and_cover_every_item_once():
    lengths = [3, 9, 3, 1, 9, 5, 3]
    batches = list(length_sorted_batches(lengths, 3))
    assert [b.tolist() for b in batches] == [[1, 4, 5], [0, 2, 6], [3]]
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    assert list(length_sorted_batches([], 4)) == []


def test_precision_settings_per_device():
    assert autocast_dtype("auto", "cpu") is None and autocast_dtype("fp32", "cuda:0") is None
    assert autocast_dtype("auto", "cuda:0") == torch.float16
    assert autocast_dtype("bf16", "cpu") == torch.bfloat16 and autocast_dtype("fp16", "cpu") == torch.float16


def test_inference_turns_off_autograd_and_autocasts():
    layer = torch.nn.Linear(4, 4)
    with inference("cpu", torch.bfloat16):
        out = layer(torch.ones(2, 4))
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    with inference("cpu", None):
        assert layer(torch.ones(2, 4)).dtype == torch.float32


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
