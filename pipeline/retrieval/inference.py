"""Inference on one device, shared by the encoder and the pair scorer: the precision a
setting means on that device, the model held in it, and batches of items sorted by length,
so that each batch is padded only to its own longest item."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import field
from typing import TypeVar

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.batches import to_device
from models.packed_linears import pack_linears

# What ``auto`` picks, by measurement (bench/README.md, bench_retrieval_gpu.py): fp16 held in
# the model on GPUs, fp32 on CPUs. On one H100 (Nave's verses, batch 1,024, one run) a
# BERT-base-sized encoder held in fp16 ran 14,930 passages/s against 5,885 in fp32, and a
# MiniLM-sized one 24,616 (17,644 in fp32, batch 256). fp16 *autocast* is the slower one (3,198 against 5,740 on an H200): the cast of every
# weight and activation at every layer, and cuDNN's attention (HALF_PRECISION_ATTENTION).
# fp16 rather than bf16: its 10 mantissa bits keep vectors closer to fp32's, and a BERT's
# activations stay far inside its range; a model that overflows it is stopped by the
# encoder's check (non-finite vectors), which names precision: bf16 or fp32.
AUTO_PRECISION = {"cuda": "fp16", "cpu": "fp32"}


def resolved_precision(precision: str, device: str, hidden_size: int) -> str:
    """The precision ``precision`` means for a model of ``hidden_size`` on ``device``: auto
    is fp16 on GPUs and fp32 elsewhere (by measurement, above); the width is an input a
    later measurement may split it on."""
    del hidden_size
    return AUTO_PRECISION.get(device.split(":")[0], "fp32") if precision == "auto" else precision


def inference_dtype(precision: str, device: str, hidden_size: int) -> torch.dtype:
    """The dtype the model is held in for ``precision`` (:func:`resolved_precision`)."""
    resolved = resolved_precision(precision, device, hidden_size)
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(resolved, torch.float32)


def made_in(precision: str, device: str, hidden_size: int) -> dict:
    """What an output's record says of the precision it was computed in. Half precision is
    the model held in it, not autocast, whose outputs differ: a half-precision record names
    the way, so an output made under autocast is not reused (fp32 records need no name)."""
    resolved = resolved_precision(precision, device, hidden_size)
    return {"precision": resolved} | ({"half_precision": "weights"} if resolved != "fp32" else {})


def held_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its weights cast to ``dtype``, in place. Half precision holds the model
    in it rather than autocasting an fp32 one: no cast of each weight and activation at every
    layer, half the weight reads. MiniLM with one thread on an AMX CPU encoded 414 Nave
    verses/s held in bf16 against 292 under bf16 autocast (bench_search.py), its
    vectors within cosine 0.9999 of fp32 either way. Pooling and normalization still run in fp32
    (:func:`models.biencoder.pool`)."""
    return model if dtype == torch.float32 else model.to(dtype)


def cpu_linears_field():
    """The ``cpu_linears`` setting of the encoder's and the re-ranker's configs."""
    return field(
        default="onednn",
        metadata={
            "help": "linear layers on CPUs: onednn = weights packed once for oneDNN's kernels (AVX-512 where the core has it; the same vectors within 3e-7), blas = PyTorch's default; ignored with compile, which traces the plain layers"
        },
    )


def with_cpu_linears(model: torch.nn.Module, device: str, cpu_linears: str) -> torch.nn.Module:
    """``model`` with its linear layers packed for oneDNN (``cpu_linears="onednn"``) when it
    runs on a CPU, in place (:mod:`models.packed_linears`: MiniLM in fp32 1.95x MKL's path on
    a Zen 5 core); ``"blas"`` keeps PyTorch's default."""
    if device.split(":")[0] == "cpu" and cpu_linears == "onednn":
        pack_linears(model)
    return model


# Attention kernels for half precision on GPUs. Length-sorted batches change width from one
# batch to the next; cuDNN's attention, which PyTorch may pick for fp16/bf16 on Hopper,
# builds a graph per new shape, the leading suspect for the slow half-precision rows above
# (not yet measured apart). The memory-efficient kernel takes any width and the padding mask.
HALF_PRECISION_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def inference(device: str, dtype: torch.dtype) -> Iterator[None]:
    """No autograd; for a model held in half precision on a GPU, attention on the kernels
    of HALF_PRECISION_ATTENTION."""
    kind = device.split(":")[0]
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        if dtype != torch.float32 and kind == "cuda":
            stack.enter_context(sdpa_kernel(HALF_PRECISION_ATTENTION))
        yield


