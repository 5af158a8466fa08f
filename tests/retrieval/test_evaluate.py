"""Metrics: ir_measures, checked against a hand computation."""

from __future__ import annotations

import os

import pytest

from pipeline.retrieval.metrics import StreamedMetrics, evaluate


def test_metrics_equal_a_hand_computation_and_count_unretrieved_queries():
    qrels = {"q1": {"d1": 1}, "q2": {"d3": 1, "d9": 1}, "q3": {"d2": 1}}
    run = {"q1": {"d1": 3.0, "d2": 2.0, "d3": 1.0}, "q2": {"d2": 5.0, "d1": 4.0, "d3": 3.0}}
    metrics = evaluate(qrels, run, ["RR@10", "R@2", "R@10"])
    # q1: first hit at rank 1; q2: d3 at rank 3 (of 2 relevant); q3: not retrieved, scores 0.
    assert metrics["RR@10"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert metrics["R@2"] == pytest.approx((1 + 0 + 0) / 3)
    assert metrics["R@10"] == pytest.approx((1 + 0.5 + 0) / 3)


def test_streamed_metrics_equal_ir_measures_on_the_whole_run():
    """Blocks of queries as the searchers answer them: the same means as ir_measures over the
    whole run, with a query judged but never retrieved and one judged only non-relevant."""
    qrels = {"q1": {"d1": 1}, "q2": {"d3": 1, "d9": 2}, "q3": {"d2": 1}, "q4": {"d5": 0}, "q5": {"d4": 1}}
    run = {
        "q1": {"d1": 3.0, "d2": 2.0, "d3": 1.0},
        "q2": {"d2": 5.0, "d9": 4.0, "d3": 3.0},
        "q4": {"d5": 1.0},
        "q5": {"d1": 2.0, "d4": 1.0},
        "q6": {"d1": 1.0},  # not judged: ignored by both
    }
    measures = ["RR@10", "R@2", "nDCG@10", "R@100"]
    streamed = StreamedMetrics(qrels, measures)
    for block in ({"q1": run["q1"]}, {"q2": run["q2"], "q4": run["q4"]}, {"q5": run["q5"], "q6": run["q6"]}):
        streamed.add(block)
    whole = evaluate(qrels, run, measures)
    assert streamed.result() == pytest.approx(whole, abs=1e-12)
    assert whole["RR@10"] == pytest.approx((1 + 1 / 2 + 0 + 0 + 1 / 2) / 5)


def test_a_beir_folder_is_found_in_either_layout_plain_or_gzipped():
    """The bundled sample (a file per split) and Nave (the same, gzipped) resolve; a split
    a folder lacks is an error naming the folder and what was looked for."""
    import pytest

    from pipeline.core.errors import InputError
    from pipeline.retrieval.evaluate import beir_collection

    sample = beir_collection("data/bible-sample", "dev")
    assert [os.path.basename(p) for p in (sample.corpus, sample.queries, sample.qrels)] == [
        "corpus.jsonl",
        "queries.dev.jsonl",
        "qrels.dev.tsv",
    ]
    nave = beir_collection("data/nave", "dev")
    assert [os.path.basename(p) for p in (nave.corpus, nave.queries, nave.qrels)] == [
        "corpus.jsonl.gz",
        "queries.dev.jsonl.gz",
        "qrels.dev.tsv.gz",
    ]
    with pytest.raises(InputError, match=r"data/nave: no queries.test.jsonl or queries.jsonl \(split 'test'\)"):
        beir_collection("data/nave", "test")


def test_the_reported_measures_are_those_the_runs_depth_reaches():
    from pipeline.retrieval.metrics import JOB_MEASURES, measures_within

    assert list(measures_within(100, 37_457)) == ["MRR@10", "R@10", "R@100", "nDCG@10"]
    assert list(measures_within(40, 37_457)) == ["MRR@10", "R@10", "nDCG@10"]
    assert measures_within(80, 80) == JOB_MEASURES  # every passage retrieved: every recall is exact
