"""Inference on one device, shared by the encoder and the pair scorer: the precision a
setting means on that device, and batches of items sorted by length, so that each batch is
padded only to its own longest item."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch


def autocast_dtype(precision: str, device: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (auto: fp16 on a GPU, fp32 elsewhere); None = fp32."""
    if precision == "auto":
        precision = "fp16" if device.startswith("cuda") else "fp32"
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


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
