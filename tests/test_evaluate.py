"""Exact search against brute force, encoding order, and metrics against ir_measures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.retrieval.evaluate import encode_texts, exact_search, to_run
from pipeline.retrieval.metrics import evaluate


@pytest.mark.parametrize("block", [1, 7, 1024])
def test_exact_search_equals_a_full_sort(block):
    g = torch.Generator().manual_seed(0)
    q, p = torch.randn(23, 16, generator=g), torch.randn(300, 16, generator=g)
    scores, indices = exact_search(q, p, k=10, block=block)
    full = (q @ p.T).numpy()
    expected = np.argsort(-full, axis=1)[:, :10]
    assert (indices.numpy() == expected).all()
    assert np.allclose(scores.numpy(), np.take_along_axis(full, expected, axis=1), atol=1e-5)
    assert exact_search(q, p[:4], k=10)[1].shape == (23, 4)  # k capped at the collection


class LengthTokenizer:
    """Encodes a text as its characters' code points (enough to check batching and order)."""

    def __call__(self, texts, padding, truncation, max_length, return_tensors):
        longest = min(max(len(t) for t in texts), max_length)
        ids = torch.zeros(len(texts), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(texts):
            codes = [ord(c) for c in t[:longest]]
            ids[i, : len(codes)] = torch.tensor(codes)
            mask[i, : len(codes)] = 1
        return {"input_ids": ids, "attention_mask": mask}


def test_encoding_in_length_sorted_batches_keeps_the_input_order():
    texts = ["ccc", "a", "bbbbbb", "dd", "e" * 10, "ff"]
    encode = lambda ids, mask: torch.stack([(ids * mask).sum(1).float(), mask.sum(1).float()], dim=1)
    reps = encode_texts(encode, LengthTokenizer(), texts, max_len=8, batch_size=2)
    for text, rep in zip(texts, reps):
        body = text[:8]
        assert rep.tolist() == [float(sum(map(ord, body))), float(len(body))]


def test_metrics_equal_a_hand_computation_and_count_unretrieved_queries():
    qrels = {"q1": {"d1": 1}, "q2": {"d3": 1, "d9": 1}, "q3": {"d2": 1}}
    scores = torch.tensor([[3.0, 2.0, 1.0], [5.0, 4.0, 3.0]])
    indices = torch.tensor([[0, 1, 2], [1, 0, 2]])
    run = to_run(["q1", "q2"], ["d1", "d2", "d3"], scores, indices)
    assert run == {"q1": {"d1": 3.0, "d2": 2.0, "d3": 1.0}, "q2": {"d2": 5.0, "d1": 4.0, "d3": 3.0}}
    metrics = evaluate(qrels, run, ["RR@10", "R@2", "R@10"])
    # q1: first hit at rank 1; q2: d3 at rank 3 (of 2 relevant); q3: not retrieved, scores 0.
    assert metrics["RR@10"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert metrics["R@2"] == pytest.approx((1 + 0 + 0) / 3)
    assert metrics["R@10"] == pytest.approx((1 + 0.5 + 0) / 3)
