"""BM25 with ``bm25s`` on Ray: a sharded sparse retriever whose merged top-k is exactly one
index's over the whole corpus.

The corpus (title + text, as :func:`pipeline.data.corpus.iter_documents` joins them) is
staged as text shards in the run's storage (:func:`pipeline.data.text_shards.stage_text`:
once per run, shared with preparation and the passage servers); one :class:`Bm25Shard`
actor per load of consecutive shards tokenizes it and reports its terms' document
frequencies, a Ray task sums them, and each actor builds its bm25s index with the corpus's
document count, mean length and document frequencies. A shard's scores are then those of
one index over the whole corpus, and the merge of every shard's top-k
(:mod:`pipeline.retrieval.fanout`) is the exact global top-k.

Memory: the driver holds no document id, text or posting: the shard actors do, each
reserving an estimate of its peak from Ray. Results arrive a block of queries at a time, as
ids. The round-1 negatives job on top of it: :mod:`pipeline.retrieval.bm25_negatives`.
"""

from __future__ import annotations

import functools
import os
import resource
import time
from collections.abc import Mapping, Sequence
from typing import Iterator

import bm25s
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from pipeline.core.progress import get_counted
from pipeline.data.beir import Queries
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.text_shards import group_shards, read_text_load
from pipeline.retrieval.fanout import ShardFanout, ranked_ids

SHARD_CPUS = 0.01  # a token share, as searchers take (see pipeline.retrieval.search.plan_searchers)
PROCESS_BYTES = 512 * 2**20
# A shard actor's memory per UTF-8 byte of its texts, while it tokenizes and builds (token id
# lists, bm25s's build arrays); measured on the Nave corpus (docs/retrieval.md), with margin.
BYTES_PER_TEXT_BYTE = 12


class _CorpusStatsBM25(bm25s.BM25):
    """bm25s scoring one shard of a corpus with the whole corpus's statistics (document count,
    mean length, each term's document frequency), so a shard's scores are those of one index
    over the whole corpus and the merged top-k is exact. bm25s invites overriding this one
    method; the scoring functions are its own."""

    def __init__(self, corpus_df: np.ndarray, corpus_docs: int, corpus_avgdl: float, **kwargs):
        super().__init__(**kwargs)
        self.corpus_df, self.corpus_docs, self.corpus_avgdl = corpus_df, corpus_docs, corpus_avgdl

    def build_index_from_ids(self, unique_token_ids, corpus_token_ids, show_progress=True, leave_progress=False):
        from bm25s import scoring

        shard_df = scoring._calculate_doc_freqs(corpus_token_ids, unique_token_ids, show_progress=False)
        corpus_df = {t: int(self.corpus_df[t]) for t in shard_df}
        idf_fn = scoring._select_idf_scorer(self.idf_method)
        self.nonoccurrence_array = None
        if self.method in self.methods_requiring_nonoccurrence:
            self.nonoccurrence_array = scoring._build_nonoccurrence_array(
                doc_frequencies=corpus_df,
                n_docs=self.corpus_docs,
                compute_idf_fn=idf_fn,
                calculate_tfc_fn=scoring._select_tfc_scorer(self.method),
                l_d=self.corpus_avgdl,
                l_avg=self.corpus_avgdl,
                k1=self.k1,
                b=self.b,
                delta=self.delta,
                dtype=self.dtype,
            )
        idf = scoring._build_idf_array(corpus_df, n_docs=self.corpus_docs, compute_idf_fn=idf_fn, dtype=self.dtype)
        values, doc_rows, term_cols = scoring._build_scores_and_indices_for_matrix(
            corpus_token_ids=corpus_token_ids,
            idf_array=idf,
            avg_doc_len=self.corpus_avgdl,
            doc_frequencies=shard_df,  # sizes the arrays: this shard's postings
            k1=self.k1,
            b=self.b,
            delta=self.delta,
            nonoccurrence_array=self.nonoccurrence_array,
            method=self.method,
            dtype=self.dtype,
            int_dtype=self.int_dtype,
            show_progress=False,
        )
        data, indices, indptr = self._np_csc(
            data=values, rows=doc_rows, cols=term_cols, shape=(len(corpus_token_ids), len(shard_df))
        )
        return {
            "data": data.astype(self.dtype),
            "indices": indices,
            "indptr": indptr,
            "num_docs": len(corpus_token_ids),
        }


def _tokenizer(scoring: dict) -> bm25s.tokenization.Tokenizer:
    stopwords = scoring["stopwords"]
    return bm25s.tokenization.Tokenizer(
        lower=scoring["lowercase"],
        stopwords=None if stopwords.lower() in ("", "none") else stopwords,
        stemmer=_stemmer(scoring["stemmer"]),
    )


def _tokenized(load: list[dict], scoring: dict) -> tuple[CorpusIds, bm25s.tokenization.Tokenizer, list]:
    """A load's doc ids (first row set), its tokenizer and its documents' token ids."""
    table = read_text_load(load)
    ids = CorpusIds(table.column("doc_id").cast("binary").to_numpy(zero_copy_only=False).astype(bytes))
    ids.first_row = load[0]["first_row"]
    tokenizer = _tokenizer(scoring)
    return ids, tokenizer, list(tokenizer.streaming_tokenize(table.column("text").to_pylist()))


