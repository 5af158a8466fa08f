"""Evaluation of a retriever through the distributed path: the corpus and the queries
encoded on a pool of actors, a FAISS index built in shards, searched by actors that reserve
what they hold; metrics by ``ir_measures``, never by hand, so they match published tooling.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.config import Renamed, truthy
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.parts import BlockFiles, claim, finished_blocks, join_blocks, recorded_block
from pipeline.core.plots import plot_metrics
from pipeline.core.runtime import RayConfig
from pipeline.core.sample import SAMPLE_DEV_QUERIES
from pipeline.core.sections import Collection, Output, Section
from pipeline.data.beir import Judgments, Queries, read_qrels, read_queries
from pipeline.data.runs import write_trec_lines
from pipeline.data.shards import PreparedCorpus, held_ids
from pipeline.retrieval.encode import EncodeConfig, EncoderSettings, run_encoding, store_query_vectors
from pipeline.retrieval.faiss_index import IndexConfig, validate_factory
from pipeline.retrieval.fanout import ranked_ids
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.metrics import (
    JOB_MEASURES,
    StreamedMetrics,
    measures_within,
    metrics_markdown,
    metrics_table,
)
from pipeline.retrieval.query_vectors import StoredQueryVectors
from pipeline.retrieval.search import SearcherConfig, ShardedIndex, query_block_of


@dataclass
class SearchSettings(Section):
    """How an evaluation searches the encoded corpus: the index, its depth, and the actors
    that encode (``pool``) and search (``searchers``)."""

    index: str = field(default="Flat", metadata={"help": "FAISS factory string of the index (Flat = exact)"})
    k: int = field(
        default=1000, metadata={"min": 1, "help": "passages retrieved per query (capped at the corpus size)"}
    )
    nprobe: int = field(default=32, metadata={"min": 1, "help": "IVF lists searched per query"})
    pool: ActorConfig = field(default_factory=ActorConfig)  # the encoders
    searchers: SearcherConfig = field(default_factory=SearcherConfig)


@dataclass
class EvalConfig(
    SearchSettings,
    Collection.with_defaults(
        corpus="",
        queries="",
        qrels="",
        notes={
            "corpus": "empty = the training corpus",
            "queries": f"evaluated after training (e.g. {SAMPLE_DEV_QUERIES}); empty = none",
        },
    ),
):
    """A trainer's evaluation of its export, when asked: the same path as jobs/evaluate.py."""

    def __post_init__(self):
        if self.queries and not self.qrels:
            raise ValueError("queries given without qrels: evaluating needs both")


def trainer_eval() -> EvalConfig:
    """A trainer's ``eval`` section as it starts: no queries, the top 100."""
    return EvalConfig(k=100)


# -- the evaluation job: encode on actors, index, search the shards, ir_measures ---------------


@dataclass
class EvaluateJobConfig(
    SearchSettings,
    Output.with_defaults(output="runs/evaluate", notes={"output": "embeddings, index, run.trec and metrics.json"}),
    Collection.with_defaults(notes={"corpus": "or a prepared corpus folder"}),
):
    # The encoder's options were once top-level: still read, as encoder.* (a note says so).
    RENAMED: ClassVar[dict] = {
        **{name: Renamed(f"encoder.{name}") for name in ("model", "pooling", "query_max_len", "precision")},
        "max_len": Renamed("encoder.passage_max_len"),
        "normalize": Renamed("encoder.similarity", convert=lambda v: "cos" if truthy(v) else "", flag=True),
    }

    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    docs_per_shard: int = field(default=20000, metadata={"min": 1, "help": "passages per corpus/embedding shard"})
    collections: list[str] = field(
        default_factory=list,
        metadata={
            "help": "BEIR collection folders to evaluate in one call, instead of --corpus/--queries/--qrels: "
            "each is corpus.jsonl, queries[.SPLIT].jsonl and qrels/SPLIT.tsv (or qrels.SPLIT.tsv); "
            "one table, collections.json and collections.png, each collection and their average"
        },
    )
    split: str = field(default="test", metadata={"help": "the split of --collections evaluated (BEIR: test)"})
    ray: RayConfig = field(default_factory=RayConfig)

    def check_inputs(self, prefix: str) -> None:
        named = {f"{prefix}collections": self.collections} if self.collections else {}
        named = named or {f"{prefix}{name}": [getattr(self, name)] for name in ("corpus", "queries", "qrels")}
        for option, uris in named.items():
            for uri in uris:
                storage.must_exist(uri, option)


