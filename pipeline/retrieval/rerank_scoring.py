"""Re-ranker scoring on Ray actors: a first-stage run's top candidates re-scored by a
cross-encoder, written as a TREC run and evaluated against the first stage."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import ray
import torch

from models.reranker import (
    SETTINGS_FILE,
    PairLengths,
    check_max_len,
    load_reranker,
    pair_inputs,
)
from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig, actor_device, run_actor_pool
from pipeline.core.runtime import RayConfig
from pipeline.core.sample import SAMPLE_CORPUS, SAMPLE_DEV_QRELS, SAMPLE_DEV_QUERIES
from pipeline.data.beir import positives, read_qrels, read_queries
from pipeline.data.corpus import iter_documents
from pipeline.data.runs import read_trec_run, write_trec_run
from pipeline.data.stream import frame
from pipeline.data.tokenizer import load_tokenizer
from pipeline.retrieval.metrics import JOB_MEASURES, evaluate, metrics_table


@dataclass
class RerankScoreConfig:
    model: str = field(
        default="runs/rerank/export",
        metadata={
            "help": "re-ranker export (lengths from its reranker.json) or any local one-label HF sequence classifier (local or s3://; 'package:NAME' = an installed model package)"
        },
    )
    run: str = field(
        default="runs/evaluate/run.trec",
        metadata={"help": "TREC run of first-stage candidates (qid Q0 docid rank score tag)"},
    )
    queries: str = field(
        default=SAMPLE_DEV_QUERIES, metadata={"help": "BEIR queries.jsonl: every query of the run must be in it"}
    )
    corpus: str = field(
        default=SAMPLE_CORPUS, metadata={"help": "BEIR corpus.jsonl holding every candidate (local or s3://)"}
    )
    qrels: str = field(
        default=SAMPLE_DEV_QRELS,
        metadata={"help": "BEIR qrels TSV: evaluate both runs with ir_measures; empty = no evaluation"},
    )
    include_positives: bool = field(
        default=False,
        metadata={
            "help": "also score the judged positives the run missed, for the run's queries (for a distillation teacher); metrics still rank the first-stage candidates only"
        },
    )
    depth: int = field(default=100, metadata={"help": "best-scored candidates of the run re-ranked per query"})
    output: str = field(
        default="runs/rerank_score",
        metadata={"help": "folder for run.trec (the re-ranker's scores) and summary.json (local or s3://)"},
    )
    query_max_len: int = field(
        default=0, metadata={"help": "query tokens; 0 = the export's reranker.json (32 for a plain checkpoint)"}
    )
    passage_max_len: int = field(
        default=0, metadata={"help": "passage tokens; 0 = the export's reranker.json (160 for a plain checkpoint)"}
    )
    max_len: int = field(
        default=0, metadata={"help": "pair tokens; 0 = the export's reranker.json (192 for a plain checkpoint)"}
    )
    batch_size: int = field(
        default=64, metadata={"help": "pairs per forward (length-sorted, each batch padded to its longest)"}
    )
    queries_per_task: int = field(
        default=64, metadata={"help": "queries per actor task (the unit of retry after an actor died)"}
    )
    precision: Literal["auto", "fp32", "fp16", "bf16"] = field(
        default="auto", metadata={"help": "auto = fp16 autocast on GPU, fp32 on CPU"}
    )
    pool: ActorConfig = field(default_factory=ActorConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        for name in ("depth", "batch_size", "queries_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _texts_of(corpus: str, needed: dict[str, str]) -> dict[str, str]:
    """The texts of the ``needed`` documents (doc id -> where it was named, for the error)."""

    texts = {d.doc_id: d.text for d in iter_documents(corpus) if d.doc_id in needed}
    missing = [d for d in needed if d not in texts]
    if missing:
        raise ValueError(
            f"{needed[missing[0]]}: document {missing[0]!r} is not in the corpus {corpus}"
            + (f" ({len(missing)} such documents)" if len(missing) > 1 else "")
        )
    return texts


class PairScorer:
    """A re-ranker on one device, scoring (query, passage) texts in length-sorted batches.
    Pairs are cut exactly as in training (:class:`models.reranker.PairLengths`)."""

    def __init__(
        self,
        model_dir: str,
        lengths: PairLengths | None = None,
        batch_size: int = 64,
        precision: str = "auto",
        device: str = "cpu",
    ):
        self.model = load_reranker(model_dir).to(device)
        self.lengths = lengths or self.model.lengths
        self.lengths.check()
        check_max_len(self.model.model.config, self.lengths.max_len, model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.batch_size, self.device = batch_size, device
        if precision == "auto":
            precision = "fp16" if device.startswith("cuda") else "fp32"
        self.autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)

    def _framed(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.tokenizer
        tokens = tok(texts, add_special_tokens=False, truncation=True, max_length=max_len - 2)["input_ids"]
        width = max((len(t) for t in tokens), default=0) + 2
        ids, lengths = frame(
            [np.asarray(t, dtype=np.int32) for t in tokens], width, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id
        )
        return torch.from_numpy(ids).long(), torch.from_numpy(lengths).long()

    def score(self, query_texts: list[str], candidates: list[list[str]], texts: dict[str, str]) -> list[np.ndarray]:
        """Per query, the scores of its candidates (doc ids whose text is in ``texts``), in order."""

        doc_ids = list(dict.fromkeys(d for docs in candidates for d in docs))
        doc_row = {d: i for i, d in enumerate(doc_ids)}
        q_ids, q_len = self._framed(query_texts, self.lengths.query_max_len)
        d_ids, d_len = self._framed([texts[d] for d in doc_ids], self.lengths.passage_max_len)
        pair_q = torch.tensor([i for i, docs in enumerate(candidates) for _ in docs], dtype=torch.long)
        pair_d = torch.tensor([doc_row[d] for docs in candidates for d in docs], dtype=torch.long)
        pair_len = torch.clamp(q_len[pair_q] + d_len[pair_d] - 1, max=self.lengths.max_len)
        order = torch.argsort(pair_len, descending=True, stable=True)
        scores = torch.zeros(len(pair_q), dtype=torch.float32)
        autocast = (
            torch.autocast(device_type=self.device.split(":")[0], dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        sep, pad = self.tokenizer.sep_token_id, self.tokenizer.pad_token_id
        with torch.inference_mode(), autocast:
            for idx in order.split(self.batch_size):
                qi, di = pair_q[idx], pair_d[idx]
                batch = pair_inputs(q_ids[qi], q_len[qi], d_ids[di], d_len[di], self.lengths.max_len, sep, pad)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                scores[idx] = self.model(**batch).float().cpu()
        return [part.numpy() for part in scores.split([len(docs) for docs in candidates])]


class RerankerActor:
    """A Ray actor holding one :class:`PairScorer`; scores blocks of queries."""

    def __init__(self, model_uri: str, lengths: PairLengths, batch_size: int, precision: str, pool: ActorConfig):
        torch.set_num_threads(max(1, int(pool.cpus_per_actor)))
        model_dir = model_ref.materialize(model_uri, "--model")
        self.scorer = PairScorer(model_dir, lengths, batch_size, precision, actor_device(pool))

    def pid(self) -> int:
        return os.getpid()

    def score(self, block: dict) -> dict:
        started = time.perf_counter()
        scores = self.scorer.score(block["query_texts"], block["candidates"], block["texts"])
        return {"scores": scores, "seconds": time.perf_counter() - started, "pid": os.getpid()}


def _model_uri(model: str) -> str:
    uri = model_ref.check(model, "--model")
    model_ref.read_config(uri, "--model (jobs/rerank.py trains one)")
    return uri


def _pair_lengths(cfg: RerankScoreConfig, model_uri: str) -> PairLengths:
    """The export's lengths (``reranker.json``), each overridden by a non-zero setting."""

    saved = {}
    if model_ref.has_file(model_uri, SETTINGS_FILE):
        saved = json.loads(storage.read_bytes(model_ref.join(model_uri, SETTINGS_FILE)))
    lengths = PairLengths.from_dict(saved)
    for name in ("query_max_len", "passage_max_len", "max_len"):
        if getattr(cfg, name):
            setattr(lengths, name, getattr(cfg, name))
    lengths.check()
    return lengths


