"""The retrieval path on a GPU node: the encoder pool and the searchers, each against the
same work on the node's CPU, measured side by side in one run.

  encode   passages/s of jobs/encode.py's pool (one actor) on the GPU (fp16, bf16, fp32) and
           on CPU cores (fp32), same random-weight model (MiniLM-sized 384-d and BERT-base-sized
           768-d; throughput does not depend on the weights) and the same Nave verses
  search   queries/s of ShardedIndex's searchers on one shard: a CPU searcher (every core as
           FAISS threads) against a GPU searcher (pool.use_gpu: the shard moved with
           faiss.index_cpu_to_gpu), same index file, same queries; and how many of the CPU's
           top-k the GPU returns

Usage: python bench/bench_retrieval_gpu.py [--parts encode,search,faiss] [--json out.json]
       [--corpus nave/corpus.jsonl] [--vectors 2000000] [--dim 384] [--queries 20000]
       [--factories Flat,IVF4096,SQ8,IVF4096,PQ48] [--devices cpu,gpu]
       [--encode-runs bert-base:gpu:fp16:1024:compiled,minilm:gpu:fp32:256,...]
Issue 35's figures: --parts search,faiss --vectors 1000000 --dim 768 --factories Flat,IVF4096,SQ8;
then --vectors 10000000 --dim 384 where the GPU's memory allows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench_search import NAVE, _device_passages_per_s, _steady_passages_per_s, clustered, write_vectors  # noqa: E402

from bench import record, smoke  # noqa: E402
from pipeline.core import storage  # noqa: E402
from pipeline.core.actor_pool import ActorConfig  # noqa: E402
from pipeline.data.shards import load_manifest  # noqa: E402
from pipeline.data.tokenizer import train_wordpiece  # noqa: E402
from pipeline.retrieval.encode import EncodeConfig, EncoderSettings, prepared_corpus, run_encoding  # noqa: E402
from pipeline.retrieval.faiss_index import IndexConfig  # noqa: E402
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing  # noqa: E402
from pipeline.retrieval.search import SearcherConfig, ShardedIndex  # noqa: E402

SIZES = {
    "minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536},
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}


def random_bert(folder: str, texts: list[str], size: str) -> str:
    from transformers import BertConfig, BertModel

    tokenizer = train_wordpiece(texts, folder, vocab_size=30522)
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **SIZES[size])
    BertModel(config).save_pretrained(folder)
    return folder


DEFAULT_ENCODE_RUNS = ",".join(
    f"{size}:{device}:{precision}:256"
    for size in SIZES
    for device, precision in (("gpu", "fp16"), ("gpu", "bf16"), ("gpu", "fp32"), ("cpu", "fp32"))
)


def encode_runs(spec: str) -> list[dict]:
    """``size:device:precision:batch[:compiled]`` items, comma-separated."""
    runs = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) not in (4, 5) or parts[0] not in SIZES or parts[1] not in ("gpu", "cpu"):
            raise SystemExit(f"--encode-runs: {item!r} is not size:gpu|cpu:precision:batch[:compiled]")
        if len(parts) == 5 and parts[4] != "compiled":
            raise SystemExit(f"--encode-runs: {item!r} ends in {parts[4]!r}, not 'compiled'")
        runs.append(
            {
                "size": parts[0],
                "device": parts[1],
                "precision": parts[2],
                "batch": int(parts[3]),
                "compiled": len(parts) == 5,
            }
        )
    return runs


def full_length(records: list[dict], min_words: int) -> list[dict]:
    """As many passages, each record's text followed by the next ones' until it has
    ``min_words`` words: rows the encoder cuts at its passage length (Nave's verses average
    24 words, ~32 tokens, far from the 128 of a typical passage)."""
    texts, passages = [r["text"] for r in records], []
    for i, verse in enumerate(records):
        words, j = [], i
        while len(words) < min_words:
            words += texts[j % len(texts)].split()
            j += 1
        passages.append({"_id": verse["_id"], "text": " ".join(words)})
    return passages


def mean_tokens(prepared: str, max_len: int) -> float:
    """Tokens a passage of a prepared corpus holds as the encoder frames it ([CLS] and [SEP]
    in, cut at max_len): its shards' token ids, not a second tokenization."""
    import pyarrow.compute as pc

    lengths = [
        pc.list_value_length(storage.read_parquet(storage.join(prepared, shard["path"]), ["input_ids"])[0]).to_numpy()
        for shard in load_manifest(prepared)["shards"]
    ]
    return float(np.mean(np.minimum(np.concatenate(lengths), max_len - 2) + 2))


