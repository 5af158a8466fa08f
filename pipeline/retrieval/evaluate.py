"""Exact (brute-force) dense retrieval and its metrics, in one process.

This is the small-collection path, used until the sharded encoding and FAISS indexing of
the pipeline land: it encodes every passage in memory. Metrics are always computed by
``ir_measures``, never by hand, so they match published tooling exactly.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from models.biencoder import load_biencoder
from pipeline.core import storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.runtime import RayConfig
from pipeline.core.sample import SAMPLE_CORPUS, SAMPLE_DEV_QRELS, SAMPLE_DEV_QUERIES
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus import iter_documents
from pipeline.data.runs import write_trec_run
from pipeline.data.tokenizer import load_tokenizer
from pipeline.retrieval.encode import (
    EncodeConfig,
    EncoderSettings,
    local_encoder,
    run_encoding,
)
from pipeline.retrieval.index import IndexConfig
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.metrics import JOB_MEASURES, evaluate, metrics_table
from pipeline.retrieval.search import ShardedIndex


@torch.no_grad()
def encode_texts(
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokenizer,
    texts: list[str],
    max_len: int,
    batch_size: int = 128,
    device: str = "cpu",
) -> torch.Tensor:
    """(N, H) float32 representations; ``encode`` is e.g. ``BiEncoder.encode_passage``."""
    out = []
    # Sorting by length keeps padding (and time) small; the order is restored at the end.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        out.append(encode(enc["input_ids"].to(device), enc["attention_mask"].to(device)).float().cpu())
    reps = torch.cat(out) if out else torch.zeros(0, 0)
    restored = torch.empty_like(reps)
    restored[torch.tensor(order, dtype=torch.long)] = reps
    return restored


def exact_search(
    queries: torch.Tensor,
    passages: torch.Tensor,
    k: int,
    block: int = 1024,
    similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` (scores, passage indices) per query by exhaustive scoring, in query blocks."""
    similarity = similarity or (lambda q, p: q @ p.T)
    k = min(k, passages.shape[0])
    scores, indices = [], []
    for start in range(0, queries.shape[0], block):
        s, i = similarity(queries[start : start + block], passages).topk(k, dim=1)
        scores.append(s)
        indices.append(i)
    return torch.cat(scores), torch.cat(indices)


def to_run(
    query_ids: list[str], doc_ids: list[str], scores: torch.Tensor, indices: torch.Tensor
) -> dict[str, dict[str, float]]:
    """The ``{qid: {docid: score}}`` run that ``ir_measures`` reads."""
    return {
        qid: {doc_ids[j]: float(s) for s, j in zip(row_s.tolist(), row_i.tolist())}
        for qid, row_s, row_i in zip(query_ids, scores, indices)
    }


@dataclass
class EvalConfig:
    queries: str = field(
        default=SAMPLE_DEV_QUERIES,
        metadata={"help": "BEIR queries.jsonl to evaluate on after training; empty = no evaluation"},
    )
    qrels: str = field(default=SAMPLE_DEV_QRELS, metadata={"help": "BEIR qrels TSV of those queries"})
    corpus: str = field(default="", metadata={"help": "BEIR corpus.jsonl to search; empty = the training corpus"})
    k: int = field(default=100, metadata={"help": "passages retrieved per query (exact search)"})
    batch_size: int = field(default=128, metadata={"help": "sequences per encoding batch"})


def dense_run(
    model,
    tokenizer,
    queries: dict[str, str],
    doc_ids: list[str],
    texts: list[str],
    k: int,
    query_max_len: int = 32,
    passage_max_len: int = 128,
    batch_size: int = 128,
) -> tuple[dict, dict]:
    """Encode, search exactly, and return the ``ir_measures`` run and timings.
    ``model`` is a :class:`models.biencoder.BiEncoder`."""
    start = time.perf_counter()
    passages = encode_texts(model.encode_passage, tokenizer, texts, passage_max_len, batch_size)
    encode_s = time.perf_counter() - start
    qids = list(queries)
    q = encode_texts(model.encode_query, tokenizer, [queries[i] for i in qids], query_max_len, batch_size)
    scores, indices = exact_search(q, passages, k, similarity=model.compute_similarity)
    info = {"passages_per_s": len(texts) / max(encode_s, 1e-9), "seconds": time.perf_counter() - start}
    return to_run(qids, doc_ids, scores, indices), info


def evaluate_retriever(
    model_dir: str, cfg: EvalConfig, corpus: str, query_max_len: int = 32, passage_max_len: int = 128, run_uri: str = ""
) -> dict:
    """Exact-search evaluation of a retriever export (settings from its ``retriever.json``)
    on one process: the small-collection path, with the corpus text in memory."""

    docs = list(iter_documents(cfg.corpus or corpus))
    doc_ids, texts = [d.doc_id for d in docs], [d.text for d in docs]
    del docs
    queries = read_queries(cfg.queries)
    qrels = read_qrels(cfg.qrels, doc_ids=set(doc_ids), query_ids=set(queries))
    model = load_biencoder(model_dir)
    towers = os.path.join(model_dir, "query")
    tokenizer = load_tokenizer(towers if os.path.isdir(towers) else model_dir)
    run, info = dense_run(
        model, tokenizer, queries, doc_ids, texts, cfg.k, query_max_len, passage_max_len, cfg.batch_size
    )
    if run_uri:
        write_trec_run(run, run_uri)
    return {
        "metrics": evaluate(qrels, run),
        "queries": len(queries),
        "docs": len(doc_ids),
        "run": run_uri or None,
        **{k: round(v, 2) for k, v in info.items()},
    }