def run_scoring(cfg: RerankScoreConfig) -> dict:
    """Score the run's top-``depth`` candidates on Ray actors, write the re-ranked run, evaluate."""

    started = time.perf_counter()
    output = storage.resolve(cfg.output).uri
    model_uri = _model_uri(cfg.model)
    lengths = _pair_lengths(cfg, model_uri)
    run_uri, qrels_uri = storage.resolve(cfg.run).uri, storage.resolve(cfg.qrels).uri if cfg.qrels else ""
    queries = read_queries(storage.resolve(cfg.queries).uri)
    first_stage = read_trec_run(run_uri, cfg.depth, query_ids=set(queries))
    qrels = read_qrels(qrels_uri, query_ids=set(queries)) if qrels_uri else {}

    candidates = {q: [d for d, _, _ in ranked] for q, ranked in first_stage.items()}
    needed: dict[str, str] = {}  # doc id -> where the run names it, for a missing document's error
    for ranked in first_stage.values():
        for d, _, line in ranked:
            needed.setdefault(d, f"{run_uri} line {line}")
    added = 0
    if cfg.include_positives:
        # Only the run's queries: a query the first stage did not retrieve for (e.g. left
        # out of a sampled teacher run) would get its positives and nothing to compare.
        for qid in first_stage:
            missed = [d for d in positives(qrels.get(qid, {})) if d not in set(candidates.get(qid, []))]
            if missed:
                candidates.setdefault(qid, []).extend(missed)
                added += len(missed)
                for d in missed:
                    needed.setdefault(d, f"{qrels_uri}: positive of query {qid!r}")
    texts = _texts_of(storage.resolve(cfg.corpus).uri, needed)
    del needed

    qids = [q for q in queries if candidates.get(q)]
    blocks = [qids[i : i + cfg.queries_per_task] for i in range(0, len(qids), cfg.queries_per_task)]
    remote = ray.remote(RerankerActor).options(**cfg.pool.remote_options(), max_restarts=0)

    def make_actor():
        return remote.remote(model_uri, lengths, cfg.batch_size, cfg.precision, cfg.pool)

    def call(actor, block: list[str]):
        # Built when the block is handed out, so the driver never holds every payload at once.
        cands = [candidates[q] for q in block]
        payload = {
            "query_texts": [queries[q] for q in block],
            "candidates": cands,
            "texts": {d: texts[d] for docs in cands for d in docs},
        }
        return actor.score.remote(payload)

    score_start = time.perf_counter()
    results = run_actor_pool(make_actor, blocks, call, cfg.pool.max_retries, cfg.pool.actors)
    score_s = time.perf_counter() - score_start
    reranked = {
        q: dict(zip(candidates[q], map(float, s)))
        for block, result in zip(blocks, results)
        for q, s in zip(block, result["scores"])
    }
    out_run = storage.join(output, "run.trec")
    write_trec_run(reranked, out_run, tag="rerank")
    pairs = sum(len(c) for c in candidates.values())

    summary = {
        "job": "rerank_score",
        "output": output,
        "run": out_run,
        "input_run": run_uri,
        "model": model_uri,
        "queries": len(qids),
        "queries_without_candidates": len(queries) - len(qids),
        "pairs": pairs,
        "positives_added": added,
        "depth": cfg.depth,
        "lengths": asdict(lengths),
        "actors": cfg.pool.actors,
        "pairs_per_s": round(pairs / max(score_s, 1e-9), 1),
        "actor_seconds": round(sum(r["seconds"] for r in results), 2),
    }
    if qrels:
        # Both runs over the same first-stage candidates: added positives would inflate recall.
        fair = {q: {d: reranked[q][d] for d, _, _ in ranked} for q, ranked in first_stage.items()}
        before = {q: {d: s for d, s, _ in ranked} for q, ranked in first_stage.items()}
        for key, run in (("metrics", fair), ("first_stage_metrics", before)):
            values = evaluate(qrels, run, JOB_MEASURES.values())
            summary[key] = {name: values[measure] for name, measure in JOB_MEASURES.items()}
        summary["judged_queries"] = len(qrels)
    summary["seconds"] = round(time.perf_counter() - started, 2)
    storage.write_json(storage.join(output, "summary.json"), summary)
    return summary


def print_metrics(summary: dict) -> None:
    """Both runs' metrics side by side, when the job had qrels."""
    if "metrics" in summary:
        print("first stage\n" + metrics_table(summary["first_stage_metrics"]), flush=True)
        print("re-ranked\n" + metrics_table(summary["metrics"]), flush=True)
