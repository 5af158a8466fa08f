"""The query block a search uses when none is set: sized by the formula for the searchers
the index plans and its depth, never a constant (a block of 64 queries at MS MARCO's
502,939 training queries is 7,859 blocks, each a Ray task and a merge)."""

from __future__ import annotations

import pytest

from pipeline.retrieval import search
from pipeline.retrieval.search import SearcherConfig, query_block_of


def _manifest(shard_vectors: list[int]) -> dict:
    return {"factory": "Flat", "dim": 768, "metric": "ip", "shards": [{"vectors": n} for n in shard_vectors]}


@pytest.mark.parametrize(
    "searchers,k,expected",
    # 256 MiB over (searchers x k hits of 44 bytes + a 768-d query vector): 268,435,456 //
    # (1 x 1000 x 44 + 3,072) = 5,702; // (4 x 1000 x 44 + 3,072) = 1,499; 1 x 10: capped at 16,384.
    [(1, 1000, 5702), (4, 1000, 1499), (1, 10, 16384)],
)
def test_the_default_block_follows_the_searchers_and_the_depth(monkeypatch, searchers, k, expected):
    """Mutation: ``query_block_of`` returning the old fixed 64 (the tests that search
    override it) fails every case."""
    monkeypatch.setattr(search.faiss_index, "load_index_manifest", lambda uri, check=True: _manifest([1000] * 8))
    cfg = SearcherConfig(searchers=searchers)
    assert query_block_of("/an/index", cfg, k) == expected


@pytest.mark.parametrize(
    "queries,expected",
    # 6,980 dev queries at k 1000: a 16th, 437 (5,702 would be 2 blocks); 502,939 training
    # queries: 5,702 still (a 16th is 31,434); 300 queries: MIN_BLOCK, 64.
    [(6_980, 437), (502_939, 5702), (300, 64), (0, 5702)],
)
def test_a_search_of_many_queries_is_at_least_sixteen_blocks_so_its_progress_moves(monkeypatch, queries, expected):
    """Mutation: ``queries`` ignored in ``query_block`` gives 5,702 for the dev queries, and
    the progress line sits at 0 until the second of two blocks."""
    monkeypatch.setattr(search.faiss_index, "load_index_manifest", lambda uri, check=True: _manifest([1000] * 8))
    assert query_block_of("/an/index", SearcherConfig(searchers=1), 1000, queries) == expected
