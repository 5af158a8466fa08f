"""coCondenser's span pairs: two non-overlapping spans of equal length per document,
re-drawn every epoch. NumPy only: the training stream draws them in Ray Data tasks, which
must not pay for importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from models.cocondenser import CoCondenserConfig


def _uniform(seed: int, epoch: int, rows: np.ndarray, draw: int) -> np.ndarray:
    """Uniform [0, 1) floats that depend only on (seed, epoch, row, draw): splitmix64.

    A document's spans must not depend on which batch or worker it lands in (resumed
    epochs re-batch the rows), and per-row generators would cost ~10 us a document.
    """
    with np.errstate(over="ignore"):
        x = rows.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(
            (seed * 1_000_003 + epoch * 7_919 + draw * 104_729) % 2**63
        )
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(2**53)


def draw_span_pairs(
    lengths: np.ndarray, rows: np.ndarray, cfg: CoCondenserConfig, seed: int, epoch: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Two non-overlapping spans of equal length per document.

    Returns ``(valid, first_start, second_start, span_len)`` per document. The length is
    ``span_length``, or with ``short_span_prob`` uniform in [min_span_length,
    span_length); it is capped at half the document so short documents still give a
    pair. The two spans are placed uniformly among the non-overlapping placements.
    Documents shorter than ``2 * min_span_length`` are not valid (no pair).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    short = _uniform(seed, epoch, rows, 0) < cfg.short_span_prob
    short_len = cfg.min_span_length + np.floor(
        _uniform(seed, epoch, rows, 1) * max(0, cfg.span_length - cfg.min_span_length)
    ).astype(np.int64)
    span_len = np.minimum(np.where(short, short_len, cfg.span_length), lengths // 2)
    valid = lengths >= 2 * cfg.min_span_length
    free = np.maximum(lengths - 2 * span_len, 0)
    cuts = np.floor(np.stack([_uniform(seed, epoch, rows, 2), _uniform(seed, epoch, rows, 3)]) * (free + 1)).astype(
        np.int64
    )
    first, second = cuts.min(axis=0), cuts.max(axis=0) + span_len
    return valid, first, second, span_len