def profile_encoder(model: str, run: dict, texts: list[str], path: str) -> dict:
    """The encoder of ``run`` in this process, without the pool: passages/s over ``texts``
    (the second of two passes), and a ``torch.profiler`` table of one more pass written to
    ``path``: where a forward's time goes, and how long the device waits on the host."""
    import torch

    from pipeline.retrieval.encode import local_encoder
    from pipeline.retrieval.inference import length_sorted_batches
    from pipeline.training.profiling import busy_line, device_profile, time_table

    on_gpu = run["device"] == "gpu"
    settings = EncoderSettings(
        model=model, pooling="cls", batch_size=run["batch"], precision=run["precision"], compile=run["compiled"]
    )
    encoder = local_encoder(settings, "cuda" if on_gpu else "cpu")
    tokens = encoder.tokenizer(texts, add_special_tokens=False, truncation=True, max_length=126)["input_ids"]
    max_len = settings.passage_max_len
    encoder.encode_tokens(tokens, max_len)
    start = time.perf_counter()
    encoder.encode_tokens(tokens, max_len)
    rate = len(tokens) / (time.perf_counter() - start)
    with device_profile(on_gpu) as session:
        start = time.perf_counter()
        encoder.encode_tokens(tokens, max_len)
        if on_gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    framed = [min(len(t), max_len - 2) + 2 for t in tokens]
    batches = sum(1 for _ in length_sorted_batches(framed, *encoder.batch_limits))
    header = busy_line(session, wall, batches, on_gpu).replace("steps", "batches").replace("a step", "a batch")
    Path(path).write_text(f"{run}\n{header}\n{time_table(session, on_gpu)}\n")
    return {"in_process_passages_per_s": round(rate, 1), "profiled_passages": len(tokens)}


