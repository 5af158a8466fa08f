"""The sizing table of cluster/guide/sizing.md: corpus size -> encoding time, index memory, nodes.

    python cluster/sizing.py          # prints the Markdown table that page carries

Index bytes come from the memory planner the index job itself uses
(``pipeline.retrieval.index_memory.plan_memory``), for the shard split the job would need. Encoding times
scale the one measured encoding rate (bench/reports/, bench_search.py's report: 2-core CPU, MiniLM) by arithmetic;
no GPU rate has been measured. tests/cluster/test_cluster.py checks that the README's table is this
script's output, so the figures are never edited by hand.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.retrieval.index_memory import plan_memory  # noqa: E402

# bench_search.py's report (bench/reports/): 1 CPU actor with 1 core and 1 torch thread, fp32, the
# 6-layer MiniLM (hidden 384), the first 4,000 Nave verses at max length 128 (steady state).
MEASURED_PASSAGES_PER_S = 117.3
MEASURED_CORES = 1
MEASURED_MODEL = dict(layers=6, hidden=384, intermediate=1536)
# Those verses are short: 34.2 tokens on average with [CLS] and [SEP] (MiniLM's tokenizer,
# truncated at 128; measured once on data/nave/corpus.jsonl.gz, lines 1-4,000).
MEASURED_MEAN_TOKENS = 34.2
BERT_BASE = dict(layers=12, hidden=768, intermediate=3072)
# The table assumes every passage fills max_len: exact for 100-word Wikipedia passages,
# an upper bound for MS MARCO's shorter ones.
PASSAGE_TOKENS = 128
DIM = BERT_BASE["hidden"]

# A search/mining node of cluster/aws.yaml: g6.4xlarge (1x L4 24 GB, 16 vCPU, 64 GiB).
# One index shard per node, at most SHARD_BUDGET: it must fit the L4 for GPU search, and
# building it can briefly need twice its size in RAM next to Ray's object store (30% of RAM).
SHARD_BUDGET = 20 * 2**30
ENCODE_NODE_VCPUS = 32  # m6i.8xlarge: CPU encoding with 32 one-thread actors (this machine's cores are vCPUs too)

CORPORA = [
    (1_000_000, "1M"),
    (8_841_823, "MS MARCO passages, 8.8M"),
    (21_015_324, "Wikipedia (DPR), 21M"),
    (100_000_000, "100M"),
]


def forward_flops(tokens: float, layers: int, hidden: int, intermediate: int) -> float:
    """FLOPs (2 x multiply-adds) of one encoder forward over a passage of ``tokens``:
    Q, K, V, O and the FFN per token, plus attention scores and mixing over the passage.
    Embeddings and pooling are negligible."""
    per_token_per_layer = 4 * hidden * hidden + 2 * hidden * intermediate + 2 * tokens * hidden
    return 2.0 * tokens * layers * per_token_per_layer


def cpu_core_hours(passages: int, model: dict, tokens: float = PASSAGE_TOKENS) -> float:
    """Core-hours to encode ``passages`` of ``tokens`` each, at the FLOP rate the measured
    run achieved (an extrapolation: CPU FLOP throughput assumed equal across model sizes
    and lengths; larger matrices usually run a little faster)."""
    measured_flops_per_s = MEASURED_PASSAGES_PER_S * forward_flops(MEASURED_MEAN_TOKENS, **MEASURED_MODEL)
    per_core = measured_flops_per_s / MEASURED_CORES
    return passages * forward_flops(tokens, **model) / per_core / 3600


def ivf_nlist(n: int) -> int:
    """About 4 sqrt(n) lists, a power of two (FAISS's usual rule of thumb)."""
    return min(65536, max(16, 2 ** round(math.log2(4 * math.sqrt(n)))))


def shard_plan(factory: str, n: int, dim: int = DIM, budget: int = SHARD_BUDGET) -> tuple[int, int]:
    """(total bytes, shards): the fewest equal shards whose every planned size fits ``budget``."""
    shards = 1
    while True:
        sizes = [n // shards + (1 if i < n % shards else 0) for i in range(shards)]
        plan = plan_memory(factory, dim, sizes)
        if max(row["bytes"] for row in plan) <= budget:
            return sum(row["bytes"] for row in plan), shards
        shards += 1


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**40 else f"{n / 2**40:,.2f} TiB"


def hours(h: float) -> str:
    return f"{h:,.1f}" if h < 100 else f"{h:,.0f}"


def table() -> str:
    rows = [
        "| corpus (passages) | embeddings on S3 (768-d fp32) "
        "| CPU encoding, MiniLM-L6: core-hours (hours on one m6i.8xlarge) "
        "| CPU encoding, BERT-base: core-hours (hours on one m6i.8xlarge) "
        "| Flat (fp32) index: size, g6.4xlarge nodes "
        "| SQfp16 index: size, nodes | IVF,PQ64 index: size, nodes |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, name in CORPORA:
        cells = [name, gib(n * DIM * 4)]
        for model in (MEASURED_MODEL, BERT_BASE):
            core_h = cpu_core_hours(n, model)
            cells.append(f"{hours(core_h)} ({hours(core_h / ENCODE_NODE_VCPUS)} h)")
        for factory in ("Flat", "SQfp16", f"IVF{ivf_nlist(n)},PQ64"):
            total, shards = shard_plan(factory, n)
            label = f" ({factory})" if factory.startswith("IVF") else ""
            cells.append(f"{gib(total)}, {shards}{label}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# The per-stage table: MS MARCO's mean passage (340 bytes of text) and a bm25s vocabulary of
# 2M entries a 1M-passage shard (Nave measured 15k entries for 37k verses; a web corpus's
# long tail is assumed). The stored BM25 index: 1.15 bytes a byte of text, the larger of
# what synthetic MS MARCO-length text (1.15) and Nave (0.86) measured (docs/retrieval/bm25.md).
PASSAGE_TEXT_BYTES = 340
BM25_VOCAB_PER_SHARD = 2_000_000
BM25_INDEX_PER_TEXT_BYTE = 1.15
TRAINING_QUERIES = 502_939  # MS MARCO's; the teacher scores them at depth 30, mining at 200
STAGE_CORPORA = [(8_841_823, "8.8M (MS MARCO)"), (50_000_000, "50M"), (500_000_000, "500M")]


def staged(n: int, shard_docs: int = 50_000) -> dict:
    """A synthetic text staging of ``n`` passages, as stage_text's manifest lists it."""
    shards = [
        {"first_row": i, "rows": min(shard_docs, n - i), "text_bytes": min(shard_docs, n - i) * PASSAGE_TEXT_BYTES}
        for i in range(0, n, shard_docs)
    ]
    return {"docs": n, "shards": shards}


def stages_table() -> str:
    from pipeline.retrieval.bm25_index import IndexPlan, serve_memory
    from pipeline.retrieval.fanout import query_block
    from pipeline.retrieval.rerank_scoring import scoring_block

    rows = [
        "| corpus | staged text | BM25: index stored | BM25: servers x reservation (total) | BM25: a build task reserves "
        "| embeddings, one encoding (768-d fp32) | IVF,PQ64 index | mining: query blocks (objects) "
        "| teacher scoring: tasks (objects) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, name in STAGE_CORPORA:
        text = staged(n)
        plan = IndexPlan.of(text, 1_000_000)
        servers = [
            serve_memory(
                {
                    "index_bytes": int(BM25_INDEX_PER_TEXT_BYTE * PASSAGE_TEXT_BYTES * sum(i["rows"] for i in load)),
                    "vocab_entries": BM25_VOCAB_PER_SHARD,
                    "docs": sum(i["rows"] for i in load),
                }
            )
            for load in plan.loads
        ]
        build = max(plan.build_memory(load, 0) for load in plan.loads)
        ivf_bytes, ivf_shards = shard_plan(f"IVF{ivf_nlist(n)},PQ64", n)
        block = query_block(ivf_shards, 200, DIM, TRAINING_QUERIES)
        cells = [
            name,
            gib(n * PASSAGE_TEXT_BYTES),
            gib(BM25_INDEX_PER_TEXT_BYTE * n * PASSAGE_TEXT_BYTES),
            f"{len(servers)} x {gib(max(servers))} ({gib(sum(servers))})",
            gib(build),
            gib(n * DIM * 4),
            gib(ivf_bytes),
            f"{-(-TRAINING_QUERIES // block):,}",
            f"{-(-TRAINING_QUERIES // scoring_block(30, TRAINING_QUERIES)):,}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
    print()
    print(stages_table())