def beir_collection(folder: str, split: str) -> Collection:
    """A BEIR folder's files for ``split``: BEIR's own layout (``queries.jsonl``,
    ``qrels/<split>.tsv``) or one file per split (``queries.<split>.jsonl``, ``qrels.<split>.tsv``),
    each plain or gzipped."""
    folder = storage.resolve(folder).uri
    candidates = {
        "corpus": ["corpus.jsonl"],
        "queries": [f"queries.{split}.jsonl", "queries.jsonl"],
        "qrels": [f"qrels/{split}.tsv", f"qrels.{split}.tsv"],
    }
    found = {}
    for what, names in candidates.items():
        uris = [storage.join(folder, *n.split("/")) + gz for n in names for gz in ("", ".gz")]
        found[what] = next((u for u in uris if storage.exists(u)), "")
        if not found[what]:
            raise InputError(f"collection {folder}: no {' or '.join(names)} (split {split!r})")
    return Collection(**found)


def _collections(cfg: EvaluateJobConfig) -> list[tuple[str, Collection]]:
    """Each folder of ``--collections`` and its name: its last path part (made unique)."""
    single = [f for f in ("corpus", "queries", "qrels") if getattr(cfg, f) != getattr(EvaluateJobConfig, f)]
    if single:
        raise ConfigError(f"--collections replaces --{', --'.join(single)}: give one or the other")
    out, seen = [], {}
    for folder in cfg.collections:
        base = folder.rstrip("/").rsplit("/", 1)[-1] or "collection"
        seen[base] = seen.get(base, 0) + 1
        out.append((base if seen[base] == 1 else f"{base}-{seen[base]}", beir_collection(folder, cfg.split)))
    return out


def evaluation_job(
    encoder: EncoderSettings, collection: Collection, search: SearchSettings, output: str, docs_per_shard: int
) -> EvaluateJobConfig:
    """The one evaluation job every caller builds (a trainer's ``--eval``, a workflow's dev
    evaluation): ``encoder``'s model on the collection's queries over its corpus (raw, or
    prepared with the model's tokenizer), searched as ``search`` says; its pool and searchers
    are the caller's own sections."""
    return EvaluateJobConfig(
        encoder=encoder,
        output=output,
        docs_per_shard=docs_per_shard,
        **Collection.values_of(collection),
        **SearchSettings.values_of(search),
    )


def run_evaluation(cfg: EvaluateJobConfig) -> dict:
    """One collection (``--corpus``, ``--queries``, ``--qrels``), or every one of ``--collections``."""
    return _evaluate_collections(cfg) if cfg.collections else _evaluate(cfg)


def _evaluate_collections(cfg: EvaluateJobConfig) -> dict:
    """Each collection evaluated as its own run under ``<output>/<name>`` (so each resumes and
    is reused as one), then one table, JSON and plot of all of them and their macro average
    (BEIR's convention: every collection weighs the same)."""
    started = time.perf_counter()
    collections = _collections(cfg)
    for _, c in collections:  # every collection's queries and judgments are read before any work
        read_qrels(c.qrels, query_ids=read_queries(c.queries))
    output = storage.resolve(cfg.output).uri
    results = {}
    for name, c in collections:
        one = dataclasses.replace(cfg, collections=[], output=storage.join(output, name), **Collection.values_of(c))
        summary = _evaluate(one)
        results[name] = {k: summary[k] for k in ("metrics", "queries", "judged_queries", "passages", "run", "seconds")}
    names = [m for m in JOB_MEASURES if all(m in r["metrics"] for r in results.values())]
    average = {m: sum(r["metrics"][m] for r in results.values()) / len(results) for m in names}
    rows = {name: r["metrics"] for name, r in results.items()} | {"average": average}
    table = metrics_markdown(rows, names, "collection")
    summary = {
        "job": "evaluate",
        "split": cfg.split,
        "collections": results,
        "metrics": average,
        "table": table,
        "markdown": storage.join(output, "collections.md"),
        "seconds": round(time.perf_counter() - started, 2),
    }
    storage.write_bytes(summary["markdown"], table.encode())
    summary["metrics_png"] = plot_metrics(
        rows, tuple(names), storage.join(output, "collections.png"), f"{len(results)} collections, split {cfg.split}"
    )
    storage.write_json(storage.join(output, "collections.json"), summary)
    return summary


