"""Searchers and query blocks planned for MS MARCO and a 50M-passage corpus, old rule against
new, side by side (no Ray, no data: the planners alone, in seconds).

  searchers    old: one per GPU up (at most one per index shard), the index in fp32;
               new: as few as hold the index in one GPU each (fp16 Flat), the same
               whatever is up. Printed: searchers, GiB each on its GPU, and whether
               that fits the card (0.9 of it less 1.25 GiB).
  blocks       old: max(64, 4096 // index shards) queries; new: ``query_block`` (a block's
               answers near 256 MiB). Printed for 502k training queries at depth 200,
               with the objects a mining stage writes (old: 5 a block, vectors, negatives,
               training file, run and counts; new: 2, vectors and one results object) and
               the driver's reads to join them (old: 3 a block, one after another; new:
               none, three Ray tasks read their own section of each block).

These are plans, not measurements: what a run on such a cluster would start and write.

Usage: python bench/bench_search_plan.py [--json bench/results/search_plan-arithmetic.json]
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402
from pipeline.retrieval import gpu_search, index_memory  # noqa: E402
from pipeline.retrieval.fanout import query_block  # noqa: E402
from pipeline.retrieval.search import SearcherConfig, plan_searchers  # noqa: E402

GIB = 2**30
CORPORA = {"msmarco_8.8m": 8_800_000, "corpus_50m": 50_000_000}
SHARD_VECTORS, DIM, QUERIES, DEPTH = 100_000, 768, 502_000, 200
OLD_OBJECTS_WRITTEN, NEW_OBJECTS_WRITTEN, OLD_DRIVER_JOIN_GETS = 5, 2, 3


def old_plan(shards: int, gpus_up: int) -> tuple[int, float]:
    count = max(1, min(gpus_up, shards))
    fp32 = index_memory.plan_memory("Flat", DIM, [SHARD_VECTORS])[0]["bytes"]
    return count, math.ceil(shards / count) * fp32 / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="")
    args = smoke.parse(parser)  # the planners alone take a second: the smoke run is the real one
    rows = []
    for name, passages in CORPORA.items():
        shards = passages // SHARD_VECTORS
        manifest = {"factory": "Flat", "dim": DIM, "metric": "ip", "shards": [{"vectors": SHARD_VECTORS}] * shards}
        for gpu_gb in (24, 40, 80):
            budget = gpu_search.usable_bytes(gpu_gb * GIB) / GIB
            try:
                plan = plan_searchers(manifest, SearcherConfig(use_gpu=True, gpu_memory_gb=gpu_gb), cluster={})
                new = (len(plan), max(len(e) for e, _ in plan) * SHARD_VECTORS * 1544 / GIB)
            except ValueError as exc:
                new = (0, float("nan"))
                print(f"{name} {gpu_gb} GB: refused: {exc}")
            for gpus_up in (1, 8, 128):
                old = old_plan(shards, gpus_up)
                old_block, new_block = max(64, 4096 // shards), query_block(new[0], DEPTH, DIM)
                old_blocks, new_blocks = -(-QUERIES // old_block), -(-QUERIES // new_block)
                row = {
                    "corpus": name,
                    "gpu_gb": gpu_gb,
                    "gpus_up": gpus_up,
                    "old_searchers": old[0],
                    "old_gib_each": round(old[1], 2),
                    "old_fits": old[1] <= budget,
                    "new_searchers": new[0],
                    "new_gib_each": round(new[1], 2),
                    "new_fits": new[1] <= budget,
                    "old_block": old_block,
                    "new_block": new_block,
                    "old_blocks": old_blocks,
                    "new_blocks": new_blocks,
                    "old_objects_written": old_blocks * OLD_OBJECTS_WRITTEN,
                    "new_objects_written": new_blocks * NEW_OBJECTS_WRITTEN,
                    "old_driver_join_gets": old_blocks * OLD_DRIVER_JOIN_GETS,
                    "new_driver_join_gets": 0,
                }
                rows.append(row)
    header = f"{'corpus':<13}{'GPU':>5}{'up':>5} | {'old srch':>8}{'GiB':>7}{'fits':>6} | {'new srch':>8}{'GiB':>7}{'fits':>6} | {'blocks old/new':>15} | {'objects old/new':>16}"
    print(header)
    for r in rows:
        print(
            f"{r['corpus']:<13}{r['gpu_gb']:>5}{r['gpus_up']:>5} | {r['old_searchers']:>8}{r['old_gib_each']:>7}"
            f"{str(r['old_fits']):>6} | {r['new_searchers']:>8}{r['new_gib_each']:>7}{str(r['new_fits']):>6} | "
            f"{r['old_blocks']:>7}/{r['new_blocks']:<7} | {r['old_objects_written']:>7}/{r['new_objects_written']:<8}"
        )
    results = {
        "bench": "search_plan",
        "device": "planner only (no hardware measured)",
        "python": platform.python_version(),
        "queries": QUERIES,
        "depth": DEPTH,
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        record.write(args.json, results)


if __name__ == "__main__":
    main()
