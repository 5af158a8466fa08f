"""Plans at 500M passages, from synthetic manifests (nothing is built): what each stage's
tasks and servers reserve, and how many objects it writes, bounded where a cluster of the
kit's node types holds them (cluster/values.yaml: 64 GiB CPU nodes; L4, A100 and H100 GPUs).

The 500M corpus: 10,000 staged shards of 50,000 passages at MS MARCO's mean of 340 bytes
(170 GB of text); vocabularies of 2M terms a 1M-passage load and 200M over the corpus."""

from __future__ import annotations

import pytest

from pipeline.retrieval import bm25_index
from pipeline.retrieval.fanout import query_block
from pipeline.retrieval.rerank_scoring import scoring_block
from pipeline.retrieval.search import SearcherConfig, plan_searchers

GIB = 2**30
PASSAGES, SHARD_DOCS, PASSAGE_BYTES = 500_000_000, 50_000, 340
NODE_MEMORY = 64 * GIB  # the kit's CPU worker nodes
TERM_BYTES = 20  # an Arrow (term, df) row: ~8 bytes of term, its offset, an int64
LOAD_TERMS, CORPUS_TERMS = 2_000_000, 200_000_000


def staged_500m() -> dict:
    shards = [
        {
            "index": i,
            "text_uri": f"s3://b/staged/text-{i:05d}-0000.parquet",
            "first_row": i * SHARD_DOCS,
            "rows": SHARD_DOCS,
            "text_bytes": SHARD_DOCS * PASSAGE_BYTES,
        }
        for i in range(PASSAGES // SHARD_DOCS)
    ]
    return {"source": "s3://b/corpus", "version": "v", "docs": PASSAGES, "shards": shards}


def test_bm25_at_500m_plans_tasks_and_servers_a_64_gib_node_holds():
    """500 loads of 1M passages: each build task reserves under 6 GiB and each server under
    2 GiB (it reserved 512 MiB + 12x its text, 4.3 GiB, for its whole life, before: 2.35 TB
    over the corpus); the statistics in 80 partitions, so a tree task sums at most 8 tables
    of a load's share (under 1 GiB) and a build task looks up 40 MB of terms at a time
    (the one merge task of before held every load's vocabulary: 20 GB, unreserved)."""
    plan = bm25_index.IndexPlan.of(staged_500m(), 1_000_000)
    assert len(plan.loads) == 500 and plan.partitions == 80
    leaf = LOAD_TERMS * TERM_BYTES // plan.partitions
    assert bm25_index.merge_memory(bm25_index.FAN_IN * leaf) < GIB
    root = CORPUS_TERMS * TERM_BYTES // plan.partitions
    assert bm25_index.merge_memory(root) < GIB
    build = max(plan.build_memory(load, root) for load in plan.loads)
    assert build < 6 * GIB and build * 10 < NODE_MEMORY
    load_text = 1_000_000 * PASSAGE_BYTES
    shard = {"index_bytes": int(1.15 * load_text), "vocab_entries": LOAD_TERMS, "docs": 1_000_000}
    serve = bm25_index.serve_memory(shard)
    assert serve < 2 * GIB
    before = 512 * 2**20 + 12 * load_text
    assert before > 2 * serve and 500 * before > 2.3e12 > 500 * serve


def test_gpu_searchers_at_500m_ivf_pq_are_planned_for_the_smallest_gpu_they_may_land_on():
    """500M 768-d vectors at IVF65536,PQ64 in 5,000 index shards: with an L4, an A100 and an
    H100 node up, the plan is the L4's (24 GB), every searcher's share within it; pinned to
    the H100, fewer searchers; no searcher's host memory exceeds a 64 GiB node."""
    manifest = {"factory": "IVF65536,PQ64", "dim": 768, "metric": "ip", "shards": [{"vectors": 100_000}] * 5_000}
    mixed = {"GPU": 3, "accelerator_type:L4": 1, "accelerator_type:A100": 1, "accelerator_type:H100": 1}
    on_l4 = plan_searchers(manifest, SearcherConfig(use_gpu=True), cluster=mixed)
    assert on_l4 == plan_searchers(manifest, SearcherConfig(use_gpu=True, gpu_memory_gb=24), cluster={})
    on_h100 = plan_searchers(manifest, SearcherConfig(use_gpu=True, accelerator_type="H100"), cluster=mixed)
    assert len(on_h100) < len(on_l4)
    assert all(options["memory"] < NODE_MEMORY for _, options in on_l4 + on_h100)


@pytest.mark.parametrize(
    "stage,blocks,at_most",
    [
        # mining MS MARCO's 502,939 training queries at depth 200 on 8 searchers
        ("mine", -(-502_939 // query_block(8, 200, 768, 502_939)), 1_000),
        # the teacher's scoring of them at depth 30
        ("teacher scoring", -(-502_939 // scoring_block(30, 502_939)), 500),
        # the same queries against a 500M index on 64 searchers: a block holds every
        # searcher's answers, so blocks shrink as searchers grow (476 queries a block)
        ("mine at 500M", -(-502_939 // query_block(64, 200, 768, 502_939)), 1_100),
    ],
)
def test_each_stage_writes_objects_by_the_block_not_the_query(stage, blocks, at_most):
    """A query block is one object (pipeline.core.parts): the objects a stage writes are
    its blocks, sized by bytes."""
    assert blocks <= at_most, stage
