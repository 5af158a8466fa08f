"""Mining at 1M, 3M and 10M passages on this machine: does the driver's memory grow with the corpus?

For each corpus size, as a user would run it:
  1. synthetic clustered 384-d passage vectors written as embedding shards (500k rows each,
     ids "p<row>"), as jobs/encode.py writes them;
  2. `python jobs/index.py`: an IVF4096,SQ8 index, two embedding shards per index shard;
  3. `python jobs/mine.py`: 100k synthetic queries (one judged passage each) encoded on the
     encoder pool by a 384-wide random BERT, searched to depth 200, 30 negatives each.
While each job runs, a sampler reads every second the peak resident memory (VmHWM in
/proc/<pid>/status: the kernel's own high-water mark, not a sample) of the job's driver and
of every Ray actor (ray::EncoderActor, ray::IndexSearcher). Prints one JSON line per size and
the driver's peak-memory ratio 10M/1M (the goal: at most 1.2).

With --compare_fanin, each size is mined twice over the same index: first with the fan-in
as it was (a searcher per index shard, one query block asked at a time, merged and written
by the driver), then as jobs run it now (searchers planned by memory, blocks asked ahead,
each merged and written by a Ray task). Each reports the driver's share of the search's
wall time: the time it was busy rather than waiting (the goal: at most 0.2).

Usage: python bench/bench_mining_scale.py [--sizes 1000000,3000000,10000000] [--queries 100000]
       [--rows_per_shard 500000] [--compare_fanin [--old_searchers N]] [--workdir /tmp/mining-scale] [--json out.json]
Disk: about 2 GB per million passages (vectors + index), removed after each size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402
from pipeline.retrieval import embeddings as emb  # noqa: E402

DIM = 384
ROWS_PER_SHARD = 500_000
GIB = 2**30


def write_corpus(folder: str, n: int, rows_per_shard: int = ROWS_PER_SHARD, seed: int = 0) -> None:
    """Clustered vectors (as embeddings are), generated and written one shard at a time."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((1024, DIM)).astype(np.float32)
    entries = []
    for i, start in enumerate(range(0, n, rows_per_shard)):
        rows = np.arange(start, min(n, start + rows_per_shard))
        vectors = centers[rng.integers(len(centers), size=len(rows))]
        vectors += 0.6 * rng.standard_normal((len(rows), DIM), dtype=np.float32)
        entries.append(emb.write_shard(folder, i, rows, [f"p{r}" for r in rows], vectors))
    emb.write_manifest(folder, DIM, entries, normalized=False, similarity="dot", model="synthetic")


def write_queries(folder: Path, n_queries: int, judged_range: int, seed: int = 1) -> tuple[str, str]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(2000)]
    with open(folder / "queries.jsonl", "w") as out:
        for q in range(n_queries):
            text = " ".join(words[w] for w in rng.integers(len(words), size=rng.integers(4, 12)))
            out.write(json.dumps({"_id": f"q{q}", "text": text}) + "\n")
    with open(folder / "qrels.tsv", "w") as out:
        out.write("query-id\tcorpus-id\tscore\n")
        for q, doc in enumerate(rng.integers(judged_range, size=n_queries)):
            out.write(f"q{q}\tp{doc}\t1\n")
    return str(folder / "queries.jsonl"), str(folder / "qrels.tsv")


def random_encoder(folder: Path, texts_file: str) -> str:
    """A 2-layer BERT of width 384 with random weights and a WordPiece vocabulary of the queries:
    its vectors are as wide as the corpus's, which is all the search needs."""
    import torch
    from transformers import BertConfig, BertModel

    from pipeline.data.tokenizer import train_wordpiece

    texts = (json.loads(line)["text"] for line in open(texts_file))
    tokenizer = train_wordpiece(texts, str(folder), vocab_size=4000)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=DIM,
        num_hidden_layers=2,
        num_attention_heads=12,
        intermediate_size=4 * DIM,
        max_position_embeddings=128,  # the jobs' default passage length; longer than the model holds is refused
    )
    torch.manual_seed(0)  # the same weights every run: two runs' mined counts compare
    BertModel(config).save_pretrained(str(folder))
    return str(folder)


