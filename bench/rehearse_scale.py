"""Mining rehearsed on MS MARCO's shape, every artefact on S3 with added latency, this tree
against an older one, side by side.

  corpus     synthetic clustered 384-d passages as embedding shards of 100k rows (MS MARCO's
             8.8M would be 88 of them), indexed one index shard per embedding shard;
             embeddings, index and the mining output on an S3 server on loopback (moto in
             this process) that sleeps ``--latency_ms`` before answering each request and
             counts them;
  mining     `python jobs/mine.py` (100k queries by default, depth 200, 30 negatives),
             once with this tree and once with ``--old`` (a checkout of an earlier commit,
             run from its own folder), over the same index and queries.

Printed for each: the stage's wall time; the driver's peak RSS (VmHWM) and busy seconds
(user + system CPU of the driver's process); S3 requests during the stage (by method);
blocks; searchers. The full MS MARCO (8.8M x 768, 502k queries) does not fit this machine's
time: the sizes given run, and two sizes give the scaling.

Usage: git worktree add /tmp/raydense-old <commit>
       python bench/rehearse_scale.py --old /tmp/raydense-old [--sizes 500000,1000000]
           [--queries 100000] [--latency_ms 30] [--json bench/results/rehearse_scale-cpu-2core.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_mining_scale import _peak_rss, mine_argv, random_encoder, write_corpus, write_queries  # noqa: E402

from bench import record, smoke  # noqa: E402
from pipeline.core import storage  # noqa: E402
from tests.helpers import SlowS3  # noqa: E402

ROWS_PER_SHARD = 100_000
GIB = 2**30


def _cpu_seconds(pid: int) -> float:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_job(argv: list[str], cwd: Path, log: Path, env: dict) -> dict:
    """Run a job to its end, sampling its driver's peak RSS and CPU seconds every 0.5 s."""
    peak, busy = 0, 0.0
    with open(log, "w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        while proc.poll() is None:
            peak, busy = max(peak, _peak_rss(proc.pid)), max(busy, _cpu_seconds(proc.pid))
            time.sleep(0.5)
        seconds = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed (rc {proc.returncode}); see {log}")
    # The job's summary is its last stdout line; Ray's raylet may still log after it.
    summary = next(json.loads(line) for line in reversed(log.read_text().splitlines()) if line.startswith("{"))
    return {
        "seconds": round(seconds, 1),
        "driver_peak_gib": round(peak / GIB, 3),
        "driver_busy_s": round(busy, 1),
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="", help="a checkout of the tree to compare with (required but with --smoke)")
    parser.add_argument("--sizes", default="500000,1000000")
    parser.add_argument("--queries", type=int, default=100_000)
    parser.add_argument("--factory", default="IVF1024,SQ8")
    parser.add_argument("--latency_ms", type=float, default=30)
    parser.add_argument("--workdir", default="/tmp/rehearse-scale")
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, sizes="2000,4000", queries=50, factory="IVF16,SQ8", latency_ms=1.0)
    if args.smoke:  # this tree against itself, in a folder of its own
        args.old, args.workdir = args.old or str(REPO_ROOT), tempfile.mkdtemp(prefix="rehearse-scale-")
    elif not args.old:
        parser.error("--old is required")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line a request otherwise
    s3 = SlowS3(args.latency_ms / 1000)
    env = os.environ | s3.client_env()
    os.environ.update(env)  # this process uploads the embeddings
    boto3.client("s3").create_bucket(Bucket="rehearsal")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    queries, qrels = write_queries(work, args.queries, min(sizes))
    model = random_encoder(work / "encoder", queries)
    python, rows = sys.executable, []
    trees = {"old": Path(args.old).resolve(), "new": REPO_ROOT}
    for n in sizes:
        local = work / f"emb-{n}"
        write_corpus(str(local), n, ROWS_PER_SHARD)
        emb_uri, index_uri = f"s3://rehearsal/{n}/emb", f"s3://rehearsal/{n}/index"
        storage.upload_dir(str(local), emb_uri)
        shutil.rmtree(local)
        index = run_job(
            [
                python,
                "jobs/index.py",
                "--embeddings",
                emb_uri,
                "--output",
                index_uri,
                "--index.factory",
                args.factory,
                "--cpus_per_task",
                "2",
            ],
            REPO_ROOT,
            work / f"index-{n}.log",
            env,
        )
        s3.taken()
        row = {
            "passages": n,
            "queries": args.queries,
            "index_shards": index["summary"]["shards"],
            "index_s": index["seconds"],
        }
        for name, tree in trees.items():
            argv = [
                python,
                *mine_argv(str(tree / "jobs/mine.py"), index_uri, queries, qrels, model),
                "--output",
                f"s3://rehearsal/{n}/mined-{name}",
            ]
            mined = run_job(argv, tree, work / f"mine-{name}-{n}.log", env | {"PYTHONPATH": str(tree)})
            requests = s3.taken()
            row[name] = {
                "mine_s": mined["seconds"],
                "search_s": mined["summary"]["search_seconds"],
                "driver_peak_gib": mined["driver_peak_gib"],
                "driver_busy_s": mined["driver_busy_s"],
                "s3_requests": requests,
                "blocks": mined["summary"]["blocks"],
                "negatives_per_query": mined["summary"]["negatives_per_query"],
            }
        row["new_vs_old"] = {
            "mine_s": round(row["new"]["mine_s"] / row["old"]["mine_s"], 3),
            "driver_busy_s": round(row["new"]["driver_busy_s"] / max(row["old"]["driver_busy_s"], 1e-9), 3),
            "s3_requests": round(row["new"]["s3_requests"]["total"] / row["old"]["s3_requests"]["total"], 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    results = {
        "bench": "rehearse_scale",
        "device": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        "python": platform.python_version(),
        "latency_ms": args.latency_ms,
        "factory": args.factory,
        "old": subprocess.run(
            ["git", "-C", str(trees["old"]), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "new": subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        record.write(args.json, results)


if __name__ == "__main__":
    main()