def bench_encode(
    corpus: Path, cpu_passages: int, cpus: int, runs: list[dict], min_words: int = 0, profile: str = ""
) -> list[dict]:
    lines = (
        gzip.decompress(corpus.read_bytes()).decode().splitlines()
        if corpus.suffix == ".gz"
        else corpus.read_text().splitlines()
    )
    records = [json.loads(line) for line in lines]
    verses = [r["text"] for r in records]  # the tokenizers' training text
    if min_words:
        lines = [json.dumps(r) for r in full_length(records, min_words)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "corpus.jsonl"
        full.write_text("\n".join(lines) + "\n")
        small = Path(tmp) / "small.jsonl"
        small.write_text("\n".join(lines[:cpu_passages]) + "\n")
        models: dict[str, str] = {}
        for run in runs:
            size, device = run["size"], run["device"]
            if size not in models:
                models[size] = random_bert(f"{tmp}/{size}", verses, size)
            model, source, gpu = models[size], full if device == "gpu" else small, device == "gpu"
            out = f"{tmp}/emb-{len(rows)}"
            prepared = f"{tmp}/prepared-{size}-{source.stem}"
            if not Path(prepared).exists():  # tokenized once, outside timing
                prepared_corpus(str(source), model, prepared, max(1, sum(1 for _ in source.open()) // 8))
            encoder = EncoderSettings(
                model=model, pooling="cls", batch_size=run["batch"], precision=run["precision"], compile=run["compiled"]
            )
            summary = run_encoding(
                EncodeConfig(
                    corpus=prepared,
                    output=out,
                    encoder=encoder,
                    pool=ActorConfig(actors=1, use_gpu=gpu, cpus_per_actor=4 if gpu else cpus),
                )
            )
            row = {
                "model": size,
                "device": device,
                "precision": run["precision"],
                "batch": run["batch"],
                "batch_tokens": encoder.batch_limits("cuda" if gpu else "cpu")[1],
                "compiled": run["compiled"],
                "cpu_threads": 4 if gpu else cpus,
                "passages": summary["passages"],
                "mean_tokens": round(mean_tokens(prepared, encoder.passage_max_len), 1),
                "passages_per_s": round(_steady_passages_per_s(summary), 1),
                "device_passages_per_s": round(_device_passages_per_s(summary), 1),
                "wall_passages_per_s": summary["passages_per_s"],
            }
            if profile and not any("in_process_passages_per_s" in r for r in rows):  # the first run alone
                texts = [json.loads(line)["text"] for line in lines[: 4 * run["batch"] if gpu else cpu_passages]]
                row |= profile_encoder(model, run, texts, profile)
            rows.append(row)
            print(json.dumps({"encode": row}), flush=True)
    return rows


DEVICES = {"cpu": None, "gpu": SearcherConfig(use_gpu=True, searchers=1)}


def bench_search(
    n: int, dim: int, n_queries: int, k: int, factories: list[str], cpus: int, devices: list[str]
) -> list[dict]:
    vectors, queries = clustered(n, dim, 0), clustered(n_queries, dim, 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_vectors(f"{tmp}/emb", vectors, 1)
        del vectors
        for factory in factories:
            started = time.perf_counter()
            run_indexing(
                IndexJobConfig(
                    embeddings=f"{tmp}/emb",
                    output=f"{tmp}/index-{factory}",
                    cpus_per_task=cpus,
                    index=IndexConfig(factory=factory, use_gpu="never", train_sample=200_000),
                )
            )
            build_s = time.perf_counter() - started
            row: dict = {"factory": factory, "vectors": n, "dim": dim, "queries": n_queries, "k": k}
            results = {}
            for device in devices:
                searchers = DEVICES[device]
                with ShardedIndex(f"{tmp}/index-{factory}", nprobe=32, searchers=searchers, threads=cpus) as index:
                    index.search(queries[:100], k)  # warm: actor up, shard loaded (and moved)
                    started = time.perf_counter()
                    _, found = index.search(queries, k)
                    seconds = time.perf_counter() - started
                    stats = index.stats()[0]
                row[f"{device}_queries_per_s"] = round(n_queries / seconds, 1)
                row[f"{device}_on_gpu"] = stats["on_gpu"]
                row[f"{device}_peak_rss_gib"] = round(stats["peak_rss_bytes"] / 2**30, 2)
                results[device] = found
            if len(results) == 2:
                row["gpu_vs_cpu"] = round(row["gpu_queries_per_s"] / row["cpu_queries_per_s"], 1)
                row["same_topk"] = round(
                    float(np.mean([len(set(a) & set(b)) / k for a, b in zip(results["cpu"], results["gpu"])])), 4
                )
            row["build_s"] = round(build_s, 1)
            rows.append(row)
            print(json.dumps({"search": row}), flush=True)
    return rows


def bench_faiss(
    n: int, dim: int, n_queries: int, k: int, factories: list[str], cpus: int, devices: list[str]
) -> list[dict]:
    """The searchers' own calls (build, move to the GPU, search) in this process, no Ray:
    the device figures alone, when Ray itself is in question."""
    import faiss

    from pipeline.retrieval.faiss_index import build_index_shard, sample_vectors, search_shard, searcher_to_gpu

    vectors, queries = clustered(n, dim, 0), clustered(n_queries, dim, 1)
    faiss.omp_set_num_threads(cpus)
    rows = []
    for factory in factories:
        started = time.perf_counter()
        index = build_index_shard(
            vectors, np.arange(n), factory, train_vectors=sample_vectors(vectors, 200_000), use_gpu="never"
        )
        row: dict = {"factory": factory, "vectors": n, "dim": dim, "queries": n_queries, "k": k}
        row["build_s"] = round(time.perf_counter() - started, 1)
        found = {}
        on_device = {"cpu": index}
        if "gpu" in devices:
            on_device["gpu"], resources = searcher_to_gpu(index)
        for device, searched in on_device.items():
            search_shard(searched, queries[:100], k, 32)
            started = time.perf_counter()
            _, found[device] = search_shard(searched, queries, k, 32)
            row[f"{device}_queries_per_s"] = round(n_queries / (time.perf_counter() - started), 1)
        if len(found) == 2:
            row["gpu_vs_cpu"] = round(row["gpu_queries_per_s"] / row["cpu_queries_per_s"], 1)
            row["same_topk"] = round(
                float(np.mean([len(set(a) & set(b)) / k for a, b in zip(found["cpu"], found["gpu"])])), 4
            )
        del on_device
        rows.append(row)
        print(json.dumps({"faiss": row}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="encode,search")
    parser.add_argument("--json", default="")
    parser.add_argument("--corpus", default=str(NAVE / "corpus.jsonl.gz"))
    parser.add_argument("--cpu-passages", type=int, default=2000)
    parser.add_argument(
        "--encode-runs",
        default=DEFAULT_ENCODE_RUNS,
        help="encode part: size:gpu|cpu:precision:batch[:compiled], comma-separated (gpu runs read the whole corpus, cpu runs --cpu-passages of it)",
    )
    parser.add_argument(
        "--min-words",
        type=int,
        default=0,
        help="encode part: each verse joined to the next ones until it has this many words (130: rows of the full 128 tokens); 0 = the verses as they are",
    )
    parser.add_argument(
        "--profile",
        default="",
        help="encode part: the first run's encoder in this process too (passages/s without the pool), with a torch.profiler table written here",
    )
    parser.add_argument("--vectors", type=int, default=2_000_000)
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--factories", default="Flat,IVF4096,SQ8,IVF4096,PQ48")
    parser.add_argument("--dim", type=int, default=384, help="vector width of the search and faiss parts")
    parser.add_argument(
        "--devices", default="cpu,gpu", help="search and faiss parts: cpu alone checks the command on a CPU machine"
    )
    args = smoke.parse(
        parser,
        parts="encode,search,faiss",
        devices="cpu",
        cpu_passages=64,
        encode_runs="minilm:cpu:fp32:32",
        vectors=2000,
        queries=50,
        dim=32,
        factories="Flat,IVF16,SQ8",
    )
    import faiss
    import ray
    import torch

    devices = args.devices.split(",")
    if "gpu" in devices and not torch.cuda.is_available():
        sys.exit("bench_retrieval_gpu.py needs a CUDA device (or --devices cpu --parts search,faiss)")
    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, num_gpus=torch.cuda.device_count(), log_to_driver="search" in args.parts)
    results: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu_cores": cpus,
        "versions": {"faiss": faiss.__version__, "torch": torch.__version__, "ray": ray.__version__},
    }
    parts = args.parts.split(",")
    if "encode" in parts:
        results["encode"] = bench_encode(
            Path(args.corpus), args.cpu_passages, cpus, encode_runs(args.encode_runs), args.min_words, args.profile
        )
    if "search" in parts:
        # "IVF4096,SQ8" holds a comma: the list is split on the factories' known starts.
        factories = [f for f in args.factories.replace(",IVF", ";IVF").replace(",Flat", ";Flat").split(";") if f]
        results["search"] = bench_search(args.vectors, args.dim, args.queries, 100, factories, cpus, devices)
    if "faiss" in parts:
        factories = [f for f in args.factories.replace(",IVF", ";IVF").replace(",Flat", ";Flat").split(";") if f]
        results["faiss"] = bench_faiss(args.vectors, args.dim, args.queries, 100, factories, cpus, devices)
    if args.json:
        record.write(args.json, results)


if __name__ == "__main__":
    main()
