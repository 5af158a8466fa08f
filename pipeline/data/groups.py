"""Which negatives a query gets from its ranking (:func:`select_negatives`: BM25 and dense
mining alike), and which positive and negatives it trains on in each epoch (groups)."""

from __future__ import annotations

import numpy as np

from pipeline.data.examples import TrainExample, query_seed


def select_negatives(
    query_id: str,
    ranked_ids: list[str],
    ranked_scores: list[float],
    excluded: set[str],
    sampling,
    ceiling: float = float("inf"),
) -> tuple[list[str], list[float]]:
    """A query's negatives from its ranking, best first: the best ``sampling.skip_top``
    candidates left out (likely unjudged positives), then ``excluded`` (judged positives,
    answer hits) and those scoring above ``ceiling`` (within a margin of the positive's
    score: :func:`margin_ceiling`), then the best ``sampling.count``, or with
    ``sampling.sample == "random"`` a draw of ``count`` seeded by (``sampling.seed``, query
    id), kept in rank order.

    ``sampling`` is any config with ``count``, ``sample``, ``seed`` and ``skip_top``: BM25's
    and dense mining's draw the same negatives from the same ranking."""

    top = sampling.skip_top
    candidates = [(d, s) for d, s in zip(ranked_ids[top:], ranked_scores[top:]) if d not in excluded and s <= ceiling]
    if sampling.sample == "random" and len(candidates) > sampling.count:
        rng = np.random.default_rng([query_seed(sampling.seed, query_id) % 2**63])
        candidates = [candidates[i] for i in np.sort(rng.choice(len(candidates), sampling.count, replace=False))]
    candidates = candidates[: sampling.count]
    return [d for d, _ in candidates], [float(s) for _, s in candidates]


def margin_ceiling(positive_score: float, absolute_margin: float | None, relative_margin: float | None) -> float:
    """The highest score a negative may have, given the query's positive score (its hardest
    or easiest positive's: ``--margin_positive``): at least ``absolute_margin`` below it,
    and at least ``relative_margin`` of its magnitude below it, as sentence-transformers'
    ``mine_hard_negatives`` keeps them (a candidate that close is likelier an unjudged
    positive than a negative)."""
    ceiling = float("inf")
    if absolute_margin is not None:
        ceiling = min(ceiling, positive_score - absolute_margin)
    if relative_margin is not None:
        ceiling = min(ceiling, positive_score - abs(positive_score) * relative_margin)
    return ceiling


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
