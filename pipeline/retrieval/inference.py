"""Inference on one device, shared by the encoder and the pair scorer: the precision a
setting means on that device, and batches of items sorted by length, so that each batch is
padded only to its own longest item."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

# What ``auto`` picks, by measurement (bench/README.md, bench_retrieval_gpu.py, one H100,
# 2026-11-23): fp16 autocast paid for a BERT-base-sized encoder (hidden 768: 6,474
# passages/s against 5,005 in fp32) but cost a MiniLM-sized one (hidden 384: 3,607 against
# 17,644 in fp32), whose small matrix products gain little from half precision while
# autocast adds a cast per op to a step bound by the host. bf16 measured within 4% of fp16
# at both sizes; fp16 keeps 3 more mantissa bits, so vectors nearer fp32's.
HALF_PRECISION_FROM_HIDDEN = 768


def resolved_precision(precision: str, device: str, hidden_size: int) -> str:
    """The precision ``precision`` means for a model of ``hidden_size`` on ``device``: auto
    is fp16 on a GPU from hidden size 768 up, fp32 otherwise (by measurement, above)."""
    if precision != "auto":
        return precision
    return "fp16" if device.startswith("cuda") and hidden_size >= HALF_PRECISION_FROM_HIDDEN else "fp32"


def autocast_dtype(precision: str, device: str, hidden_size: int) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (:func:`resolved_precision`); None = fp32."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(resolved_precision(precision, device, hidden_size))


@contextlib.contextmanager
def inference(device: str, dtype: torch.dtype | None) -> Iterator[None]:
    """No autograd, and autocast to ``dtype`` when one is given."""
    autocast = (
        torch.autocast(device_type=device.split(":")[0], dtype=dtype) if dtype is not None else contextlib.nullcontext()
    )
    with torch.inference_mode(), autocast:
        yield


def length_sorted_batches(lengths: Sequence[int] | np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """The items' indexes, longest first (ties in their order), ``batch_size`` at a time."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]
