"""A searcher's IVF shards merged into one index against the same shards searched apart.

Over an index that `jobs/index.py` built (its shards filled from one trained quantiser, each
record keeping its list sizes), side by side in one run:
  1. peak memory (VmHWM, the kernel's high-water mark) of a fresh process that loads the
     shards as a searcher now does (`load_merged_shards`: one index, sized once) and of one
     that loads them apart;
  2. queries/s of the two over the same random queries, alternated, at the given nprobe and
     depth, with the top-k compared (same scores; the same ids, ties aside).

Usage: python bench/bench_merged_shards.py --index runs/index [--queries 1000] [--k 200]
       [--nprobe 16] [--threads 0] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402
from pipeline.core import storage  # noqa: E402
from pipeline.retrieval import faiss_index  # noqa: E402

GIB = 2**30


def load(index_uri: str, merged: bool) -> list:
    entries = faiss_index.load_index_manifest(index_uri)["shards"]
    if merged:
        return faiss_index.load_merged_shards(index_uri, entries)
    return [faiss_index.load_index(storage.join(index_uri, entry["path"])) for entry in entries]


def peak_of_loading(index_uri: str, merged: bool) -> dict:
    """Load in a fresh process (so the peak is the loading's alone) and read its VmHWM."""
    code = (
        "import json, sys, time; sys.path.insert(0, sys.argv[1]); from bench.bench_merged_shards import load; "
        "t = time.perf_counter(); n = len(load(sys.argv[2], sys.argv[3] == 'merged')); s = time.perf_counter() - t; "
        "hwm = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
        "print(json.dumps({'indexes': n, 'load_s': round(s, 1), 'peak_gib': round(hwm / 2**30, 3)}))"
    )
    kind = "merged" if merged else "apart"
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO_ROOT), index_uri, kind], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def tiny_index(folder: str) -> str:
    """The smoke run's index: 2 shards of 1,000 random 32-d vectors, IVF16 from one quantiser."""
    import ray

    from pipeline.core.runtime import init_ray
    from pipeline.retrieval import embeddings as emb
    from pipeline.retrieval.faiss_index import IndexConfig
    from pipeline.retrieval.index_build import IndexJobConfig, run_indexing

    vectors = np.random.default_rng(0).standard_normal((2000, 32)).astype(np.float32)
    entries = [
        emb.write_shard(f"{folder}/emb", i, rows, [f"d{r}" for r in rows], vectors[rows])
        for i, rows in enumerate(np.split(np.arange(2000), 2))
    ]
    emb.write_manifest(f"{folder}/emb", 32, entries, normalized=False, similarity="dot", model="random")
    job = IndexJobConfig(embeddings=f"{folder}/emb", output=f"{folder}/index", index=IndexConfig(factory="IVF16,Flat"))
    init_ray(job.ray)
    run_indexing(job)
    ray.shutdown()
    return f"{folder}/index"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", default="", help="jobs/index.py's output (required but with --smoke)")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=200)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="FAISS threads; 0 = the machine's cores")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, queries=50, k=10, nprobe=4, rounds=1)
    if args.smoke and not args.index:
        args.index = tiny_index(tempfile.mkdtemp())
    elif not args.index:
        parser.error("--index is required")
    manifest = faiss_index.load_index_manifest(args.index)
    files = sum(
        os.path.getsize(storage.join(args.index, e["path"])) for e in manifest["shards"] if "://" not in args.index
    )
    result: dict = {
        "index": args.index,
        "factory": manifest["factory"],
        "shards": len(manifest["shards"]),
        "vectors": sum(e["vectors"] for e in manifest["shards"]),
        "shard_files_gib": round(files / GIB, 3),
        "load": {"merged": peak_of_loading(args.index, True), "apart": peak_of_loading(args.index, False)},
    }
    print(json.dumps(result), flush=True)
    faiss.omp_set_num_threads(max(1, args.threads or os.cpu_count() or 1))
    merged, apart = load(args.index, True), load(args.index, False)
    queries = np.random.default_rng(0).standard_normal((args.queries, manifest["dim"])).astype(np.float32)
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        ref = faiss_index.search_shards(apart, queries, args.k, manifest["metric"], nprobe=args.nprobe)
        apart_s = time.perf_counter() - started
        started = time.perf_counter()
        got = faiss_index.search_shards(merged, queries, args.k, manifest["metric"], nprobe=args.nprobe)
        merged_s = time.perf_counter() - started
        rounds.append(
            {
                "apart_queries_per_s": round(args.queries / apart_s, 1),
                "merged_queries_per_s": round(args.queries / merged_s, 1),
                "speedup": round(apart_s / merged_s, 2),
                "max_score_difference": float(np.abs(ref[0] - got[0]).max()),
                "same_ids": round(float((ref[1] == got[1]).mean()), 5),
            }
        )
        print(json.dumps(rounds[-1]), flush=True)
    result["search"] = {"queries": args.queries, "k": args.k, "nprobe": args.nprobe, "rounds": rounds}
    result["faiss"], result["cpus"] = faiss.__version__, os.cpu_count()
    if args.json:
        record.write(args.json, result)


if __name__ == "__main__":
    main()
