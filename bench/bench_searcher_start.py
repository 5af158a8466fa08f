"""A searcher's start: its IVF shards read side by side (``READ_AHEAD`` at once) against one
at a time, from S3 with added latency, in one run.

  index    random 64-d vectors in ``--shards`` shards of ``--per_shard``, an IVF,Flat index
           of them built by `jobs/index.py`'s code, copied to an S3 server on loopback (moto
           in this process) that sleeps ``--latency_ms`` before answering each request;
  start    ``load_merged_shards`` (what a searcher's constructor runs) with READ_AHEAD as
           shipped and with 1, alternated ``--rounds`` times.

Printed: each way's seconds (the best of its rounds), S3 GETs, and serial / parallel.

Usage: python bench/bench_searcher_start.py [--shards 32] [--per_shard 20000]
           [--latency_ms 50] [--rounds 2] [--json bench/results/searcher_start-cpu-2core.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402


def timed_start(index_uri: str, entries: list, read_ahead: int, s3) -> dict:
    from pipeline.retrieval import faiss_index

    shipped = faiss_index.READ_AHEAD
    faiss_index.READ_AHEAD = read_ahead
    gets = s3.counts["GET"]
    try:
        started = time.perf_counter()
        merged = faiss_index.load_merged_shards(index_uri, entries)
        seconds = time.perf_counter() - started
    finally:
        faiss_index.READ_AHEAD = shipped
    return {"seconds": seconds, "gets": s3.counts["GET"] - gets, "vectors": int(sum(i.ntotal for i in merged))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--per_shard", type=int, default=20_000)
    parser.add_argument("--latency_ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, argv, shards=6, per_shard=500, rounds=1)

    import logging

    import boto3
    import ray

    from pipeline.core import storage
    from pipeline.retrieval import faiss_index
    from tests.helpers import SlowS3, index_of_random_vectors

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request lines
    ray.init(include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="start-") as tmp:
        local, _, _ = index_of_random_vectors(Path(tmp), args.shards, args.per_shard, 64, "IVF64,Flat")
        ray.shutdown()
        s3 = SlowS3(args.latency_ms / 1000)
        os.environ.update(s3.client_env())
        boto3.client("s3").create_bucket(Bucket="bench")
        index_uri = storage.copy_dir(local, "s3://bench/index")
        entries = faiss_index.load_index_manifest(index_uri)["shards"]
        shipped = faiss_index.READ_AHEAD
        runs: dict[str, list[dict]] = {"parallel": [], "serial": []}
        for _ in range(args.rounds):
            runs["parallel"].append(timed_start(index_uri, entries, shipped, s3))
            runs["serial"].append(timed_start(index_uri, entries, 1, s3))
    best = {way: min(rows, key=lambda r: r["seconds"]) for way, rows in runs.items()}
    assert best["parallel"]["vectors"] == best["serial"]["vectors"] == args.shards * args.per_shard
    figures = {
        "shards": args.shards,
        "vectors": args.shards * args.per_shard,
        "latency_ms": args.latency_ms,
        "read_ahead": shipped,
        "parallel_s": round(best["parallel"]["seconds"], 2),
        "serial_s": round(best["serial"]["seconds"], 2),
        "serial_over_parallel": round(best["serial"]["seconds"] / best["parallel"]["seconds"], 2),
        "gets_per_start": best["parallel"]["gets"],
    }
    print(json.dumps(figures), flush=True)
    if args.json:
        record.write(args.json, figures)


if __name__ == "__main__":
    main()
