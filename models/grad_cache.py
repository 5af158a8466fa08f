"""Gradient cache (Gao et al. 2021; coCondenser eq. 9-12): a batch-coupled loss over a
batch far larger than memory, with the exact full-batch gradient.

1. Forward every chunk without a graph, keeping each chunk's RNG state (dropout).
2. Compute the coupled loss on the detached representations of the whole batch, and
   its gradient with respect to each representation. Any cross-worker gather happens
   here, once per batch: never one collective per chunk, which can hang (one worker
   running ahead into a chunk's collective while another waits in a different one).
3. Replay each chunk's forward with its saved RNG state and back-propagate
   ``dot(rep, cached_grad) + local_loss``, whose gradient is exactly that chunk's share.

The backward call is injected, so the same code drives ``loss.backward()`` or a
DeepSpeed engine (whose chunks must then sit inside one optimiser step).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class RngState:
    """The CPU RNG and, when this process uses CUDA, its current device's RNG: dropout
    draws from the device the model runs on. Ray Train shows every worker all of a node's
    GPUs; saving or forking the RNG of each would create a CUDA context on all of them."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None
    device: int | None = None

    @classmethod
    def capture(cls) -> "RngState":
        if not torch.cuda.is_initialized():  # nothing ran on a GPU: no CUDA RNG was drawn from
            return cls(torch.get_rng_state())
        device = torch.cuda.current_device()
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state(device), device)

    @contextlib.contextmanager
    def restored(self):
        """Run a block with this RNG state, leaving the caller's RNG as it was."""
        with torch.random.fork_rng(devices=[] if self.device is None else [self.device]):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


Encode = Callable[[dict], tuple[torch.Tensor, torch.Tensor]]


def grad_cache_backward(
    chunks: Sequence[dict],
    encode: Encode,
    coupled_loss: Callable[[torch.Tensor], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    represent: Callable[[dict], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate into the parameters' ``.grad`` the gradient of
    ``coupled_loss(cat(reps)) + sum(local losses)`` over all chunks.

    ``encode(chunk)`` returns ``(reps, local_loss)``: the chunk's representations (b, H)
    and the part of the loss that does not couple examples (e.g. MLM), already weighted
    as the caller wants it summed. ``represent(chunk)``, where given, returns the same
    reps without the local loss, for the first pass (coCondenser's skips its head and MLM
    losses: a sixth of a BERT-base forward); it must draw its dropout as ``encode`` does up
    to the reps. Returns the detached coupled loss and the summed local loss.
    """
    represent = represent or (lambda chunk: encode(chunk)[0])
    states, reps = [], []
    with torch.no_grad():
        for chunk in chunks:
            states.append(RngState.capture())
            reps.append(represent(chunk))
    sizes = [r.shape[0] for r in reps]
    all_reps = torch.cat(reps).detach().requires_grad_(True)
    coupled = coupled_loss(all_reps)
    (cached,) = torch.autograd.grad(coupled, all_reps)
    local_total = torch.zeros((), device=all_reps.device)
    for chunk, state, grad in zip(chunks, states, cached.split(sizes)):
        with state.restored():
            rep, local = encode(chunk)
        # d/dθ of dot(rep, g) is g·∂rep/∂θ: this chunk's exact share of the coupled gradient.
        backward(torch.sum(rep * grad.to(rep.dtype)) + local)
        local_total = local_total + local.detach()
    return coupled.detach(), local_total


class LocalGradients:
    """Sums the chunk gradients of a gradient-cached step in this process only.

    Under DeepSpeed ZeRO, every ``engine.backward`` triggers the engine's gradient
    reduction (ZeRO-2 reduce-scatters in its hooks on every backward), so a backward per
    chunk would mean collectives per chunk. Instead each chunk's gradient is taken with
    ``torch.autograd.grad``, which fills no ``.grad`` and so fires none of those hooks,
    and summed here in fp32. One ``engine.backward(surrogate())`` then hands the total to
    DeepSpeed: one reduction and one optimiser step per batch, at every ZeRO stage that
    keeps whole parameters on each rank (0, 1, 2). The price is one fp32 copy of the
    gradients per rank. (ZeRO-3 keeps no whole parameter: there, DeepSpeed's
    ``coalesce_grad_reduction`` holds the chunks' gradients on the parameters instead.)
    """

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)

    def add(self, loss: torch.Tensor) -> None:
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            total = self.sums[i]
            if total is None:
                self.sums[i] = grad.float()
            else:
                total.add_(grad.float())

    def surrogate(self) -> torch.Tensor:
        """A scalar whose gradient with respect to each parameter is that parameter's sum."""
        terms = [(p * g.to(p.dtype)).sum().float() for p, g in zip(self.params, self.sums) if g is not None]
        if not terms:
            raise RuntimeError("gradient cache: no parameter received a gradient")
        return torch.stack(terms).sum()


def fitting_chunk(per_item: float, fixed: float, available: float, n_items: int) -> int:
    """The largest chunk whose activations (``fixed + per_item * chunk`` bytes) fit in
    ``available``, or 0 when the whole batch fits: then no cache is needed."""
    if fixed + per_item * n_items <= available:
        return 0
    return max(1, int((available - fixed) // max(per_item, 1.0)))


def zero_stage(engine) -> int:
    return engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0


def check_cacheable(engine) -> None:
    """The engine settings under which the chunks' gradients can be summed."""
    if getattr(engine, "fp16_enabled", lambda: False)():
        # Chunk gradients are taken without DeepSpeed's loss scaling and could underflow.
        raise ValueError("the gradient cache runs in fp32 or bf16, not fp16: use --train.precision bf16")


def engine_grad_cache_backward(
    engine,
    chunks: Sequence[dict],
    encode: Callable[[torch.nn.Module, dict], tuple],
    coupled_loss: Callable[[torch.Tensor], torch.Tensor],
    represent: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grad_cache_backward` as one DeepSpeed backward: one reduction, one step.

    ``encode(module, chunk)`` and ``represent(module, chunk)`` run on the bare module
    (``engine.module``): DeepSpeed's own forward adds backward hooks on outputs that must
    only run for the final ``engine.backward``. Returns (coupled loss, summed local loss),
    detached.
    """
    check_cacheable(engine)
    module = getattr(engine, "module", engine)
    if zero_stage(engine) == 3:
        # Partitioned weights have no whole tensor to sum a gradient against outside a
        # forward: each chunk goes through DeepSpeed's backward instead, its reduction held
        # back and run once for the batch as the block exits (one collective pass, as below).
        with engine.coalesce_grad_reduction():
            return grad_cache_backward(
                chunks,
                lambda chunk: encode(module, chunk),
                coupled_loss,
                engine.backward,
                None if represent is None else lambda chunk: represent(module, chunk),
            )
    grads = LocalGradients(module.parameters())
    coupled, local = grad_cache_backward(
        chunks,
        lambda chunk: encode(module, chunk),
        coupled_loss,
        grads.add,
        None if represent is None else lambda chunk: represent(module, chunk),
    )
    engine.backward(grads.surrogate())
    return coupled, local