def _say(text: str) -> None:
    print(f"evaluate: {text}", file=sys.stderr, flush=True)


def _judged_queries(cfg: EvaluateJobConfig) -> tuple[Queries, Judgments, str]:
    """The queries to evaluate, their judgments and the qrels' URI, checked before any work.

    BEIR's queries.jsonl holds every split's queries: only the ones the qrels judge are
    evaluated (MS MARCO's would be 509,962 for its 6,980 dev ones). Qrels of every dev
    query with a sample of them given are scored on the sample's judgments (an unjudged
    query scores 0 in every measure, so the others must not be counted). Both are said."""
    queries = read_queries(storage.resolve(cfg.queries).uri)  # duplicate ids fail here
    qrels_uri = storage.resolve(cfg.qrels).uri
    if not len(queries):
        raise InputError(f"{queries.source}: no query to evaluate")
    every = read_qrels(qrels_uri)  # its format
    qrels = every.restricted_to(queries)
    if not len(qrels):  # other qrels, or another split's: said before any note
        raise InputError(f"{qrels_uri}: judges none of the {len(queries)} queries of {queries.source}")
    if len(qrels) < len(every):
        _say(
            f"{len(every) - len(qrels)} of the {len(every)} queries judged in {qrels_uri} are not in "
            f"{queries.source}: scoring the {len(qrels)} given"
        )
    judged = queries.judged_only(qrels)
    if len(judged) < len(queries):
        _say(
            f"{len(queries) - len(judged)} of the {len(queries)} queries in {queries.source} have no "
            f"judgment in {qrels_uri}: evaluating the {len(judged)} judged ones"
        )
    return judged, qrels, qrels_uri


