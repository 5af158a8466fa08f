"""Evaluation of a retriever through the distributed path: the corpus and the queries
encoded on a pool of actors, a FAISS index built in shards, searched by actors that reserve
what they hold; metrics by ``ir_measures``, never by hand, so they match published tooling.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import ClassVar

from pipeline.core import storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.config import Renamed, truthy
from pipeline.core.errors import ConfigError
from pipeline.core.parts import claim, finished_blocks, join_parts, part_uri
from pipeline.core.plots import plot_metrics
from pipeline.core.runtime import RayConfig
from pipeline.core.sample import SAMPLE_CORPUS, SAMPLE_DEV_QRELS, SAMPLE_DEV_QUERIES
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.runs import write_trec_lines
from pipeline.data.shards import held_ids
from pipeline.retrieval.encode import EncodeConfig, EncoderSettings, run_encoding
from pipeline.retrieval.faiss_index import IndexConfig, validate_factory
from pipeline.retrieval.fanout import query_block, ranked_ids, read_qrels_of_corpus
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.metrics import JOB_MEASURES, StreamedMetrics, metrics_table
from pipeline.retrieval.search import ShardedIndex


@dataclass
class EvalConfig:
    """A trainer's evaluation of its export, when asked: the same path as jobs/evaluate.py."""

    queries: str = field(
        default="",
        metadata={
            "help": f"BEIR queries.jsonl to evaluate on after training (e.g. {SAMPLE_DEV_QUERIES}); empty = none"
        },
    )
    qrels: str = field(default="", metadata={"help": "BEIR qrels TSV of those queries"})
    corpus: str = field(default="", metadata={"help": "BEIR corpus.jsonl to search; empty = the training corpus"})
    k: int = field(default=100, metadata={"help": "passages retrieved per query"})
    index: str = field(default="Flat", metadata={"help": "FAISS factory string of the index (Flat = exact)"})
    pool: ActorConfig = field(default_factory=ActorConfig)

    def __post_init__(self):
        if self.queries and not self.qrels:
            raise ValueError("queries given without qrels: evaluating needs both")


# -- the evaluation job: encode on actors, index, search the shards, ir_measures ---------------


@dataclass
class EvaluateJobConfig:
    # The encoder's options were once top-level: still read, as encoder.* (a note says so).
    RENAMED: ClassVar[dict] = {
        **{name: Renamed(f"encoder.{name}") for name in ("model", "pooling", "query_max_len", "precision")},
        "max_len": Renamed("encoder.passage_max_len"),
        "normalize": Renamed("encoder.similarity", convert=lambda v: "cos" if truthy(v) else "", flag=True),
    }

    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    corpus: str = field(
        default=SAMPLE_CORPUS, metadata={"help": "BEIR corpus.jsonl or a prepared corpus folder (local or s3://)"}
    )
    queries: str = field(default=SAMPLE_DEV_QUERIES, metadata={"help": "BEIR queries.jsonl (local or s3://)"})
    qrels: str = field(default=SAMPLE_DEV_QRELS, metadata={"help": "BEIR qrels TSV with a header"})
    index: str = field(default="Flat", metadata={"help": "FAISS factory string of the index (Flat = exact)"})
    k: int = field(default=1000, metadata={"help": "passages retrieved per query"})
    output: str = field(
        default="runs/evaluate", metadata={"help": "embeddings, index, run.trec and metrics.json go here"}
    )
    pool: ActorConfig = field(default_factory=ActorConfig)
    nprobe: int = field(default=32, metadata={"help": "IVF lists searched per query"})
    docs_per_shard: int = field(default=20000, metadata={"help": "passages per corpus/embedding shard"})
    ray: RayConfig = field(default_factory=RayConfig)


