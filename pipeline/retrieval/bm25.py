"""BM25 with ``bm25s`` on Ray: a sharded sparse retriever whose merged top-k is exactly one
index's over the whole corpus.

The corpus (title + text, as :func:`pipeline.data.corpus.iter_documents` joins them) is
staged as text shards in the run's storage (:func:`pipeline.data.text_shards.stage_text`:
once per run, shared with preparation and the passage servers). Its index is built once
per staging and scoring, in Ray tasks, and stored beside the staging
(:mod:`pipeline.retrieval.bm25_index`): every stage and rerun asking for the same index
reads it. One :class:`Bm25Shard` actor per stored shard serves it; each shard scores with
the whole corpus's statistics, so the merge of every shard's top-k
(:mod:`pipeline.retrieval.fanout`) is the exact global top-k.

Memory: the driver holds no document id, text, term or posting. A shard actor reserves
what it holds (its arrays, vocabulary and ids, as its build measured them); a build task
reserves what it builds. Results arrive a block of queries at a time, as ids, or are merged
and used in tasks (:meth:`ShardFanout.map_blocks`: the round-1 negatives of
:mod:`pipeline.retrieval.bm25_negatives`).
"""

from __future__ import annotations

import functools
import os
import resource
import time
from collections.abc import Mapping, Sequence
from typing import Iterator

import numpy as np
import pyarrow as pa
import ray

from pipeline.core import storage
from pipeline.data.beir import Queries
from pipeline.data.corpus_ids import CorpusIds
from pipeline.retrieval.bm25_index import IndexPlan, load_shard, serve_memory, stemmer_of, stored_index
from pipeline.retrieval.fanout import ShardFanout, ranked_ids

SHARD_CPUS = 0.01  # a token share, as searchers take (see pipeline.retrieval.search.plan_searchers)


def _load_ids(load: list[dict]) -> CorpusIds:
    """A load's doc ids (first row set), read from the staged text's id column alone."""
    column = pa.concat_arrays(
        [storage.read_parquet(i["text_uri"], ["doc_id"]).column("doc_id").combine_chunks() for i in load]
    )
    ids = CorpusIds(column.cast("binary").to_numpy(zero_copy_only=False).astype(bytes))
    ids.first_row = load[0]["first_row"]
    return ids


