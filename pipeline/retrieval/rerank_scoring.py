"""Re-ranker scoring on Ray actors: a first-stage run's top candidates re-scored by a
cross-encoder, written as a TREC run and evaluated against the first stage.

Streamed end to end, so the driver's memory does not grow with the run or the corpus: the
first-stage run is read a query at a time (:func:`pipeline.data.runs.iter_trec_run`) and
cut into blocks of queries (sized by the bytes they carry, :func:`scoring_block`) that carry ids only; each re-ranker actor
fetches its block's passage texts from the passage servers
(:mod:`pipeline.retrieval.passages`) and returns scores; the driver writes each block's
lines and adds its metrics (:class:`pipeline.retrieval.metrics.StreamedMetrics`) as results
arrive, in order. At most a window of blocks is in flight."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import ray
import torch

from models.framing import Framing
from models.reranker import (
    SETTINGS_FILE,
    PairLengths,
    check_max_len,
    load_reranker,
    pair_inputs,
)
from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig, actor_device, stream_actor_pool
from pipeline.core.capacity import CapacityWait
from pipeline.core.errors import InputError
from pipeline.core.parts import BlockFiles, claim, finished_blocks, join_blocks, recorded_block, remove_parts
from pipeline.core.progress import progress
from pipeline.core.runtime import RayConfig
from pipeline.core.sections import Collection, Output
from pipeline.data.beir import positives, read_qrels, read_queries
from pipeline.data.runs import count_run_queries, iter_trec_run, write_trec_lines
from pipeline.data.text_shards import stage_text
from pipeline.data.tokenizer import BERT_SPECIALS, load_tokenizer
from pipeline.retrieval.fanout import PROGRESS_BLOCKS
from pipeline.retrieval.inference import (
    batch_limits,
    check_finite,
    cpu_linears_field,
    held_in,
    inference,
    inference_dtype,
    length_sorted_batches,
    made_in,
    on_device,
    overlapped,
    with_cpu_linears,
)
from pipeline.retrieval.metrics import JOB_MEASURES, StreamedMetrics, metrics_table
from pipeline.retrieval.passages import PassageStore, fetch_texts


@dataclass
class RerankScoreConfig(
    Output.with_defaults(
        output="runs/rerank_score", notes={"output": "run.trec (the re-ranker's scores) and summary.json"}
    ),
    Collection.with_defaults(
        notes={
            "corpus": "holding every candidate",
            "queries": "every query of the run must be in it",
            "qrels": "both runs are evaluated with ir_measures; empty = no evaluation",
        }
    ),
):
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
    text: str = field(
        default="",
        metadata={
            "help": "folder of the corpus's staged text shards (a run's, shared with its other readers); empty = <output>/text-shards, kept for reruns"
        },
    )
    include_positives: bool = field(
        default=False,
        metadata={
            "help": "also score the judged positives the run missed, for the run's queries (for a distillation teacher); metrics still rank the first-stage candidates only"
        },
    )
    depth: int = field(
        default=100, metadata={"min": 1, "help": "best-scored candidates of the run re-ranked per query"}
    )
    query_max_len: int = field(
        default=0,
        metadata={"min": 0, "help": "query tokens; 0 = the export's reranker.json (32 for a plain checkpoint)"},
    )
    passage_max_len: int = field(
        default=0,
        metadata={"min": 0, "help": "passage tokens; 0 = the export's reranker.json (160 for a plain checkpoint)"},
    )
    max_len: int = field(
        default=0,
        metadata={"min": 0, "help": "pair tokens; 0 = the export's reranker.json (192 for a plain checkpoint)"},
    )
    batch_size: int = field(
        default=0,
        metadata={
            "help": "pairs per forward at most (length-sorted, each batch padded to its longest); 0 = auto: 4,096 on GPUs, 64 on CPUs"
        },
    )
    batch_tokens: int = field(
        default=0,
        metadata={
            "help": "padded pair tokens per forward at most (rows x the batch's longest); 0 = auto: 131,072 on GPUs (as for the encoder), none on CPUs"
        },
    )
    queries_per_task: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "queries per actor task (the unit written, resumed and retried after an actor died); 0 = sized by bytes: about 32 MiB of candidate text a task",
        },
    )
    docs_per_server: int = field(
        default=2_000_000, metadata={"help": "corpus documents per passage server (a Ray actor holding their texts)"}
    )
    precision: Literal["auto", "fp32", "fp16", "bf16"] = field(
        default="auto",
        metadata={
            "help": "fp16/bf16 hold the model in that precision; auto = fp16 on GPUs, fp32 on CPUs (as for the encoder)"
        },
    )
    cpu_linears: Literal["onednn", "blas"] = cpu_linears_field()
    pool: ActorConfig = field(default_factory=ActorConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        for name in ("depth", "docs_per_server"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("batch_size", "batch_tokens", "queries_per_task"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


CPU_PAIRS = 64  # pairs a forward on CPUs where batch_size is 0


class PairScorer:
    """A re-ranker on one device, scoring (query, passage) texts in length-sorted batches.
    Pairs are cut exactly as in training (:class:`models.reranker.PairLengths`)."""

    def __init__(
        self,
        model_dir: str,
        lengths: PairLengths | None = None,
        batch_size: int = 0,
        precision: str = "auto",
        device: str = "cpu",
        batch_tokens: int = 0,
        cpu_linears: str = "onednn",
    ):
        self.model = load_reranker(model_dir).to(device)
        self.dtype = inference_dtype(precision, device, self.model.model.config.hidden_size)
        with_cpu_linears(held_in(self.model, self.dtype), device, cpu_linears)
        self.lengths = lengths or self.model.lengths
        self.lengths.check()
        check_max_len(self.model.model.config, self.lengths.max_len, model_dir)
        self.tokenizer = load_tokenizer(model_dir, BERT_SPECIALS)
        self.framing = Framing.bert(
            self.tokenizer.cls_token_id, self.tokenizer.sep_token_id, self.tokenizer.pad_token_id
        )
        self.batch_limits, self.device = batch_limits(device, batch_size, batch_tokens, CPU_PAIRS), device

    def _framed(self, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_len - 2)["input_ids"]
        width = max((len(t) for t in tokens), default=0) + 2
        ids, lengths = self.framing.frame(tokens, width)
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
        scores = torch.zeros(len(pair_q), dtype=torch.float32)
        sep, pad = self.tokenizer.sep_token_id, self.tokenizer.pad_token_id

        def forward(batch_rows: np.ndarray) -> torch.Tensor:
            idx = torch.from_numpy(batch_rows)
            qi, di = pair_q[idx], pair_d[idx]
            batch = pair_inputs(q_ids[qi], q_len[qi], d_ids[di], d_len[di], self.lengths.max_len, sep, pad)
            return self.model(**on_device(batch, self.device))

        with inference(self.device, self.dtype):
            for batch_rows, batch_scores in overlapped(
                length_sorted_batches(pair_len.numpy(), *self.batch_limits), forward
            ):
                scores[torch.from_numpy(batch_rows)] = torch.from_numpy(batch_scores)
        check_finite(scores.numpy(), self.dtype, "re-ranker scores")
        return [part.numpy() for part in scores.split([len(docs) for docs in candidates])]


class RerankerActor:
    """A Ray actor holding one :class:`PairScorer`; scores blocks of queries, joining their
    candidates' ids to texts through the passage servers each call is given."""

    def __init__(self, model_uri: str, lengths: PairLengths, cfg: RerankScoreConfig):
        torch.set_num_threads(max(1, int(cfg.pool.cpus_per_actor)))
        model_dir = model_ref.materialize(model_uri, "--model")
        self.scorer = PairScorer(
            model_dir,
            lengths,
            cfg.batch_size,
            cfg.precision,
            actor_device(cfg.pool),
            cfg.batch_tokens,
            cfg.cpu_linears,
        )

    def pid(self) -> int:
        return os.getpid()

    def score(self, block: dict, servers: list) -> dict:
        started = time.perf_counter()
        doc_ids = list(dict.fromkeys(d for docs in block["candidates"] for d in docs))
        found = fetch_texts(servers, doc_ids)
        missing = [d for d, text in zip(doc_ids, found) if text is None]
        if missing:
            raise InputError(
                f"{block['named'][missing[0]]}: document {missing[0]!r} is not in the corpus"
                + (f" ({len(missing)} such documents in this block)" if len(missing) > 1 else "")
            )
        scores = self.scorer.score(block["query_texts"], block["candidates"], dict(zip(doc_ids, found)))
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