def run_evaluation(cfg: EvaluateJobConfig) -> dict:
    started = time.perf_counter()
    output = storage.resolve(cfg.output).uri
    queries = read_queries(storage.resolve(cfg.queries).uri)  # duplicate ids fail here, before any work
    qids = list(queries)
    qrels_uri = storage.resolve(cfg.qrels).uri
    judged = read_qrels(qrels_uri, query_ids=set(queries))  # its format and query ids: before any work
    qrels: dict[str, dict[str, int]] = {}

    def before_work(dim: int, corpus: str, manifest: dict) -> None:
        """What can fail later, checked once the corpus is prepared, before it is encoded."""
        if cfg.k > manifest["num_docs"]:
            raise ConfigError(f"--k {cfg.k} is larger than the corpus ({manifest['num_docs']} passages)")
        validate_factory(cfg.index, dim)
        holds = functools.partial(held_ids, corpus, manifest)
        qrels.update(read_qrels_of_corpus(qrels_uri, holds, set(queries), judged))

    # The encoder actors encode the queries too, after the corpus: nothing runs a model here.
    encoded = run_encoding(
        EncodeConfig(
            corpus=cfg.corpus,
            output=storage.join(output, "embeddings"),
            docs_per_shard=cfg.docs_per_shard,
            encoder=cfg.encoder,
            pool=cfg.pool,
        ),
        [queries[q] for q in qids],
        before_work,
    )
    indexed = run_indexing(
        IndexJobConfig(
            embeddings=encoded["output"],
            output=storage.join(output, "index"),
            index=IndexConfig(factory=cfg.index, nprobe=cfg.nprobe),
        )
    )
    run_uri = storage.join(output, "run.trec")
    searched = storage.join(output, "search")  # the run's blocks, kept until every one is written
    # The stored blocks hold metric sums too: the judgments are part of what made them.
    versions = {name: storage.version(uri) for name, uri in (("queries", cfg.queries), ("qrels", qrels_uri))}
    claim(searched, {"index": indexed["version"], **versions, "k": cfg.k})
    scored = StreamedMetrics(qrels, JOB_MEASURES.values())
    # Each block's run lines and metric sums are written as the searchers answer it: a rerun
    # searches only the blocks it lacks.
    with ShardedIndex(indexed["output"], nprobe=cfg.nprobe, pool=cfg.pool) as index:
        block = query_block(len(index.actors))
        blocks = list(range(-(-len(qids) // block)))
        done = finished_blocks(searched, ("run.trec", "sums.json"))
        for b in done:
            scored.add_sums(storage.read_json(part_uri(searched, b, "sums.json")))
        search_start = time.perf_counter()
        vectors = encoded.pop("query_vectors")
        todo = [b for b in blocks if b not in done]
        for start, scores, _, ids in index.search_blocks(vectors, cfg.k, block=block, only=todo):
            run_block = {}
            with storage.open_output(part_uri(searched, start // block, "run.trec")) as out:
                for qid, row_scores, row_ids in zip(qids[start:], scores, ids):
                    ranked = ranked_ids(row_ids)
                    write_trec_lines(out, qid, ranked, row_scores[: len(ranked)].tolist(), tag="raydense")
                    run_block[qid] = dict(zip(ranked, map(float, row_scores)))
            storage.write_json(part_uri(searched, start // block, "sums.json"), scored.block_sums(run_block))
        search_s = time.perf_counter() - search_start
        searchers = index.stats()
    join_parts(searched, blocks, "run.trec", run_uri)
    storage.delete_dir(searched)
    values = scored.result()
    metrics = {name: values[measure] for name, measure in JOB_MEASURES.items()}
    summary = {
        "job": "evaluate",
        "metrics": metrics,
        "queries": len(qids),
        "judged_queries": len(qrels),
        "passages": encoded["passages"],
        "index": cfg.index,
        "k": cfg.k,
        "run": run_uri,
        "similarity": encoded["similarity"],
        "encode_passages_per_s": encoded["passages_per_s"],
        "search_seconds": round(search_s, 2),
        "index_shards_built": indexed["shards_built"],
        "search_blocks": len(blocks),
        "search_blocks_resumed": len(done),
        # Where each index shard was served from, what it reserved and its peak memory.
        "searchers": searchers,
        "seconds": round(time.perf_counter() - started, 2),
    }
    summary["metrics_png"] = plot_metrics(
        {"evaluate": metrics}, tuple(metrics), storage.join(output, "metrics.png"), f"{len(qrels)} judged queries"
    )
    storage.write_json(storage.join(output, "metrics.json"), summary)
    return summary


def print_metrics(summary: dict) -> None:
    print(metrics_table(summary["metrics"]), flush=True)
