"""Round-1 hard negatives of retriever fine-tuning from BM25 (``jobs/bm25_negatives.py``).

Retrieve the top ``depth`` documents of every query (:mod:`pipeline.retrieval.bm25`), drop
every judged positive (qrels score > 0) by id and every document with a zero score (not
retrieved at all, only padding when a query matches fewer than ``depth`` documents), then
keep ``count``: the best ranked (``sample="top"``) or a random ``count`` of them
(``sample="random"``, seeded per query by ``seed`` and the query id, so a query's sample does
not depend on the others; kept in rank order). Judged non-relevant documents (score <= 0)
stay: they are negatives by judgment.

The corpus is staged once into text shards (not at all when the run staged it already) and
its BM25 index built once per staging and scoring (:mod:`pipeline.retrieval.bm25_index`):
a rerun, or another stage asking for the same index, reads it. Each block of queries is
merged from the shards' answers and written to part files by a Ray task
(:meth:`ShardFanout.map_blocks`, as mining's are): the driver only asks, and a rerun
retrieves only the blocks it lacks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from pipeline.core import storage
from pipeline.core.errors import StorageError
from pipeline.core.parts import BlockFiles, claim, finished_blocks, join_blocks, recorded_block, summed
from pipeline.core.runtime import RayConfig
from pipeline.core.sections import TRAINING_SPLIT, Collection, Output, Section
from pipeline.data.beir import Queries, positives, read_qrels, read_queries
from pipeline.data.examples import build_training_examples
from pipeline.data.groups import select_negatives
from pipeline.data.records import write_json_line
from pipeline.data.runs import negatives_record, read_negatives, write_trec_lines
from pipeline.data.tevatron import passage_lookup, write_tevatron
from pipeline.data.text_shards import group_shards, stage_text
from pipeline.retrieval.bm25 import ShardedBm25, build_index
from pipeline.retrieval.fanout import query_block, ranked_ids, read_qrels_of_corpus


@dataclass
class Bm25Negatives(Section):
    """Round 1's BM25 negatives as a trainer or a workflow mines them (jobs/bm25_negatives.py
    itself: --depth and --count)."""

    bm25_depth: int = field(
        default=200,
        metadata={"min": 1, "help": "BM25 results per training query that round-1 negatives are drawn from"},
    )
    bm25_count: int = field(
        default=30, metadata={"min": 0, "help": "BM25 negatives kept per query (judged positives excluded)"}
    )

    def job(self, **paths: str) -> Bm25Config:
        """The BM25 negatives job with these settings; ``paths``: its collection, text and output."""
        return Bm25Config(depth=self.bm25_depth, count=self.bm25_count, **paths)


@dataclass
class Bm25Config(
    Output.with_defaults(
        output="runs/bm25/negatives.jsonl",
        notes={"output": "the negatives jsonl ({query_id, negatives, scores} per query; .gz = gzip)"},
    ),
    Collection.with_defaults(
        **TRAINING_SPLIT,
        notes={
            "corpus": "indexed as title + text",
            "queries": "mined for",
            "qrels": "positives are never negatives",
        },
    ),
):
    text: str = field(
        default="",
        metadata={
            "help": "folder of the corpus's staged text shards (a run's, shared with its other readers); empty = <output without .jsonl[.gz]>.text-shards, kept for reruns"
        },
    )
    run: str = field(
        default="",
        metadata={
            "help": "TREC run of the top-depth BM25 results (for ir_measures); empty = <output without .jsonl[.gz]>.run.trec; 'none' = not written"
        },
    )
    depth: int = field(default=200, metadata={"min": 1, "help": "BM25 results retrieved per query"})
    count: int = field(default=30, metadata={"min": 1, "help": "negatives kept per query"})
    sample: Literal["top", "random"] = field(
        default="top",
        metadata={
            "help": "top = the best-ranked count; random = count drawn from the depth (seeded per query), kept in rank order"
        },
    )
    seed: int = field(default=0, metadata={"min": 0, "help": "seed of sample=random"})
    skip_top: int = field(
        default=0, metadata={"min": 0, "help": "ignore the best-ranked N candidates (likely unjudged positives)"}
    )
    k1: float = field(default=0.9, metadata={"min": 0, "help": "BM25 k1"})
    b: float = field(default=0.4, metadata={"min": 0, "max": 1, "help": "BM25 b"})
    method: Literal["lucene", "robertson", "atire", "bm25l", "bm25+"] = field(
        default="lucene", metadata={"help": "bm25s scoring variant"}
    )
    lowercase: bool = field(default=True, metadata={"help": "lowercase before tokenizing"})
    stopwords: str = field(
        default="en", metadata={"help": "bm25s stopword list (en, en_plus, de, fr, ...); none = keep every token"}
    )
    stemmer: str = field(
        default="",
        metadata={"help": "PyStemmer algorithm, e.g. english (needs `pip install PyStemmer`); empty = no stemming"},
    )
    threads: int = field(
        default=0, metadata={"help": "retrieval threads of each shard actor; 0 = all cores of its node"}
    )
    batch_size: int = field(
        default=0, metadata={"help": "queries per block sent to the shard actors; 0 = 4,096 over the number of shards"}
    )
    docs_per_shard: int = field(
        default=1_000_000, metadata={"min": 1, "help": "documents per BM25 shard (one Ray actor each)"}
    )
    write_scores: bool = field(default=True, metadata={"help": "also write each negative's BM25 score"})
    tevatron: str = field(
        default="",
        metadata={
            "help": "also write the training file in Tevatron format (query, positive and negative passages with their text) here; empty = not written"
        },
    )
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        for name in ("depth", "count", "docs_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.count > self.depth:
            raise ValueError(f"count ({self.count}) must not exceed depth ({self.depth})")
        for name in ("threads", "batch_size", "skip_top"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def run_uri(self) -> str | None:
        if self.run.lower() == "none":
            return None
        if self.run:
            return self.run
        base = self.output.removesuffix(".gz").removesuffix(".jsonl")
        return base + ".run.trec"


def _write_tevatron(cfg: Bm25Config, queries: dict[str, str], qrels: dict) -> dict:
    """The mined training data as Tevatron jsonl, passage text included (read back from the
    corpus for just the passages it names)."""

    negatives = read_negatives(cfg.output)
    examples, stats = build_training_examples(queries, qrels, negatives)
    needed = {d for ex in examples for d in ex.positives + ex.negatives}
    written = write_tevatron(examples, passage_lookup(cfg.corpus, needed), cfg.tevatron)
    return {
        "path": cfg.tevatron,
        "examples": written,
        **{k: v for k, v in stats.as_dict().items() if not k.endswith("_examples")},
    }


def _text_folder(cfg: Bm25Config) -> str:
    return cfg.text or cfg.output.removesuffix(".gz").removesuffix(".jsonl") + ".text-shards"


OUTPUTS = ("negatives.jsonl", "run.trec")  # a block's files, in its object
COUNTS = ("negatives", "positives_dropped", "short", "none")


def _parts_folder(cfg: Bm25Config) -> str:
    return cfg.output.removesuffix(".gz").removesuffix(".jsonl") + ".parts"


def _made_by(cfg: Bm25Config) -> dict:
    """What the negatives depend on: every setting but where things go and how fast, and
    the stored versions of the corpus, queries and judgments."""
    skip = ("output", "run", "text", "tevatron", "threads", "ray")
    return {
        "settings": {k: v for k, v in asdict(cfg).items() if k not in skip},
        "versions": {name: storage.version(getattr(cfg, name)) for name in ("corpus", "queries", "qrels")},
    }


def _write_block(scores, rows, ids, cfg: Bm25Config, folder: str, block: int, qids: list[str], qrels: dict) -> None:
    """:meth:`ShardFanout.map_blocks`' work, in the task that merged the block's answers:
    its run lines, negatives and counts, as one object (the hits never reach the driver)."""
    counts = dict.fromkeys(COUNTS, 0)
    files = BlockFiles(OUTPUTS)
    for qid, row_ids, row_scores in zip(qids, ids, scores):
        ranked = ranked_ids(row_ids)
        ranked_scores = row_scores[: len(ranked)].astype(float).tolist()
        write_trec_lines(files["run.trec"], qid, ranked, ranked_scores, tag="bm25")
        judged = set(positives(qrels.get(qid, {})))
        negs, neg_scores = select_negatives(qid, ranked, ranked_scores, judged, cfg)
        counts["negatives"] += len(negs)
        counts["positives_dropped"] += sum(d in judged for d in ranked)
        counts["short"] += len(negs) < cfg.count
        counts["none"] += not negs
        write_json_line(files["negatives.jsonl"], negatives_record(qid, negs, neg_scores if cfg.write_scores else None))
    files.commit(folder, block, counts)


def _index_summary(index: ShardedBm25) -> dict:
    return {
        "docs": index.total,
        "shards": len(index.shards),
        "vocab_size": index.vocab_size,
        "index_bytes": index.nbytes,
        "shard_peak_rss_bytes": max(s["peak_rss_bytes"] for s in index.shards),
        "index_seconds": round(index.seconds, 2),
        "index_reused": index.index["reused"],
        "index_folder": index.index["folder"],
        "corpus": index.corpus_stats,
    }


def mine_negatives(cfg: Bm25Config) -> dict:
    """Write the negatives jsonl (and the run); returns the job summary.

    Query blocks go to part files beside the output first (:mod:`pipeline.core.parts`): a
    run stopped mid-way and rerun reads the stored index and retrieves only the blocks it
    lacks (none: no index served at all), unless a setting or an input changed."""
    start = time.perf_counter()
    for uri in (cfg.corpus, cfg.queries, cfg.qrels):  # fail before spending minutes on the index
        if not storage.exists(uri):
            raise StorageError(f"{uri}: no such file or directory")
    queries = read_queries(cfg.queries)
    folder = _parts_folder(cfg)
    claim(folder, _made_by(cfg), what="retrieved blocks' files")
    text = stage_text(cfg.corpus, _text_folder(cfg), cfg.docs_per_shard)
    block = recorded_block(
        folder,
        cfg.batch_size
        or query_block(len(group_shards(text["shards"], cfg.docs_per_shard)), cfg.depth, queries=len(queries)),
    )
    blocks = list(range(-(-len(queries) // block)))
    todo = [b for b in blocks if b not in finished_blocks(folder)]
    retrieve_s = 0.0
    if todo:
        scoring = {k: getattr(cfg, k) for k in ("k1", "b", "method", "lowercase", "stopwords", "stemmer")}
        with build_index(text, **scoring, docs_per_shard=cfg.docs_per_shard) as index:
            storage.write_json(storage.join(folder, "index.json"), _index_summary(index))
            qrels = read_qrels_of_corpus(cfg.qrels, index.holds, queries)
            retrieve_start = time.perf_counter()
            named = Queries.of(queries)

            def block_args(start: int, size: int) -> tuple:
                qids = named.ids(start, start + size)
                return cfg, folder, start // block, qids, qrels.of(qids)

            k = min(cfg.depth, index.total)
            asked = index.map_blocks(
                named.text_rows, k, _write_block, block_args, block=block, only=todo, threads=cfg.threads
            )
            for _ in asked:
                pass
            retrieve_s = time.perf_counter() - retrieve_start
    else:
        qrels = read_qrels(cfg.qrels, query_ids=queries)  # its documents were checked when retrieved
    run_uri = cfg.run_uri()
    outputs = {"negatives.jsonl": cfg.output} | ({"run.trec": run_uri} if run_uri is not None else {})
    counts = summed(join_blocks(folder, blocks, outputs), COUNTS)
    index_summary = storage.read_json(storage.join(folder, "index.json"))
    storage.delete_dir(folder)
    n = len(queries)
    tevatron = _write_tevatron(cfg, queries, qrels) if cfg.tevatron else None
    return {
        "job": "bm25_negatives",
        "output": cfg.output,
        "run": run_uri,
        "tevatron": tevatron,
        "queries": n,
        "blocks": len(blocks),
        "blocks_resumed": len(blocks) - len(todo),
        "queries_without_positive": sum(1 for q in queries if not positives(qrels.get(q, {}))),
        "negatives_per_query": round(counts["negatives"] / max(n, 1), 3),
        "queries_short": counts["short"],
        "queries_no_negatives": counts["none"],
        "positives_dropped": counts["positives_dropped"],
        "retrieve_seconds": round(retrieve_s, 2),
        "seconds": round(time.perf_counter() - start, 2),
        **index_summary,
    }