class Bm25Shard:
    """A Ray actor: one stored shard of a BM25 index, answering top-k for blocks of query
    texts as corpus rows and doc ids. Everything it serves comes from storage (the index's
    shard, the staged ids), so Ray can restart it, on another node when its own is lost,
    and it serves the same index again."""

    def __init__(self, load: list[dict], scoring: dict, shard_folder: str):
        self.ids = _load_ids(load)
        self.tokenizer, self.retriever = load_shard(shard_folder, scoring)

    def stats(self) -> dict:
        return {
            "docs": len(self.ids),
            "index_bytes": int(sum(self.retriever.scores[k].nbytes for k in ("data", "indices", "indptr"))),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    def search(self, queries: list[str], k: int, threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores, corpus rows, doc ids as bytes), each (queries, min(k, docs)); a document
        with score 0 (no query term in common) is padding: row -1, id b""."""
        k = min(k, len(self.ids))
        # update_vocab=False: a query word this shard lacks matches nothing here; an
        # all-unknown query becomes bm25s's empty token, which scores every document 0.
        tokens = list(self.tokenizer.streaming_tokenize(queries, update_vocab=False))
        n_threads = (threads or os.cpu_count() or 1) if threads != 1 else 0  # bm25s: 0 = sequential
        rows, scores = self.retriever.retrieve(
            tokens, k=k, n_threads=n_threads, show_progress=False, backend_selection="numpy"
        )
        rows = np.where(scores > 0, rows.astype(np.int64) + self.ids.first_row, -1)
        return scores.astype(np.float32), rows, self.ids.id_bytes(rows)

    def holds(self, doc_ids: np.ndarray) -> np.ndarray:
        return self.ids.holds(doc_ids)


class ShardedBm25(ShardFanout):
    """The driver's handle on a BM25 index over a staged corpus (``text``: the manifest of
    :func:`stage_text`, in run storage every node reads), one :class:`Bm25Shard` actor per
    ``docs_per_shard`` documents, scored with global statistics, so the merged top-k equals
    one index over the corpus. The driver holds no document id or text: results arrive per
    query block as ids, or are used in tasks."""

    label = "bm25"

    def __init__(self, text: dict, scoring: dict, docs_per_shard: int = 1_000_000):
        started = time.perf_counter()
        self.corpus_stats = text["corpus_stats"]
        self.index = stored_index(text, scoring, docs_per_shard)
        self.total = self.index["docs"]
        self.vocab_size = self.index["vocab_size"]
        self.build_seconds = 0.0 if self.index["reused"] else time.perf_counter() - started
        actor = ray.remote(Bm25Shard)
        self._serve(
            [
                functools.partial(
                    actor.options(
                        num_cpus=SHARD_CPUS, memory=serve_memory(shard), **self.limits.actor_options()
                    ).remote,
                    load,
                    scoring,
                    shard["folder"],
                )
                for load, shard in zip(IndexPlan.of(text, docs_per_shard).loads, self.index["shards"])
            ]
        )
        self.shards = ray.get([a.stats.remote() for a in self.actors])
        self.seconds = time.perf_counter() - started

    @property
    def nbytes(self) -> int:
        return sum(s["index_bytes"] for s in self.shards)


def build_index(
    text: dict,
    *,
    k1: float = 0.9,
    b: float = 0.4,
    method: str = "lucene",
    lowercase: bool = True,
    stopwords: str = "en",
    stemmer: str = "",
    docs_per_shard: int = 1_000_000,
) -> ShardedBm25:
    """BM25 on Ray actors over a staged corpus (``text``: the manifest of :func:`stage_text`).
    Close it (or use ``with``)."""
    scoring = {"k1": k1, "b": b, "method": method, "lowercase": lowercase, "stopwords": stopwords, "stemmer": stemmer}
    stemmer_of(stemmer)  # a missing PyStemmer fails here, not in every actor
    return ShardedBm25(text, scoring, docs_per_shard)


def search(
    index: ShardedBm25,
    queries: Mapping[str, str],
    depth: int,
    *,
    batch_size: int | None = None,
    threads: int = 1,
    only: Sequence[int] | None = None,
) -> Iterator[tuple[str, list[str], list[float]]]:
    """(query id, doc ids best first, scores) of the top ``depth`` of every query, in
    ``queries`` order; documents with score 0 (no query term in common) are left out.
    ``only``: the blocks of ``batch_size`` queries to search (a resumed run's missing ones).
    The texts of a block are read as it is asked (:class:`Queries` holds them compactly)."""
    queries = Queries.of(queries)
    k = min(depth, index.total)
    asked = index.search_blocks(queries.text_rows, k, block=batch_size, only=only, threads=threads)
    for start, scores, _, ids in asked:
        for qid, row_scores, row_ids in zip(queries.ids(start, start + len(scores)), scores, ids):
            ranked = ranked_ids(row_ids)
            yield qid, ranked, row_scores[: len(ranked)].astype(float).tolist()


def bm25_run(
    index: ShardedBm25, queries: dict[str, str], depth: int = 100, *, batch_size: int | None = None, threads: int = 1
) -> dict[str, dict[str, float]]:
    """{query id: {doc id: BM25 score}}, the run format ``ir_measures.calc_aggregate`` takes
    (for a bounded set of queries: dev sets, tests)."""
    return {
        qid: dict(zip(ids, scores))
        for qid, ids, scores in search(index, queries, depth, batch_size=batch_size, threads=threads)
    }