def _evaluate(cfg: EvaluateJobConfig) -> dict:
    started = time.perf_counter()
    output = storage.resolve(cfg.output).uri
    queries, qrels, qrels_uri = _judged_queries(cfg)

    def before_work(dim: int, corpus: PreparedCorpus) -> None:
        """What can fail later, checked once the corpus is prepared, before it is encoded."""
        passages = corpus.manifest["num_docs"]
        if cfg.k > passages:
            _say(f"--k {cfg.k} is more than the corpus's {passages} passages: every passage is ranked")
        validate_factory(cfg.index, dim)
        qrels.check_documents(functools.partial(held_ids, corpus.folder, corpus.manifest))

    encoded = run_encoding(
        EncodeConfig(
            corpus=cfg.corpus,
            output=storage.join(output, "embeddings"),
            docs_per_shard=cfg.docs_per_shard,
            encoder=cfg.encoder,
            pool=cfg.pool,
        ),
        before_work,
    )
    k = min(cfg.k, encoded["passages"])  # --k's help: capped at the corpus size
    indexed = run_indexing(
        IndexJobConfig(
            embeddings=encoded["output"],
            output=storage.join(output, "index"),
            index=IndexConfig(factory=cfg.index, nprobe=cfg.nprobe),
        )
    )
    run_uri = storage.join(output, "run.trec")
    searched = storage.join(output, "search")  # the run's blocks, kept until every one is written
    # The stored blocks hold metric sums too: the judgments are part of what made them; and
    # the queries' vectors, which the encoder's query settings and the model make.
    versions = {name: storage.version(uri) for name, uri in (("queries", cfg.queries), ("qrels", qrels_uri))}
    encoder = {
        "encoder": asdict(cfg.encoder),
        "model_version": model_ref.version(cfg.encoder.model, "--encoder.model"),
        "device": "cuda" if cfg.pool.use_gpu else "cpu",
    }
    claim(searched, {"index": indexed["version"], **versions, "k": k, **encoder})
    per_block = StreamedMetrics(qrels, JOB_MEASURES.values())  # a searched block's sums, to store
    # Recorded with the first block: a resumed evaluation keeps its blocks on another cluster.
    block = recorded_block(searched, query_block_of(indexed["output"], cfg.searchers, k, len(queries)))
    blocks = list(range(-(-len(queries) // block)))
    done = finished_blocks(searched)
    todo = [b for b in blocks if b not in done]
    # The encoders write each block's query vectors beside its parts before the searchers
    # start (the two never hold the GPUs at once); the search reads a block as it asks it,
    # so the driver never holds every query's vector.
    vectors = StoredQueryVectors.in_parts(searched, len(queries), block)
    store_query_vectors(cfg.encoder, lambda b: queries.texts(b * block, (b + 1) * block), todo, cfg.pool, vectors)
    # Each block's run lines and metric sums are written as the searchers answer it: a rerun
    # searches only the blocks it lacks.
    with ShardedIndex(indexed["output"], nprobe=cfg.nprobe, searchers=cfg.searchers) as index:
        search_start = time.perf_counter()
        for start, scores, _, ids in index.search_blocks(vectors, k, block=block, only=todo):
            run_block, files = {}, BlockFiles(("run.trec",))
            for qid, row_scores, row_ids in zip(queries.ids(start, start + len(scores)), scores, ids):
                ranked = ranked_ids(row_ids)
                write_trec_lines(files["run.trec"], qid, ranked, row_scores[: len(ranked)].tolist(), tag="raydense")
                run_block[qid] = dict(zip(ranked, map(float, row_scores)))
            files.commit(searched, start // block, per_block.block_sums(run_block))
        search_s = time.perf_counter() - search_start
        searchers = index.stats()
        search_mode, fallback = index.search_mode, index.fallback
    # The metrics from every block's stored sums, in block order: a resumed evaluation adds
    # them as an uninterrupted one does.
    scored = StreamedMetrics(qrels, JOB_MEASURES.values())
    for sums in join_blocks(searched, blocks, {"run.trec": run_uri}):
        scored.add_sums(sums)
    storage.delete_dir(searched)
    values = scored.result()
    metrics = {name: values[measure] for name, measure in measures_within(k, encoded["passages"]).items()}
    summary = {
        "job": "evaluate",
        "metrics": metrics,
        "queries": len(queries),
        "judged_queries": len(qrels),
        "passages": encoded["passages"],
        "index": cfg.index,
        "k": k,
        "run": run_uri,
        "similarity": encoded["similarity"],
        "encode_passages_per_s": encoded["passages_per_s"],
        "encode_shards_resumed": encoded["shards_skipped"],
        "search_seconds": round(search_s, 2),
        "index_shards_built": indexed["shards_built"],
        "search_blocks": len(blocks),
        "search_blocks_resumed": len(done),
        # Where each index shard was served from, what it reserved and its peak memory.
        "searchers": searchers,
        "search": search_mode,  # faiss-gpu, torch or faiss-cpu
        "gpu_fallback": fallback,  # why the search left FAISS's GPU path, when it did
        "seconds": round(time.perf_counter() - started, 2),
    }
    summary["metrics_png"] = plot_metrics(
        {"evaluate": metrics}, tuple(metrics), storage.join(output, "metrics.png"), f"{len(qrels)} judged queries"
    )
    storage.write_json(storage.join(output, "metrics.json"), summary)
    return summary


def print_metrics(summary: dict) -> None:
    print(summary.get("table") or metrics_table(summary["metrics"]), flush=True)