# Rows and padded tokens a forward where a setting says 0 (auto), on GPUs. On one H100
# (BERT-base held in fp16, Nave's verses of ~31 tokens) batches of 4,096 ran
# 23,695 passages/s against 14,930 at 1,024: a forward of ~32k tokens is too small to keep
# that GPU busy. 131,072 tokens is what 4,096 of those verses, padded to ~32, hold; the cap
# keeps longer rows to that many tokens a forward (1,024 rows of 128), so that long passages
# or pairs ask no more memory a forward than the measured setting did. CPUs keep their
# callers' row counts and no cap (a CPU forward is long enough at any size).
AUTO_GPU_ROWS, AUTO_GPU_TOKENS = 4096, 131_072


def batch_limits(device: str, rows: int, tokens: int, cpu_rows: int) -> tuple[int, int]:
    """(rows, padded tokens) a forward on ``device``: the settings, or auto where they are 0."""
    gpu = device.split(":")[0] == "cuda"
    return rows or (AUTO_GPU_ROWS if gpu else cpu_rows), tokens or (AUTO_GPU_TOKENS if gpu else 0)


def length_sorted_batches(
    lengths: Sequence[int] | np.ndarray, batch_size: int, max_tokens: int = 0
) -> Iterator[np.ndarray]:
    """The items' indexes, longest first (ties in their order), at most ``batch_size`` at a
    time and, where ``max_tokens`` is set, at most ``max_tokens`` padded tokens (rows x the
    batch's longest, which is its first; one row however long)."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    start = 0
    while start < len(order):
        rows = batch_size
        if max_tokens:
            rows = min(rows, max(1, max_tokens // max(1, int(lengths[order[start]]))))
        yield order[start : start + rows]
        start += rows


def on_device(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """A batch's inputs on ``device``. To a GPU from pinned memory, without blocking: a
    blocking copy to a GPU returns only once every kernel queued before it has run, so the
    next batch could not be queued behind the one running."""
    if device.split(":")[0] != "cuda":
        return to_device(tensors, device)
    return to_device({name: tensor.pin_memory() for name, tensor in tensors.items()}, device, non_blocking=True)


Batch = TypeVar("Batch")


def overlapped(
    batches: Iterable[Batch], forward: Callable[[Batch], torch.Tensor]
) -> Iterator[tuple[Batch, np.ndarray]]:
    """``(batch, forward(batch) as fp32 on the host)`` for each of ``batches``, in order, each
    next batch made and launched before the output of the one before it is waited for.

    ``forward`` does the host's part (framing the batch, :func:`on_device`) and queues the
    device's. On a GPU its output is copied to pinned memory behind its own kernels and read
    once that copy is done: while the host waits for one batch, the next is queued behind
    it, and the host framed it while the device ran the one before: the device does not
    idle while the host frames a batch."""
    pending = None
    for batch in batches:
        output = forward(batch).float()
        done = None
        if output.is_cuda:
            host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
            host.copy_(output, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            output = host
        if pending is not None:
            yield _host_output(*pending)
        pending = batch, output, done
    if pending is not None:
        yield _host_output(*pending)


def _host_output(batch, output: torch.Tensor, done) -> tuple:
    if done is not None:
        done.synchronize()
    return batch, output.numpy()


def check_finite(values: np.ndarray, dtype: torch.dtype, what: str) -> None:
    """Stops on a non-finite output: a model whose activations overflow the precision it is
    held in (fp16's range ends at 65,504) would otherwise write NaN vectors or scores that
    search and mining then take as real."""
    if np.isfinite(values).all():
        return
    bad = int((~np.isfinite(values.reshape(len(values), -1))).any(1).sum())
    where = "its activations overflow it: set precision bf16 or fp32" if dtype == torch.float16 else "check the model"
    raise FloatingPointError(f"{what}: {bad} of {len(values)} rows are not finite in {dtype}; {where}")
