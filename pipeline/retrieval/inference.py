"""Inference on one device, shared by the encoder and the pair scorer: the precision a
setting means on that device, the model held in it, and batches of items sorted by length,
so that each batch is padded only to its own longest item."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# What ``auto`` picks, by measurement (bench/README.md, bench_retrieval_gpu.py): fp32. On
# one H200 (2026-11-26, batch 1024, Nave's verses) a BERT-base-sized encoder ran 5,740
# passages/s in fp32 against 3,198 under fp16 autocast and 2,868 under bf16; a MiniLM-sized
# one 19,414 in fp32; on one H100 (2026-11-23, batch 256) MiniLM's fp16 was 3,607 against
# 17,644 in fp32. Half precision should win by far at these sizes, so something in that
# autocast path was slow (see HALF_PRECISION_ATTENTION; the model is now held in half
# precision instead of autocast, below); until a measurement shows it paying, auto stays fp32.


def resolved_precision(precision: str, device: str, hidden_size: int) -> str:
    """The precision ``precision`` means for a model of ``hidden_size`` on ``device``: auto
    is fp32 everywhere (by measurement, above); device and width are the inputs a later
    measurement may split it on."""
    del device, hidden_size
    return "fp32" if precision == "auto" else precision


def inference_dtype(precision: str, device: str, hidden_size: int) -> torch.dtype:
    """The dtype the model is held in for ``precision`` (:func:`resolved_precision`)."""
    resolved = resolved_precision(precision, device, hidden_size)
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(resolved, torch.float32)


def made_in(precision: str, device: str, hidden_size: int) -> dict:
    """What an output's record says of the precision it was computed in. Half precision is
    the model held in it: before 2026-11-27 it was autocast, whose outputs differ, so a
    half-precision record names the way (fp32 records are unchanged, and still reused)."""
    resolved = resolved_precision(precision, device, hidden_size)
    return {"precision": resolved} | ({"half_precision": "weights"} if resolved != "fp32" else {})


def held_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its weights cast to ``dtype``, in place. Half precision holds the model
    in it rather than autocasting an fp32 one: no cast of each weight and activation at every
    layer, half the weight reads. MiniLM with one thread on an AMX CPU encoded 414 Nave
    verses/s held in bf16 against 292 under bf16 autocast (2026-11-27, bench_search.py), its
    vectors within cosine 0.9999 of fp32 either way. Pooling and normalization still run in fp32
    (:func:`models.biencoder.pool`)."""
    return model if dtype == torch.float32 else model.to(dtype)


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


def length_sorted_batches(lengths: Sequence[int] | np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """The items' indexes, longest first (ties in their order), ``batch_size`` at a time."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]