# -- the evaluation job: encode on actors, index, search the shards, ir_measures ---------------


@dataclass
class EvaluateJobConfig:
    model: str = field(
        default="runs/finetune/export",
        metadata={
            "help": "retriever export (settings from its retriever.json) or any HF checkpoint (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME)"
        },
    )
    corpus: str = field(
        default=SAMPLE_CORPUS, metadata={"help": "BEIR corpus.jsonl or a prepared corpus folder (local or s3://)"}
    )
    queries: str = field(default=SAMPLE_DEV_QUERIES, metadata={"help": "BEIR queries.jsonl (local or s3://)"})
    qrels: str = field(default=SAMPLE_DEV_QRELS, metadata={"help": "BEIR qrels TSV with a header"})
    pooling: str = field(
        default="", metadata={"help": "cls or mean; empty = the export's retriever.json (cls for a plain checkpoint)"}
    )
    normalize: bool = field(
        default=False,
        metadata={"help": "L2-normalise (cosine); without it, the export's setting (dot for a plain checkpoint)"},
    )
    index: str = field(default="Flat", metadata={"help": "FAISS factory string of the index (Flat = exact)"})
    k: int = field(default=1000, metadata={"help": "passages retrieved per query"})
    output: str = field(
        default="runs/evaluate", metadata={"help": "embeddings, index, run.trec and metrics.json go here"}
    )
    actors: int = field(default=2, metadata={"help": "encoder actors"})
    max_len: int = field(default=128, metadata={"help": "passage tokens"})
    query_max_len: int = field(default=32, metadata={"help": "query tokens"})
    nprobe: int = field(default=32, metadata={"help": "IVF lists searched per query"})
    docs_per_shard: int = field(default=20000, metadata={"help": "passages per corpus/embedding shard"})
    precision: Literal["auto", "fp32", "fp16", "bf16"] = field(
        default="auto",
        metadata={
            "help": "encoding precision: auto = fp16 on GPU, fp32 on CPU; bf16 autocast also speeds up CPUs with AMX (it moves the vectors slightly)"
        },
    )
    ray: RayConfig = field(default_factory=RayConfig)


def run_evaluation(cfg: EvaluateJobConfig) -> dict:
    started = time.perf_counter()
    output = storage.resolve(cfg.output).uri
    queries = read_queries(storage.resolve(cfg.queries).uri)  # duplicate ids fail here, before any work
    settings = EncoderSettings(
        model=cfg.model,
        pooling=cfg.pooling,
        normalize="true" if cfg.normalize else "",
        max_len=cfg.max_len,
        query_max_len=cfg.query_max_len,
        precision=cfg.precision,
    )
    encoded = run_encoding(
        EncodeConfig(
            corpus=cfg.corpus,
            output=storage.join(output, "embeddings"),
            docs_per_shard=cfg.docs_per_shard,
            encoder=settings,
            pool=ActorConfig(actors=cfg.actors),
        )
    )
    if cfg.k > encoded["passages"]:
        raise ValueError(f"--k {cfg.k} is larger than the corpus ({encoded['passages']} passages)")
    indexed = run_indexing(
        IndexJobConfig(
            embeddings=encoded["output"],
            output=storage.join(output, "index"),
            index=IndexConfig(factory=cfg.index, nprobe=cfg.nprobe),
        )
    )
    with ShardedIndex(indexed["output"], nprobe=cfg.nprobe) as index:
        doc_by_row = index.doc_ids()
        qrels = read_qrels(storage.resolve(cfg.qrels).uri, doc_ids=set(doc_by_row.values()), query_ids=set(queries))
        qids = list(queries)
        encoder = local_encoder(settings)
        vectors = encoder.encode_texts([queries[q] for q in qids], cfg.query_max_len, tower="query")
        search_start = time.perf_counter()
        scores, rows = index.search(vectors, cfg.k)
        search_s = time.perf_counter() - search_start
    run = {
        q: {doc_by_row[int(r)]: float(s) for s, r in zip(srow, rrow) if r >= 0}
        for q, srow, rrow in zip(qids, scores, rows)
    }
    write_trec_run(run, storage.join(output, "run.trec"), tag="raydense")
    values = evaluate(qrels, run, JOB_MEASURES.values())
    metrics = {name: values[measure] for name, measure in JOB_MEASURES.items()}
    summary = {
        "job": "evaluate",
        "metrics": metrics,
        "queries": len(qids),
        "judged_queries": len(qrels),
        "passages": encoded["passages"],
        "index": cfg.index,
        "k": cfg.k,
        "run": storage.join(output, "run.trec"),
        "similarity": encoded["similarity"],
        "encode_passages_per_s": encoded["passages_per_s"],
        "search_seconds": round(search_s, 2),
        "seconds": round(time.perf_counter() - started, 2),
    }
    storage.write_json(storage.join(output, "metrics.json"), summary)
    return summary


def print_metrics(summary: dict) -> None:
    print(metrics_table(summary["metrics"]), flush=True)
