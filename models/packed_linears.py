"""Linear layers on x86 CPUs through oneDNN, their weights packed once, for inference.

PyTorch runs an fp32 ``nn.Linear`` on a CPU through MKL's sgemm, and on AMD's cores MKL
takes its AVX2 path. oneDNN, which PyTorch also ships, picks its kernels by the core's
instruction set: on one Zen 5 core (AVX-512) a 1,024-square fp32 product ran at 105.8
GFLOP/s through MKL and 233.2 through oneDNN, and MiniLM encoded Nave's verses 1.95x as fast
with its linears packed (``bench/bench_search.py --parts encode``). The outputs
are fp32 products summed in another order: within 3e-7 of MKL's on those vectors.

oneDNN's packed linear has no backward, and Inductor cannot trace its packed weight, so a
packed layer takes the plain path whenever autograd needs it or the input is not a CPU
tensor of the weight's dtype; ``torch.compile`` and packing are alternatives."""

from __future__ import annotations

import functools
import warnings

import torch


def onednn_linears_available() -> bool:
    """Whether this PyTorch build has oneDNN and the CPU is x86 (its capability string is
    an AVX level there; ARM builds route oneDNN through ACL, not measured here)."""
    return torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX")


@functools.cache
def _dtypes() -> frozenset:
    """The dtypes oneDNN's CPU products take on this core (no fp64; bf16 where it has the
    instructions, else PyTorch's own path is the faster)."""
    return frozenset([torch.float32] + [torch.bfloat16] * torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _plain_bf16_said() -> None:
    """Said once a process: bf16 linears on this CPU take PyTorch's own path."""
    warnings.warn(
        "this CPU has no bf16 instructions for oneDNN (AVX-512 BF16 or AMX): bf16 linears run "
        "PyTorch's own path, unpacked",
        RuntimeWarning,
        stacklevel=3,
    )


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose inference runs oneDNN's product on a packed copy of its
    weight. Its parameters and state dict are the Linear's; the copy is packed again when
    the weight changes (``load_state_dict`` and optimizer steps write it in place, ``.to``
    replaces it)."""

    _packed: tuple[tuple, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if needs_grad or x.dim() < 2 or x.device.type != "cpu" or x.dtype != weight.dtype or x.dtype not in _dtypes():
            if x.dtype == torch.bfloat16 and x.dtype not in _dtypes():
                _plain_bf16_said()
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        return self._packed[1]

    def __getstate__(self):
        # oneDNN's packed tensors do not pickle or deep-copy; a copy packs its own.
        return {k: v for k, v in self.__dict__.items() if k != "_packed"}


def pack_linears(module: torch.nn.Module) -> int:
    """Turn each plain ``nn.Linear`` under ``module`` into a :class:`PackedLinear`, in place
    (subclasses, such as a quantized or LoRA layer's own, are left alone). Returns how many;
    none where :func:`onednn_linears_available` is false."""
    if not onednn_linears_available():
        return 0
    layers = [sub for sub in module.modules() if type(sub) is torch.nn.Linear]
    for layer in layers:
        layer.__class__ = PackedLinear
    return len(layers)