def mine_argv(script: str, index: str, queries: str, qrels: str, model: str) -> list[str]:
    """`jobs/mine.py`'s arguments in the mining benchmarks: one encoder actor, nprobe 16,
    depth 200, 30 negatives."""
    return [script, "--index", index, "--queries", queries, "--qrels", qrels, "--encoder.model", model] + [
        "--encoder.pooling",
        "cls",
        "--pool.actors",
        "1",
        "--nprobe",
        "16",
        "--depth",
        "200",
        "--count",
        "30",
    ]


def _peak_rss(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _actor_kind(pid: int) -> str | None:
    """Ray titles an actor's process ``ray::<Class>`` (plus the method it runs)."""
    try:
        title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None
    for kind in ("EncoderActor", "IndexSearcher"):
        if title.startswith(f"ray::{kind}"):
            return kind
    return None


def run_sampled(argv: list[str], log: Path) -> dict:
    """Run a job; meanwhile keep each watched process's latest high-water mark."""
    peaks: dict[int, tuple[str, int]] = {}
    with open(log, "w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peaks[proc.pid] = ("driver", max(_peak_rss(proc.pid), peaks.get(proc.pid, ("", 0))[1]))
                for entry in os.listdir("/proc"):
                    if entry.isdigit():
                        kind = _actor_kind(int(entry))
                        if kind:
                            pid = int(entry)
                            peaks[pid] = (kind, max(_peak_rss(pid), peaks.get(pid, ("", 0))[1]))
                done.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
        seconds = time.perf_counter() - started
    if rc != 0:
        raise SystemExit(f"{' '.join(argv)} failed (rc {rc}); see {log}")
    # The job's summary is its last JSON line: Ray's processes may still log after it.
    summary = next(json.loads(line) for line in reversed(log.read_text().splitlines()) if line.startswith("{"))
    by_kind: dict[str, list[float]] = {}
    for kind, peak in peaks.values():
        by_kind.setdefault(kind, []).append(round(peak / GIB, 3))
    return {"seconds": round(seconds, 1), "peak_gib": by_kind, "summary": summary}


def bench_size(
    n: int,
    n_queries: int,
    work: Path,
    model: str,
    queries: str,
    qrels: str,
    factory: str,
    rows_per_shard: int,
    compare_fanin: bool,
    old_searchers: int = 0,
    mine_extra: tuple[str, ...] = (),
) -> dict:
    folder = work / f"corpus-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.perf_counter()
    write_corpus(str(folder / "emb"), n, rows_per_shard)
    write_s = time.perf_counter() - started
    python = sys.executable
    index = run_sampled(
        [
            python,
            "jobs/index.py",
            "--embeddings",
            str(folder / "emb"),
            "--output",
            str(folder / "index"),
            "--index.factory",
            factory,
            "--embedding_shards_per_index",
            "2",
            "--cpus_per_task",
            "2",  # one build at a time per 2 cores: a 1M-vector build holds ~5 GB
        ],
        folder / "index.log",
    )
    mine_args = [python, *mine_argv("jobs/mine.py", str(folder / "index"), queries, qrels, model), *mine_extra]
    fanins = {}
    if compare_fanin:
        # The fan-in as it was before 2026-11-24: a searcher per index shard, one block asked
        # at a time, merged and written by the driver while every searcher waited.
        per_shard = run_sampled(
            mine_args
            + ["--output", str(folder / "mined-per-shard"), "--searchers.blocks_in_flight", "1"]
            + ["--write_in_tasks", "false"]
            + ["--searchers.searchers", str(old_searchers or index["summary"]["shards"])],
            folder / "mine-per-shard.log",
        )
        # With old_searchers (where a process per shard would not fit), only the driver's
        # side is as it was: the same merge and writes, nothing asked ahead.
        fanins["unpipelined_driver_writes" if old_searchers else "per_shard_unpipelined"] = per_shard["summary"]
    mine = run_sampled(mine_args + ["--output", str(folder / "mined")], folder / "mine.log")
    fanins["planned_pipelined"] = mine["summary"]
    mined_lines = sum(1 for _ in open(folder / "mined" / "negatives.jsonl"))
    shutil.rmtree(folder)
    return {
        "passages": n,
        "queries": n_queries,
        "factory": factory,
        "index_shards": index["summary"]["shards"],
        "write_embeddings_s": round(write_s, 1),
        "index_s": index["seconds"],
        "index_driver_peak_gib": max(index["peak_gib"].get("driver", [0])),
        "mine_s": mine["seconds"],
        "mine_search_s": mine["summary"]["search_seconds"],
        "mine_driver_peak_gib": max(mine["peak_gib"]["driver"]),
        "encoder_actor_peak_gib": mine["peak_gib"].get("EncoderActor", []),
        "searcher_peak_gib": sorted(mine["peak_gib"].get("IndexSearcher", [])),
        "negatives_lines": mined_lines,
        "negatives_per_query": mine["summary"]["negatives_per_query"],
        "margin_dropped": mine["summary"]["margin_dropped"],
        "searchers": len(mine["peak_gib"].get("IndexSearcher", [])),
        # Of the search's wall time, the share the driver spent merging and writing rather
        # than waiting on the searchers, for each fan-in run on the same index and queries.
        "fanin": {
            name: {
                "search_s": summary["search_seconds"],
                "driver_share": summary["search_driver_share"],
                "blocks": summary["blocks"],
            }
            for name, summary in fanins.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,3000000,10000000")
    parser.add_argument("--queries", type=int, default=100_000)
    parser.add_argument("--factory", default="IVF4096,SQ8")
    parser.add_argument("--workdir", default="/tmp/mining-scale")
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--rows_per_shard",
        type=int,
        default=ROWS_PER_SHARD,
        help="rows per embedding shard (the index has two embedding shards per index shard)",
    )
    parser.add_argument(
        "--compare_fanin",
        action="store_true",
        help="also mine with the old fan-in (a searcher per index shard, one block at a time), side by side",
    )
    parser.add_argument(
        "--old_searchers",
        type=int,
        default=0,
        help="with --compare_fanin: searchers of the old run (0 = one per index shard, as it was; "
        "set it where that many processes do not fit, and the old run keeps only the driver's side)",
    )
    parser.add_argument(
        "--mine_args",
        default="",
        help="more options of jobs/mine.py, space-separated (e.g. '--relative_margin 0.05': margin mining)",
    )
    args = smoke.parse(
        parser,
        sizes="1000,2000",
        queries=20,
        factory="IVF16,Flat",
        rows_per_shard=500,
        compare_fanin=True,
    )
    if args.smoke:
        args.workdir = tempfile.mkdtemp(prefix="mining-scale-")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    queries, qrels = write_queries(work, args.queries, min(sizes))
    model = random_encoder(work / "encoder", queries)
    rows = []
    for n in sizes:
        rows.append(
            bench_size(
                n,
                args.queries,
                work,
                model,
                queries,
                qrels,
                args.factory,
                args.rows_per_shard,
                args.compare_fanin,
                args.old_searchers,
                tuple(args.mine_args.split()),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    by_size = {r["passages"]: r for r in rows}
    if len(rows) > 1:
        ratio = rows[-1]["mine_driver_peak_gib"] / rows[0]["mine_driver_peak_gib"]
        print(
            json.dumps(
                {
                    "driver_peak_ratio": f"{rows[-1]['passages']:,}/{rows[0]['passages']:,}",
                    "mine": round(ratio, 3),
                    "index": round(rows[-1]["index_driver_peak_gib"] / rows[0]["index_driver_peak_gib"], 3),
                }
            ),
            flush=True,
        )
    if args.json:
        record.write(args.json, {"rows": rows, "by_size": list(by_size)})


if __name__ == "__main__":
    main()
