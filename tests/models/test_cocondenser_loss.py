"""coCondenser's span-pair contrastive loss, its cross-worker gather, and the gradient cache."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from models.cocondenser import (
    global_span_contrastive_loss,
    partner_targets,
    span_contrastive_loss,
)
from models.grad_cache import RngState, grad_cache_backward
from tests import distributed


def test_partner_targets_pair_adjacent_spans():
    assert partner_targets(6).tolist() == [1, 0, 3, 2, 5, 4]
    with pytest.raises(ValueError, match="odd"):
        partner_targets(5)


def test_loss_matches_a_hand_computation():
    x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.5]])
    # By hand: row i scores every j != i by the raw dot product; the target is i's partner.
    dots = [[sum(a * b for a, b in zip(x[i].tolist(), x[j].tolist())) for j in range(4)] for i in range(4)]
    partner = [1, 0, 3, 2]
    expected = 0.0
    for i in range(4):
        others = [dots[i][j] for j in range(4) if j != i]
        expected += -(dots[i][partner[i]] - math.log(sum(math.exp(s) for s in others)))
    expected /= 4
    assert span_contrastive_loss(x).item() == pytest.approx(expected, rel=1e-6)
    # The self-score is masked: making a span huge against itself changes nothing about
    # its own row's normaliser beyond the other spans.
    assert torch.isfinite(span_contrastive_loss(x * 30))


def test_single_process_global_loss_is_the_plain_loss():
    x = torch.randn(6, 4)
    assert torch.equal(global_span_contrastive_loss(x), span_contrastive_loss(x))


class TinyEncoder(torch.nn.Module):
    """A small encoder with dropout, so the RNG replay matters."""

    def __init__(self, dropout: float):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 6)
        )
        self.head = torch.nn.Linear(6, 3)

    def encode(self, chunk):
        rep = self.net(chunk["x"])
        local = torch.nn.functional.cross_entropy(self.head(rep), chunk["y"], reduction="sum") / chunk["total"]
        return rep, local


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("chunk_size", [2, 4, 8])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_grad_cache_equals_one_graph_over_the_whole_batch(chunk_size, dropout):
    torch.manual_seed(0)
    model = TinyEncoder(dropout).train()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    chunks = [{"x": x[i : i + chunk_size], "y": y[i : i + chunk_size], "total": 16} for i in range(0, 16, chunk_size)]

    torch.manual_seed(1)
    coupled, local = grad_cache_backward(chunks, model.encode, span_contrastive_loss, lambda s: s.backward())
    cached_grads = _grads(model)

    # Reference: one graph, each chunk's forward run under the same RNG state the cache saw.
    model.zero_grad()
    torch.manual_seed(1)
    reps, locals_ = [], []
    for chunk in chunks:
        state = RngState.capture()
        rep, _ = model.encode(chunk)  # advances the RNG exactly as the cache's first pass did
        with state.restored():
            rep, loc = model.encode(chunk)
        reps.append(rep)
        locals_.append(loc)
    reference = span_contrastive_loss(torch.cat(reps)) + sum(locals_)
    reference.backward()
    ref_grads = _grads(model)

    assert coupled.item() + local.item() == pytest.approx(reference.item(), rel=1e-6)
    rel = (cached_grads - ref_grads).norm() / ref_grads.norm()
    assert rel < 1e-5, rel


def test_replay_reproduces_the_first_pass_exactly_under_dropout():
    torch.manual_seed(0)
    model = TinyEncoder(0.5).train()
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    chunks = [{"x": x[i : i + 4], "y": y[i : i + 4], "total": 8} for i in (0, 4)]
    seen = []

    def recording_encode(chunk):
        rep, local = model.encode(chunk)
        seen.append(rep.detach().clone())
        return rep, local

    grad_cache_backward(chunks, recording_encode, span_contrastive_loss, lambda s: s.backward())
    first_pass, replays = seen[:2], seen[2:]
    for a, b in zip(first_pass, replays):
        assert torch.equal(a, b)
    # Control: without restoring the RNG state, dropout really draws anew.
    assert not torch.equal(model.encode(chunks[0])[0], model.encode(chunks[0])[0])


# -- two real processes (gloo) ------------------------------------------------------------


def _worker(rank: int, world: int, out: dict, full: torch.Tensor):
    from models.distributed import gather_with_grad

    b = full.shape[0] // world
    local = full[rank * b : (rank + 1) * b].clone().requires_grad_(True)
    gathered = gather_with_grad(local)
    loss = global_span_contrastive_loss(local)
    loss.backward()
    out[rank] = {"gathered": gathered.detach().clone(), "loss": loss.item(), "grad": local.grad.clone()}


def test_rng_state_touches_only_the_current_cuda_device(monkeypatch):
    """A worker that sees 8 GPUs saves and forks the RNG of the one it runs on (device 3
    here); the CUDA calls are recorded, not run (this machine has no GPU)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device)) or torch.ones(4))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", device)))
    for name in ("get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: pytest.fail(f"{name}: every device touched"))
    forked = []

    @contextlib.contextmanager
    def fork_rng(devices):
        forked.append(list(devices))
        yield

    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    state = RngState.capture()
    with state.restored():
        pass
    assert state.device == 3 and calls == [("get", 3), ("set", 3)] and forked == [[3]]


def test_two_workers_place_chunks_by_global_rank_and_reproduce_the_full_batch_gradient():
    torch.manual_seed(0)
    full = torch.randn(8, 5)
    out = distributed.spawn(_worker, 2, full)

    reference = full.clone().requires_grad_(True)
    ref_loss = span_contrastive_loss(reference)
    ref_loss.backward()
    for rank in (0, 1):
        assert torch.equal(out[rank]["gathered"], full)  # identical on both, each chunk at its rank's slot
        assert out[rank]["loss"] == pytest.approx(2 * ref_loss.item(), rel=1e-6)  # scaled by world size
        # After the data-parallel average (÷ world), each worker's rows get exactly the full-batch gradient.
        assert torch.allclose(out[rank]["grad"] / 2, reference.grad[rank * 4 : (rank + 1) * 4], atol=1e-6)
