"""Retrieval metrics, always computed by ``ir_measures`` (never by hand), so they match
published tooling exactly."""

from __future__ import annotations

from typing import Iterable

import ir_measures

DEFAULT_MEASURES = ("RR@10", "R@100", "nDCG@10")


def evaluate(
    qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]], measures: Iterable[str] = DEFAULT_MEASURES
) -> dict[str, float]:
    """Aggregate metrics over the judged queries (a query missing from the run scores 0)."""

    parsed = [ir_measures.parse_measure(m) for m in measures]
    values = ir_measures.calc_aggregate(parsed, qrels, run)
    return {str(m): float(values[m]) for m in parsed}


JOB_MEASURES = {"MRR@10": "RR@10", "R@10": "R@10", "R@100": "R@100", "R@1000": "R@1000", "nDCG@10": "nDCG@10"}


def metrics_table(metrics: dict[str, float]) -> str:
    names = list(metrics)
    return " | ".join(f"{n:>8}" for n in names) + "\n" + " | ".join(f"{metrics[n]:8.4f}" for n in names)