def _terms(tokenizer) -> np.ndarray:
    """A tokenizer's vocabulary by token id (bm25s numbers its tokens from 0)."""
    vocab = tokenizer.get_vocab_dict()
    terms = np.empty(len(vocab), dtype=object)
    terms[np.fromiter(vocab.values(), np.int64, len(vocab))] = list(vocab)
    return terms


def _load_term_stats(load: list[dict], scoring: dict) -> tuple[pa.Table, tuple[int, int]]:
    """A Ray task: (term, df) of one load, and (its documents, its tokens: bm25s's document
    lengths), the first pass over the corpus, whose sums every shard scores with."""
    _, tokenizer, token_ids = _tokenized(load, scoring)
    terms = _terms(tokenizer)
    present = np.concatenate([np.unique(np.asarray(t, np.int64)) for t in token_ids])
    df = np.bincount(present, minlength=len(terms))
    tokens = int(sum(len(t) for t in token_ids))
    return pa.table({"term": pa.array(terms, pa.string()), "df": df}), (len(token_ids), tokens)


class Bm25Shard:
    """A Ray actor: one load's BM25 index, built with the whole corpus's statistics, answering
    top-k for blocks of query texts as corpus rows and doc ids. Everything it serves comes
    from its arguments (the staged text, the corpus statistics), so Ray can restart it, on
    another node when its own is lost, and it builds the same index again."""

    def __init__(self, load: list[dict], scoring: dict, corpus_terms: pa.Table, corpus_docs: int, corpus_avgdl: float):
        self.ids, self.tokenizer, token_ids = _tokenized(load, scoring)
        terms = _terms(self.tokenizer)
        at = pc.index_in(pa.array(terms, pa.string()), value_set=corpus_terms.column("term")).to_numpy()
        corpus_df = corpus_terms.column("df").to_numpy()[at.astype(np.int64)]
        self.retriever = _CorpusStatsBM25(
            corpus_df, corpus_docs, corpus_avgdl, k1=scoring["k1"], b=scoring["b"], method=scoring["method"]
        )
        self.retriever.index(self.tokenizer.to_tokenized_tuple(token_ids), show_progress=False)

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


def _merge_term_stats(*shards: pa.Table) -> tuple[pa.Table, int]:
    """A Ray task: the corpus's document frequency of every term (the sum over shards), and
    the vocabulary's size, so neither the driver nor any one shard actor holds every shard's
    vocabulary at once."""
    merged = pa.concat_tables(shards).group_by("term").aggregate([("df", "sum")])
    return merged.rename_columns(["term", "df"]), merged.num_rows


class ShardedBm25(ShardFanout):
    """The driver's handle on a BM25 index over a staged corpus (``text``: the manifest of
    :func:`stage_text`, in run storage every node reads), one :class:`Bm25Shard` actor per
    ``docs_per_shard`` documents, scored with global statistics, so the merged top-k equals
    one index over the corpus. The driver holds no document id or text: results arrive per
    query block as ids."""

    label = "bm25"

    def __init__(self, text: dict, scoring: dict, docs_per_shard: int = 1_000_000):
        started = time.perf_counter()
        self.corpus_stats = text["corpus_stats"]
        loads = group_shards(text["shards"], docs_per_shard)
        memory = [PROCESS_BYTES + BYTES_PER_TEXT_BYTE * sum(i["text_bytes"] for i in load) for load in loads]
        # Two passes over the text: tasks count each load's terms, a task sums them (the
        # driver gets only the counts, as loads finish tokenizing), then each shard actor
        # tokenizes its load again and builds with the sums. The second tokenization buys an
        # actor that rebuilds itself from its arguments when Ray restarts it.
        count = ray.remote(_load_term_stats)
        tables, counts = zip(
            *[
                count.options(num_cpus=SHARD_CPUS, memory=m, num_returns=2, max_retries=3).remote(load, scoring)
                for load, m in zip(loads, memory)
            ]
        )
        counts = get_counted(list(counts), "bm25 index", "documents", [sum(i["rows"] for i in load) for load in loads])
        self.total = sum(docs for docs, _ in counts)
        avgdl = sum(tokens for _, tokens in counts) / self.total
        corpus_terms, vocab_size = ray.remote(_merge_term_stats).options(num_returns=2).remote(*tables)
        actor = ray.remote(Bm25Shard)
        self._serve(
            [
                functools.partial(
                    actor.options(num_cpus=SHARD_CPUS, memory=m, **self.limits.actor_options()).remote,
                    load,
                    scoring,
                    corpus_terms,
                    self.total,
                    avgdl,
                )
                for load, m in zip(loads, memory)
            ]
        )
        self.shards = ray.get([a.stats.remote() for a in self.actors])
        self.vocab_size = ray.get(vocab_size)
        self.seconds = time.perf_counter() - started

    @property
    def nbytes(self) -> int:
        return sum(s["index_bytes"] for s in self.shards)


def _stemmer(name: str):
    if not name:
        return None
    try:
        import Stemmer
    except ImportError as exc:
        raise ImportError(f"stemmer {name!r} needs PyStemmer: pip install PyStemmer") from exc
    return Stemmer.Stemmer(name)


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
    _stemmer(stemmer)  # a missing PyStemmer fails here, not in every actor
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
