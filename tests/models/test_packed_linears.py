import copy
import pickle
import warnings

import numpy as np
import pytest
import torch

from models import packed_linears
from models.packed_linears import PackedLinear, onednn_linears_available, pack_linears


def packed_pair(in_features: int, out_features: int, bias: bool = True, seed: int = 0):
    """A Linear and a packed copy of it."""
    torch.manual_seed(seed)
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 1 and type(packed) is PackedLinear
    return plain, packed


def test_this_machine_packs_its_linears():
    """CI runs on x86 with PyTorch's oneDNN: the encoder's default path is the packed one."""
    assert onednn_linears_available()


@pytest.mark.parametrize(
    "shape, out_features, bias",
    [((5, 24), 40, True), ((3, 7, 24), 40, True), ((3, 7, 24), 1, True), ((6, 24), 40, False)],
)
def test_a_packed_linear_gives_the_plain_linears_outputs(shape, out_features, bias):
    plain, packed = packed_pair(24, out_features, bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, expected = packed(x), plain(x)
    assert packed._packed is not None  # it took oneDNN's path
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # A transposed (non-contiguous) input.
    x_t = torch.randn(24, shape[0]).t()
    with torch.no_grad():
        torch.testing.assert_close(packed(x_t), plain(x_t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu", ["this one", "without bf16 products"])
def test_a_packed_linear_in_bf16_gives_the_plain_bf16_outputs(cpu, monkeypatch):
    """Packed where this CPU has oneDNN's bf16 products; where it has none (an AMD EPYC
    before Zen 4; every CPU in the second case), the plain path, said once in a warning.
    Mutation: ``x.dtype not in _dtypes()`` dropped from ``forward`` packs in the second case
    (on a CPU without the instructions, oneDNN's slow emulation or an error)."""
    if cpu != "this one":
        monkeypatch.setattr(packed_linears, "_dtypes", lambda: frozenset([torch.float32]))
    packed_linears._plain_bf16_said.cache_clear()
    plain, packed = packed_pair(32, 48)
    plain, packed = plain.to(torch.bfloat16), packed.to(torch.bfloat16)
    x = torch.randn(4, 9, 32, dtype=torch.bfloat16)
    can_pack = torch.bfloat16 in packed_linears._dtypes()
    with torch.inference_mode(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = packed(x)
        packed(x)
        assert got.dtype == torch.bfloat16
        if can_pack:
            assert packed._packed is not None and packed._packed[1].dtype == torch.bfloat16 and not said
        else:
            assert packed._packed is None
            assert [str(w.message) for w in said if "no bf16 instructions" in str(w.message)] != []
            assert len(said) == 1, "said once"
        torch.testing.assert_close(got, plain(x))


def test_the_packed_copy_follows_the_weight_it_was_packed_from():
    """load_state_dict writes the weight in place, .to replaces it: each is packed again,
    never the stale copy used."""
    plain, packed = packed_pair(16, 8)
    x = torch.randn(3, 16)
    with torch.no_grad():
        packed(x)
        other = torch.nn.Linear(16, 8)
        packed.load_state_dict(other.state_dict())
        torch.testing.assert_close(packed(x), other(x), rtol=1e-5, atol=1e-5)
        packed.weight.mul_(2.0)  # an optimizer's in-place step
        torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, 2 * other.weight, other.bias))
        packed.double()
        assert packed(x.double()).dtype == torch.float64  # oneDNN has no fp64 product: the plain path


def test_autograd_takes_the_plain_path_with_the_linears_gradients():
    plain, packed = packed_pair(12, 6)
    x = torch.randn(4, 12, requires_grad=True)
    x_packed = x.detach().clone().requires_grad_(True)
    plain(x).square().sum().backward()
    packed(x_packed).square().sum().backward()
    assert packed._packed is None  # never packed: autograd needed every call
    torch.testing.assert_close(x_packed.grad, x.grad)
    torch.testing.assert_close(packed.weight.grad, plain.weight.grad)
    torch.testing.assert_close(packed.bias.grad, plain.bias.grad)


def test_packing_keeps_the_state_dict_and_the_module_copies_and_pickles():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model) == 2
    assert pack_linears(model) == 0  # packed already: nothing left to turn
    assert model.state_dict().keys() == keys.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in keys.items())
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)  # packs both layers
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert all(type(m) is PackedLinear for m in (clone[0], clone[2]))
            torch.testing.assert_close(clone(x), expected)


def test_an_encoder_gives_the_blas_paths_vectors(tmp_path):
    """The encoder's default on CPUs (cpu_linears=onednn) against PyTorch's own path: the
    same vectors within 1e-5, every linear of both towers packed and run packed."""
    from pipeline.retrieval.encode import EncoderSettings, local_encoder
    from tests.helpers import generated_texts, save_tiny_bert

    texts = generated_texts(30)
    bert = save_tiny_bert(str(tmp_path / "bert"), texts)
    onednn = local_encoder(EncoderSettings(model=bert, pooling="mean", batch_size=8))
    blas = local_encoder(EncoderSettings(model=bert, pooling="mean", batch_size=8, cpu_linears="blas"))
    linears = [m for m in onednn.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    assert not any(type(m) is PackedLinear for m in blas.model.modules())
    tokens = blas.tokenizer(texts, add_special_tokens=False)["input_ids"]
    expected = blas.encode_tokens(tokens, max_len=64)
    assert all(m._packed is None for m in linears)
    np.testing.assert_allclose(onednn.encode_tokens(tokens, max_len=64), expected, rtol=0, atol=1e-5)
    assert np.abs(expected).max() > 0.1
    # Every linear ran oneDNN's product: only that path packs a copy of the weight. Mutation:
    # a forward that always takes nn.Linear's path leaves every copy unmade, and this fails.
    assert all(m._packed is not None for m in linears)
