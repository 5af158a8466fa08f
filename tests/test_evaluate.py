"""Metrics: ir_measures, checked against a hand computation."""

from __future__ import annotations

import pytest

from pipeline.retrieval.metrics import evaluate


def test_metrics_equal_a_hand_computation_and_count_unretrieved_queries():
    qrels = {"q1": {"d1": 1}, "q2": {"d3": 1, "d9": 1}, "q3": {"d2": 1}}
    run = {"q1": {"d1": 3.0, "d2": 2.0, "d3": 1.0}, "q2": {"d2": 5.0, "d1": 4.0, "d3": 3.0}}
    metrics = evaluate(qrels, run, ["RR@10", "R@2", "R@10"])
    # q1: first hit at rank 1; q2: d3 at rank 3 (of 2 relevant); q3: not retrieved, scores 0.
    assert metrics["RR@10"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert metrics["R@2"] == pytest.approx((1 + 0 + 0) / 3)
    assert metrics["R@10"] == pytest.approx((1 + 0.5 + 0) / 3)
