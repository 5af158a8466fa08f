"""BM25 at two corpus sizes: the stored index's build, its reuse, its shard servers' memory
against what they reserve, and round-1 negatives mined through tasks.

  corpus     synthetic passages of MS MARCO's length (55 words drawn from a Zipf vocabulary
             of 200k words, so the vocabulary grows with the corpus as real text's does);
  build      ``build_index`` over the staged corpus, one shard per ``--docs_per_shard``
             (both passes: term statistics in a tree of tasks, then the shards), then asked
             again: reused from storage, side by side;
  negatives  ``jobs/bm25_negatives.py``'s ``mine_negatives`` for ``--queries`` queries at
             depth 200 (each block merged and written by a task).

Printed for each size: wall times, the stored index's bytes per byte of text, vocabulary
entries, each build task's and server's peak RSS against its Ray reservation, the driver's
peak RSS, and the ratio build / reuse.

Usage: python bench/bench_bm25_scale.py [--sizes 250000,1000000] [--queries 20000]
           [--json bench/results/bm25_scale-cpu-2core.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402

WORDS_PER_PASSAGE = 55  # MS MARCO's passages: ~340 bytes, ~55 words


def write_corpus(folder: Path, passages: int, queries: int, seed: int = 0) -> dict:
    """A BEIR folder: Zipf-distributed words, queries of 6 words from a random passage, one
    judged positive each (the passage they came from)."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(200_000)])
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for start in range(0, passages, 10_000):
            n = min(10_000, passages - start)
            words = vocabulary[np.minimum(rng.zipf(1.2, size=(n, WORDS_PER_PASSAGE)) - 1, len(vocabulary) - 1)]
            f.writelines(
                json.dumps({"_id": f"p{start + i}", "text": " ".join(row)}) + "\n" for i, row in enumerate(words)
            )
    picked = rng.choice(passages, size=queries, replace=False)
    with open(folder / "corpus.jsonl") as f:
        texts = {}
        wanted = set(picked.tolist())
        for i, line in enumerate(f):
            if i in wanted:
                texts[i] = json.loads(line)["text"].split()
    with open(folder / "queries.jsonl", "w") as f:
        for q, p in enumerate(picked.tolist()):
            f.write(json.dumps({"_id": f"q{q}", "text": " ".join(rng.choice(texts[p], 6))}) + "\n")
    with open(folder / "qrels.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        f.writelines(f"q{q}\tp{p}\t1\n" for q, p in enumerate(picked.tolist()))
    return {
        k: str(folder / name)
        for k, name in (("corpus", "corpus.jsonl"), ("queries", "queries.jsonl"), ("qrels", "qrels.tsv"))
    }


def _driver_peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def measure(passages: int, queries: int, docs_per_shard: int, root: Path) -> dict:
    from pipeline.data.text_shards import stage_text
    from pipeline.retrieval import bm25_index
    from pipeline.retrieval.bm25 import build_index
    from pipeline.retrieval.bm25_negatives import Bm25Config, mine_negatives

    data = write_corpus(root / f"data-{passages}", passages, queries)
    text = stage_text(data["corpus"], str(root / f"text-{passages}"), min(50_000, docs_per_shard))
    text_bytes = sum(i["text_bytes"] for i in text["shards"])
    plan = bm25_index.IndexPlan.of(text, docs_per_shard)
    scoring = {"k1": 0.9, "b": 0.4, "method": "lucene", "lowercase": True, "stopwords": "en", "stemmer": ""}
    started = time.perf_counter()
    with build_index(text, **scoring, docs_per_shard=docs_per_shard) as index:
        built_s = time.perf_counter() - started
        manifest, served = index.index, index.shards
    started = time.perf_counter()
    with build_index(text, **scoring, docs_per_shard=docs_per_shard) as index:
        reused_s, reused = time.perf_counter() - started, index.index["reused"]
    shards = manifest["shards"]
    largest_partition = 0  # the terms a build task looked up are in the index's records
    terms = json.loads(Path(manifest["folder"], "terms", "terms.json").read_text())
    largest_partition = max(terms["partition_bytes"])
    cfg = Bm25Config(**data, output=str(root / f"neg-{passages}" / "negatives.jsonl"), docs_per_shard=docs_per_shard)
    cfg.text = str(root / f"text-{passages}")
    started = time.perf_counter()
    summary = mine_negatives(cfg)
    mined_s = time.perf_counter() - started
    return {
        "passages": passages,
        "queries": queries,
        "shards": len(shards),
        "partitions": manifest["partitions"],
        "vocab_size": manifest["vocab_size"],
        "index_bytes_per_text_byte": round(sum(s["index_bytes"] for s in shards) / text_bytes, 3),
        "build_s": round(built_s, 1),
        "reuse_s": round(reused_s, 2),
        "reused": reused,
        "build_over_reuse": round(built_s / reused_s, 1),
        "build_task_peak_over_reserved": round(
            max(
                s["build_peak_rss_bytes"] / plan.build_memory(load, largest_partition)
                for s, load in zip(shards, plan.loads)
            ),
            3,
        ),
        "server_peak_over_reserved": round(
            max(s["peak_rss_bytes"] / bm25_index.serve_memory(r) for s, r in zip(served, shards)), 3
        ),
        "server_peak_gib": round(max(s["peak_rss_bytes"] for s in served) / 2**30, 3),
        "negatives_s": round(mined_s, 1),
        "negatives_queries_per_s": round(queries / mined_s, 1),
        "index_reused_by_negatives": summary["index_reused"],
        "driver_peak_gib": _driver_peak_gib(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="250000,1000000")
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--docs_per_shard", type=int, default=250_000)
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, argv, sizes="3000,6000", queries=200, docs_per_shard=2_000)
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bm25-") as tmp:
        for passages in (int(s) for s in args.sizes.split(",")):
            rows.append(measure(passages, args.queries, args.docs_per_shard, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    figures = {"rows": rows, "docs_per_shard": args.docs_per_shard}
    if len(rows) == 2:
        figures["scaling"] = {
            "passages": round(rows[1]["passages"] / rows[0]["passages"], 2),
            "build_s": round(rows[1]["build_s"] / rows[0]["build_s"], 2),
            "vocab_size": round(rows[1]["vocab_size"] / rows[0]["vocab_size"], 2),
            "negatives_s": round(rows[1]["negatives_s"] / rows[0]["negatives_s"], 2),
        }
    if args.json:
        record.write(args.json, figures)


if __name__ == "__main__":
    main()
