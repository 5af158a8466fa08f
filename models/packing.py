"""Several sequences to a row, each attending only to itself: coCondenser's span pairs
without compute on padding.

A batch of short sequences padded to its longest wastes the difference on every layer. Packed,
the sequences share rows of a fixed width, first-fit decreasing; a block-diagonal attention
mask keeps each sequence to its own tokens and positions restart at each sequence's [CLS],
so every sequence's states are those it has alone (up to float summation order). The mask is
built by transformers' own mask functions for the backbone's attention implementation
(SDPA, eager, flex), so packing adds no attention kernel of its own.

Packing happens on the CPU in ``make_batch``, after masking (the corruption is the padded
batch's, token for token). A gradient cache's chunks are packed apart, so each chunk's rows
hold only its own spans: ``chunks`` names each chunk's rows and spans.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.masking_utils import create_bidirectional_mask, packed_sequence_mask_function

from models.masking import IGNORE_INDEX


def first_fit_decreasing(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, offset) of each sequence in rows of ``width`` tokens: the longest first, each
    into the first row with room. Deterministic: equal lengths go in index order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > width:
        raise ValueError(f"packing: a sequence of {int(lengths.max())} tokens does not fit rows of {width}")
    room = np.empty(0, dtype=np.int64)
    row, offset = np.empty(len(lengths), np.int64), np.empty(len(lengths), np.int64)
    for i in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(room >= lengths[i])
        if len(fits):
            r = int(fits[0])
        else:
            r, room = len(room), np.append(room, width)
        row[i], offset[i] = r, width - room[r]
        room[r] -= lengths[i]
    return row, offset


def pack(
    batch: dict[str, torch.Tensor], lengths: torch.Tensor, width: int, chunk_size: int = 0, pad_id: int = 0
) -> dict:
    """A padded (N, L) batch (``input_ids``, ``labels``) as packed rows of ``width``.

    Returns ``input_ids`` and ``labels`` (R, width); ``segments`` (R, width), the 1-based
    number of each token's sequence within its row (0 on padding); ``position_ids``, from 0
    at each sequence's first token; ``sequence_index``, each token's sequence within its
    chunk (-1 on padding); ``cls_index`` (N,), each sequence's first token as a flat index
    into its chunk's rows, in the batch's order; and ``chunks``, a tuple of
    ``(first_row, end_row, first_sequence, end_sequence)``: consecutive groups of
    ``chunk_size`` sequences (all of them with 0), each packed into rows of its own.
    """
    lengths_np = lengths.cpu().numpy().astype(np.int64)
    n = len(lengths_np)
    step = chunk_size if 0 < chunk_size < n else max(n, 1)
    rows_of, offsets_of, chunks, first_row = [], [], [], 0
    for start in range(0, n, step):
        end = min(n, start + step)
        row, offset = first_fit_decreasing(lengths_np[start:end], width)
        rows_of.append(row + first_row)
        offsets_of.append(offset)
        n_rows = int(row.max()) + 1 if len(row) else 0
        chunks.append((first_row, first_row + n_rows, start, end))
        first_row += n_rows
    row = np.concatenate(rows_of) if rows_of else np.empty(0, np.int64)
    offset = np.concatenate(offsets_of) if offsets_of else np.empty(0, np.int64)
    sequence_chunk = np.repeat(np.arange(len(chunks)), [c[3] - c[2] for c in chunks])
    chunk_first_row = np.array([c[0] for c in chunks], dtype=np.int64)[sequence_chunk]
    chunk_first_seq = np.array([c[2] for c in chunks], dtype=np.int64)[sequence_chunk]

    # Every real token: its sequence, its place in that sequence, and where it goes.
    seq = np.repeat(np.arange(n), lengths_np)
    pos = np.arange(len(seq)) - np.repeat(np.cumsum(lengths_np) - lengths_np, lengths_np)
    dest = row[seq] * width + offset[seq] + pos
    starts = np.r_[0, np.cumsum(np.bincount(row, minlength=first_row))[:-1]] if first_row else np.zeros(0, np.int64)
    # A row's k-th sequence by offset is its segment k+1.
    order = np.lexsort((offset, row))
    segment = np.empty(n, np.int64)
    segment[order] = np.arange(n) - starts[row[order]] + 1

    def scatter(values: np.ndarray, fill: int, dtype=torch.long) -> torch.Tensor:
        out = torch.full((first_row * width,), fill, dtype=dtype)
        out[torch.from_numpy(dest)] = torch.as_tensor(values, dtype=dtype)
        return out.view(first_row, width)

    src_ids = batch["input_ids"][torch.from_numpy(seq), torch.from_numpy(pos)]
    src_labels = batch["labels"][torch.from_numpy(seq), torch.from_numpy(pos)]
    return {
        "input_ids": scatter(src_ids.numpy(), pad_id),
        "labels": scatter(src_labels.numpy(), IGNORE_INDEX),
        "segments": scatter(segment[seq], 0),
        "position_ids": scatter(pos, 0),
        "sequence_index": scatter(seq - chunk_first_seq[seq], -1),
        "cls_index": torch.from_numpy((row - chunk_first_row) * width + offset),
        "chunks": tuple(chunks),
    }


def chunk_of(packed: dict, chunk: tuple[int, int, int, int]) -> dict:
    """One chunk's part of a :func:`pack` result (its rows, its sequences' ``cls_index``)."""
    first_row, end_row, first_seq, end_seq = chunk
    part = {k: v[first_row:end_row] for k, v in packed.items() if k not in ("cls_index", "chunks")}
    part["cls_index"] = packed["cls_index"][first_seq:end_seq]
    return part


def packed_attention_mask(config, segments: torch.Tensor, dtype: torch.dtype):
    """The 4-D mask of a packed batch for ``config``'s attention implementation: a token
    attends to the tokens of its own segment. Padding (segment 0) attends to padding, so
    that no row of the mask is empty (an all-masked softmax row is NaN in some kernels)."""
    meta = torch.empty((*segments.shape, 0), dtype=dtype, device=segments.device)
    return create_bidirectional_mask(
        config=config,
        inputs_embeds=meta,
        attention_mask=None,
        and_mask_function=packed_sequence_mask_function(segments),
        allow_is_bidirectional_skip=False,
    )
