"""Training groups: which positive and which negatives a query trains on in each epoch."""

from __future__ import annotations

import hashlib

import numpy as np

from pipeline.data.examples import TrainExample


def query_seed(seed: int, query_id: str) -> int:
    """A per-query seed that is the same in every process (Python's hash() is salted)."""

    digest = hashlib.blake2b(f"{seed}\x00{query_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def select_group(
    example: TrainExample, epoch: int, group_size: int, seed: int = 0, fallback: list | None = None
) -> list:
    """The ``group_size`` passage ids a query trains on in ``epoch``: positive first.

    As in Tevatron, the positive rotates through the query's positives, and the negatives
    are a fixed per-query shuffle read through a window that slides by ``group_size - 1``
    each epoch, so over ``len(negatives) / (group_size - 1)`` epochs every negative is
    used once. A query with fewer negatives than the window samples its own with
    replacement; one with none draws from ``fallback`` (e.g. a seeded sample of corpus ids;
    its positives are never drawn), so every group has the same size.
    """
    return select_group_with_sources(example, epoch, group_size, seed, fallback)[0]


def select_group_with_sources(
    example: TrainExample, epoch: int, group_size: int, seed: int = 0, fallback: list | None = None
) -> tuple[list, "np.ndarray"]:
    """:func:`select_group`'s passages, and where each one came from: its index in
    ``[*example.positives, *example.negatives]``, or -1 for a passage drawn from
    ``fallback``. Per-passage data (teacher scores) follows the choice through it."""

    if not len(example.positives):  # lists of ids, or arrays of corpus rows
        raise ValueError(f"query {example.query_id!r} has no positive")
    key = query_seed(seed, example.query_id)
    positive_index = (key + epoch) % len(example.positives)
    positive = example.positives[positive_index]
    k = group_size - 1
    if k <= 0:
        return [positive], np.array([positive_index], dtype=np.int64)
    negatives, offset = list(example.negatives), len(example.positives)
    if not negatives:
        excluded = set(example.positives)
        negatives, offset = [d for d in (fallback or []) if d not in excluded], None
        if not negatives:
            raise ValueError(f"query {example.query_id!r} has no negatives and no fallback passages")
    rng = np.random.default_rng([key % 2**63, epoch])
    if len(negatives) < k:
        chosen = rng.integers(len(negatives), size=k)
    else:
        order = np.random.default_rng(key % 2**63).permutation(len(negatives))
        start = epoch * k % len(negatives)
        chosen = np.concatenate([order, order])[start : start + k]
    sources = np.concatenate([[positive_index], chosen + offset if offset is not None else np.full(k, -1)])
    return [positive] + [negatives[i] for i in chosen], sources.astype(np.int64)
