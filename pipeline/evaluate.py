"""Exact (brute-force) dense retrieval and its metrics, in one process.

This is the small-collection path, used until the sharded encoding and FAISS indexing of
the pipeline land: it encodes every passage in memory. Metrics are always computed by
``ir_measures``, never by hand, so they match published tooling exactly.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

DEFAULT_MEASURES = ("RR@10", "R@100", "nDCG@10")


@torch.no_grad()
def encode_texts(encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokenizer, texts: list[str],
                 max_len: int, batch_size: int = 128, device: str = "cpu") -> torch.Tensor:
    """(N, H) float32 representations; ``encode`` is e.g. ``BiEncoder.encode_passage``."""
    out = []
    # Sorting by length keeps padding (and time) small; the order is restored at the end.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_len,
                        return_tensors="pt")
        out.append(encode(enc["input_ids"].to(device), enc["attention_mask"].to(device)).float().cpu())
    reps = torch.cat(out) if out else torch.zeros(0, 0)
    restored = torch.empty_like(reps)
    restored[torch.tensor(order, dtype=torch.long)] = reps
    return restored


def exact_search(queries: torch.Tensor, passages: torch.Tensor, k: int, block: int = 1024,
                 similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` (scores, passage indices) per query by exhaustive scoring, in query blocks."""
    similarity = similarity or (lambda q, p: q @ p.T)
    k = min(k, passages.shape[0])
    scores, indices = [], []
    for start in range(0, queries.shape[0], block):
        s, i = similarity(queries[start:start + block], passages).topk(k, dim=1)
        scores.append(s)
        indices.append(i)
    return torch.cat(scores), torch.cat(indices)


def to_run(query_ids: list[str], doc_ids: list[str], scores: torch.Tensor,
           indices: torch.Tensor) -> dict[str, dict[str, float]]:
    """The ``{qid: {docid: score}}`` run that ``ir_measures`` reads."""
    return {qid: {doc_ids[j]: float(s) for s, j in zip(row_s.tolist(), row_i.tolist())}
            for qid, row_s, row_i in zip(query_ids, scores, indices)}


def evaluate(qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]],
             measures: Iterable[str] = DEFAULT_MEASURES) -> dict[str, float]:
    """Aggregate metrics over the judged queries (a query missing from the run scores 0)."""
    import ir_measures

    parsed = [ir_measures.parse_measure(m) for m in measures]
    values = ir_measures.calc_aggregate(parsed, qrels, run)
    return {str(m): float(values[m]) for m in parsed}