# A scoring task's block is sized as the fan-out's are (pipeline.retrieval.fanout), by the
# bytes it carries: its candidates' texts, fetched by the actor, and their ids and scores.
SCORING_BLOCK_BYTES = 32 * 2**20
PAIR_BYTES = 1024  # a candidate's text (MS MARCO's average 340 bytes, with margin), id and scores
MIN_SCORING_BLOCK, MAX_SCORING_BLOCK = 64, 4096  # 64: a small run stays one task, as it was


def scoring_block(depth: int, queries: int) -> int:
    """Queries per scoring task at ``depth`` candidates a query: as many as carry about
    ``SCORING_BLOCK_BYTES``, within [MIN_SCORING_BLOCK, MAX_SCORING_BLOCK], and at most a
    ``PROGRESS_BLOCKS``-th of the ``queries`` (so that progress moves), but never under
    MIN_SCORING_BLOCK (a task and an object each cost more than a few queries' scoring). MS MARCO's 502,939
    training queries at the teacher's depth 30: 1,092 a task, 461 tasks (64 a task made 7,859)."""
    fits = min(MAX_SCORING_BLOCK, max(MIN_SCORING_BLOCK, SCORING_BLOCK_BYTES // (max(1, depth) * PAIR_BYTES)))
    return max(1, min(fits, max(MIN_SCORING_BLOCK, -(-queries // PROGRESS_BLOCKS))))


def _blocks(
    cfg: RerankScoreConfig, block_queries: int, run_uri: str, qrels_uri: str, queries: dict, qrels: dict, counts: dict
):
    """The first-stage run in blocks of ``block_queries`` queries, by id: each query's
    best ``depth`` candidates (and, with ``include_positives``, its judged positives the run
    missed), their first-stage scores, and where each id was named (for a missing
    document's error)."""

    def empty() -> dict:
        return {"query_ids": [], "query_texts": [], "candidates": [], "first_stage": [], "named": {}}

    block = empty()
    for qid, ranked in iter_trec_run(run_uri, cfg.depth, query_ids=queries):
        candidates = [d for d, _, _ in ranked]
        named = {d: f"{run_uri} line {line}" for d, _, line in ranked}
        if cfg.include_positives:
            # Only the run's queries: a query the first stage did not retrieve for (e.g. left
            # out of a sampled teacher run) would get its positives and nothing to compare.
            missed = [d for d in positives(qrels.get(qid, {})) if d not in named]
            counts["positives_added"] += len(missed)
            candidates += missed
            named.update((d, f"{qrels_uri}: positive of query {qid!r}") for d in missed)
        counts["queries"] += 1
        counts["pairs"] += len(candidates)
        block["query_ids"].append(qid)
        block["query_texts"].append(queries[qid])
        block["candidates"].append(candidates)
        block["first_stage"].append([score for _, score, _ in ranked])
        block["named"].update(named)
        if len(block["query_ids"]) == block_queries:
            yield block
            block = empty()
    if block["query_ids"]:
        yield block


def _made_by(cfg: RerankScoreConfig, model_uri: str, lengths: PairLengths) -> dict:
    """What the scores depend on: the model and its stored version, the pair lengths, the
    settings that pick the pairs, and the stored versions of the run, queries, judgments
    and corpus."""
    inputs = {name: getattr(cfg, name) for name in ("run", "queries", "qrels", "corpus") if getattr(cfg, name)}
    hidden = model_ref.read_config(model_uri, "--model").get("hidden_size", 0)
    precision = made_in(cfg.precision, "cuda" if cfg.pool.use_gpu else "cpu", hidden)
    return {
        "model": model_uri,
        "model_version": model_ref.version(model_uri, "--model"),
        "lengths": asdict(lengths),
        "pairs": {k: getattr(cfg, k) for k in ("depth", "include_positives")} | precision,
        "versions": {name: storage.version(uri) for name, uri in inputs.items()},
    }


def _write_block(output: str, block: dict, scores: list, reranked_metrics, first_stage_metrics) -> None:
    """A scored block's re-ranked run lines and its metric sums, as one object."""
    reranked, first_stage, files = {}, {}, BlockFiles(("run.trec",))
    for qid, cands, query_scores, first in zip(block["query_ids"], block["candidates"], scores, block["first_stage"]):
        order = np.argsort(-query_scores, kind="stable")
        write_trec_lines(files["run.trec"], qid, [cands[i] for i in order], query_scores[order].tolist(), tag="rerank")
        reranked[qid] = dict(zip(cands[: len(first)], map(float, query_scores[: len(first)])))
        first_stage[qid] = dict(zip(cands, first))
    sums = {
        "metrics": reranked_metrics.block_sums(reranked),
        "first_stage_metrics": first_stage_metrics.block_sums(first_stage),
    }
    files.commit(output, block["index"], sums)


def run_scoring(cfg: RerankScoreConfig) -> dict:
    """Score the run's top-``depth`` candidates on Ray actors, write the re-ranked run, evaluate."""

    started = time.perf_counter()
    output = storage.resolve(cfg.output).uri
    model_uri = _model_uri(cfg.model)
    lengths = _pair_lengths(cfg, model_uri)
    run_uri, qrels_uri = storage.resolve(cfg.run).uri, storage.resolve(cfg.qrels).uri if cfg.qrels else ""
    queries = read_queries(storage.resolve(cfg.queries).uri)
    qrels = read_qrels(qrels_uri, query_ids=queries) if qrels_uri else {}
    # Both runs are evaluated over the first-stage candidates only: added positives would
    # inflate the re-ranked run's recall. These compute each block's sums, to store.
    block_reranked = StreamedMetrics(qrels, JOB_MEASURES.values())
    block_first_stage = StreamedMetrics(qrels, JOB_MEASURES.values())
    counts = {"queries": 0, "pairs": 0, "positives_added": 0}
    out_run = storage.join(output, "run.trec")
    claim(output, _made_by(cfg, model_uri, lengths), what="scored blocks' files")
    done = finished_blocks(output)
    run_queries = count_run_queries(run_uri)  # one pass over a run that may hold ~100M lines
    block_queries = recorded_block(output, cfg.queries_per_task or scoring_block(cfg.depth, run_queries))
    blocks = list(range(-(-run_queries // block_queries)))

    def todo():
        """The run's blocks not yet scored (every block is read: it counts the pairs)."""
        for b, block in enumerate(_blocks(cfg, block_queries, run_uri, qrels_uri, queries, qrels, counts)):
            if b not in done:
                yield {**block, "index": b}

    remote = ray.remote(RerankerActor).options(**cfg.pool.remote_options(), max_restarts=0)
    actor_seconds = 0.0
    with PassageStore(
        stage_text(cfg.corpus, cfg.text or storage.join(output, "text-shards"), cfg.docs_per_server),
        cfg.docs_per_server,
    ) as passages:

        def score(actor, block: dict):
            return passages.call_with_servers(lambda servers: actor.score.remote(block, servers))

        score_start = time.perf_counter()
        results = stream_actor_pool(
            lambda: remote.remote(model_uri, lengths, cfg),
            todo(),
            score,
            cfg.pool.max_retries,
            cfg.pool.actors,
            capacity=CapacityWait.of(cfg.pool, "re-ranker actors"),
        )
        with progress(run_queries, "rerank", "queries") as bar:
            # In block order: each block (ids, first-stage scores) with its scores, to its part.
            for block, result in results:
                bar.update(len(block["query_ids"]))
                actor_seconds += result["seconds"]
                _write_block(output, block, result["scores"], block_reranked, block_first_stage)
        score_s = time.perf_counter() - score_start
        servers_restarted = passages.restarted()
    # The metrics from every block's stored sums, in block order: a resumed scoring adds them
    # as an uninterrupted one does.
    reranked_metrics = StreamedMetrics(qrels, JOB_MEASURES.values())
    first_stage_metrics = StreamedMetrics(qrels, JOB_MEASURES.values())
    for stored in join_blocks(output, blocks, {"run.trec": out_run}):
        reranked_metrics.add_sums(stored["metrics"])
        first_stage_metrics.add_sums(stored["first_stage_metrics"])
    remove_parts(output)

    summary = {
        "job": "rerank_score",
        "output": output,
        "run": out_run,
        "input_run": run_uri,
        "model": model_uri,
        "queries": counts["queries"],
        "queries_without_candidates": len(queries) - counts["queries"],
        "pairs": counts["pairs"],
        "positives_added": counts["positives_added"],
        "depth": cfg.depth,
        "lengths": asdict(lengths),
        "actors": cfg.pool.actors,
        "passage_servers": len(passages.actors),
        "passage_servers_restarted": servers_restarted,  # by Ray, after their process or node died
        "blocks": len(blocks),
        "blocks_resumed": len(done & set(blocks)),
        "pairs_per_s": round(counts["pairs"] / max(score_s, 1e-9), 1),
        "actor_seconds": round(actor_seconds, 2),
    }
    if qrels:
        for key, metrics in (("metrics", reranked_metrics), ("first_stage_metrics", first_stage_metrics)):
            values = metrics.result()
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
