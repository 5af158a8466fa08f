"""BM25 with ``bm25s``: the round-1 hard negatives of retriever fine-tuning, and a BM25 run to
evaluate with ``ir_measures``.

Negatives: index the corpus (title + text, as :func:`pipeline.corpus.iter_documents` joins them),
retrieve the top ``depth`` documents of every query, drop every judged positive (qrels score > 0)
by id and every document with a zero score (not retrieved at all, only padding when a query
matches fewer than ``depth`` documents), then keep ``count``: the best ranked (``sample="top"``)
or a random ``count`` of them (``sample="random"``, seeded per query by ``seed`` and the query
id, so a query's sample does not depend on the others; kept in rank order). Judged non-relevant
documents (score <= 0) stay: they are negatives by judgment.

Memory: the driver holds bm25s's index (a sparse doc x term score matrix, ``index_bytes`` in the
summary) and the vocabulary. Tokenization streams over the corpus: each document's text is
dropped once its token ids are taken, and the token id lists are dropped once bm25s has built
the matrix. Retrieval runs in batches of queries, written out as it goes.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Literal

import bm25s
import numpy as np

from pipeline.core import storage
from pipeline.core.errors import InputError, StorageError
from pipeline.data.beir import positives, read_qrels, read_queries
from pipeline.data.corpus import CorpusStats, iter_documents
from pipeline.data.examples import build_training_examples
from pipeline.data.runs import read_negatives, write_negatives
from pipeline.data.tevatron import passage_lookup, write_tevatron

if TYPE_CHECKING:
    import bm25s


@dataclass
class Bm25Config:
    corpus: str = field(
        metadata={"help": "BEIR corpus.jsonl (file or folder, local or s3://); indexed as title + text"}
    )
    queries: str = field(metadata={"help": "BEIR queries.jsonl to mine negatives for"})
    qrels: str = field(metadata={"help": "BEIR qrels TSV: judged positives (score > 0) are never negatives"})
    output: str = field(
        default="runs/bm25/negatives.jsonl",
        metadata={
            "help": "negatives jsonl to write (local or s3://; .gz = gzip): {query_id, negatives, scores} per query"
        },
    )
    run: str = field(
        default="",
        metadata={
            "help": "TREC run of the top-depth BM25 results (for ir_measures); empty = <output without .jsonl[.gz]>.run.trec; 'none' = not written"
        },
    )
    depth: int = field(default=200, metadata={"help": "BM25 results retrieved per query"})
    count: int = field(default=30, metadata={"help": "negatives kept per query"})
    sample: Literal["top", "random"] = field(
        default="top",
        metadata={
            "help": "top = the best-ranked count; random = count drawn from the depth (seeded per query), kept in rank order"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of sample=random"})
    k1: float = field(default=0.9, metadata={"help": "BM25 k1"})
    b: float = field(default=0.4, metadata={"help": "BM25 b"})
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
    threads: int = field(default=0, metadata={"help": "retrieval threads; 0 = all cores"})
    batch_size: int = field(default=1024, metadata={"help": "queries retrieved per batch"})
    write_scores: bool = field(default=True, metadata={"help": "also write each negative's BM25 score"})
    tevatron: str = field(
        default="",
        metadata={
            "help": "also write the training file in Tevatron format (query, positive and negative passages with their text) here; empty = not written"
        },
    )

    def __post_init__(self):
        for name in ("depth", "count", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.count > self.depth:
            raise ValueError(f"count ({self.count}) must not exceed depth ({self.depth})")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")

    def run_uri(self) -> str | None:
        if self.run.lower() == "none":
            return None
        if self.run:
            return self.run
        base = self.output.removesuffix(".gz").removesuffix(".jsonl")
        return base + ".run.trec"


@dataclass
class Bm25Index:
    retriever: bm25s.BM25
    tokenizer: bm25s.tokenization.Tokenizer
    doc_ids: np.ndarray  # matrix row -> document id
    corpus_stats: CorpusStats
    seconds: float

    @property
    def nbytes(self) -> int:
        return sum(self.retriever.scores[k].nbytes for k in ("data", "indices", "indptr"))


def _stemmer(name: str):
    if not name:
        return None
    try:
        import Stemmer
    except ImportError as exc:
        raise ImportError(f"stemmer {name!r} needs PyStemmer: pip install PyStemmer") from exc
    return Stemmer.Stemmer(name)


def build_index(
    corpus: str,
    *,
    k1: float = 0.9,
    b: float = 0.4,
    method: str = "lucene",
    lowercase: bool = True,
    stopwords: str = "en",
    stemmer: str = "",
) -> Bm25Index:
    """Index a corpus with bm25s, tokenizing the documents as they stream past."""

    start = time.perf_counter()
    tokenizer = bm25s.tokenization.Tokenizer(
        lower=lowercase, stopwords=None if stopwords.lower() in ("", "none") else stopwords, stemmer=_stemmer(stemmer)
    )
    stats = CorpusStats()
    doc_ids: list[str] = []

    def texts() -> Iterator[str]:
        for doc in iter_documents(corpus, stats=stats):
            doc_ids.append(doc.doc_id)
            yield doc.text

    token_ids = list(tokenizer.streaming_tokenize(texts()))
    if not token_ids:
        raise InputError(f"{corpus}: no documents to index", source=corpus)
    retriever = bm25s.BM25(k1=k1, b=b, method=method)
    retriever.index(tokenizer.to_tokenized_tuple(token_ids), show_progress=False)
    return Bm25Index(retriever, tokenizer, np.array(doc_ids, dtype=object), stats, time.perf_counter() - start)


def search(
    index: Bm25Index, queries: dict[str, str], depth: int, *, batch_size: int = 1024, threads: int = 0
) -> Iterator[tuple[str, list[str], list[float]]]:
    """(query id, doc ids best first, scores) of the top ``depth`` of every query, in
    ``queries`` order; documents with score 0 (no query term in common) are left out."""
    k = min(depth, len(index.doc_ids))
    n_threads = (threads or os.cpu_count() or 1) if threads != 1 else 0  # bm25s: 0 = sequential
    qids = list(queries)
    for start in range(0, len(qids), batch_size):
        batch = qids[start : start + batch_size]
        # update_vocab=False: a query word the corpus lacks matches nothing; an all-unknown
        # query becomes bm25s's empty token, which scores every document 0.
        tokens = list(index.tokenizer.streaming_tokenize([queries[q] for q in batch], update_vocab=False))
        rows, scores = index.retriever.retrieve(
            tokens, k=k, n_threads=n_threads, show_progress=False, backend_selection="numpy"
        )
        for qid, r, s in zip(batch, rows, scores):
            hit = s > 0
            yield qid, index.doc_ids[r[hit]].tolist(), s[hit].astype(float).tolist()


def bm25_run(
    index: Bm25Index, queries: dict[str, str], depth: int = 100, *, batch_size: int = 1024, threads: int = 0
) -> dict[str, dict[str, float]]:
    """{query id: {doc id: BM25 score}}, the run format ``ir_measures.calc_aggregate`` takes."""
    return {
        qid: dict(zip(ids, scores))
        for qid, ids, scores in search(index, queries, depth, batch_size=batch_size, threads=threads)
    }


def _select(
    qid: str, ids: list[str], scores: list[float], judged_positive: set[str], cfg: Bm25Config
) -> tuple[list[str], list[float], int]:
    """The kept negatives (ranked) and their scores, and how many judged positives were dropped."""
    cand = [i for i, d in enumerate(ids) if d not in judged_positive]
    dropped = len(ids) - len(cand)
    if cfg.sample == "random" and len(cand) > cfg.count:
        cand = [cand[j] for j in sorted(random.Random(f"{cfg.seed}:{qid}").sample(range(len(cand)), cfg.count))]
    cand = cand[: cfg.count]
    return [ids[i] for i in cand], [scores[i] for i in cand], dropped


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


def mine_negatives(cfg: Bm25Config) -> dict:
    """Write the negatives jsonl (and the run); returns the job summary."""
    start = time.perf_counter()
    for uri in (cfg.corpus, cfg.queries, cfg.qrels):  # fail before spending minutes on the index
        if not storage.exists(uri):
            raise StorageError(f"{uri}: no such file or directory")
    queries = read_queries(cfg.queries)
    index = build_index(
        cfg.corpus,
        k1=cfg.k1,
        b=cfg.b,
        method=cfg.method,
        lowercase=cfg.lowercase,
        stopwords=cfg.stopwords,
        stemmer=cfg.stemmer,
    )
    qrels = read_qrels(cfg.qrels, doc_ids=set(index.doc_ids), query_ids=set(queries))
    counts = {"negatives": 0, "positives_dropped": 0, "short": 0, "none": 0}
    run_uri = cfg.run_uri()
    retrieve_start = time.perf_counter()

    def rows(run_out) -> Iterator[tuple[str, list[str], list[float] | None]]:
        for qid, ids, scores in search(index, queries, cfg.depth, batch_size=cfg.batch_size, threads=cfg.threads):
            if run_out is not None:  # TREC run: qid Q0 docid rank score tag
                run_out.write(
                    "".join(f"{qid} Q0 {d} {r} {s:.4f} bm25\n" for r, (d, s) in enumerate(zip(ids, scores), 1)).encode(
                        "utf-8"
                    )
                )
            negs, neg_scores, dropped = _select(qid, ids, scores, set(positives(qrels.get(qid, {}))), cfg)
            counts["negatives"] += len(negs)
            counts["positives_dropped"] += dropped
            counts["short"] += len(negs) < cfg.count
            counts["none"] += not negs
            yield qid, negs, neg_scores if cfg.write_scores else None

    if run_uri is None:
        write_negatives(rows(None), cfg.output)
    else:
        with storage.open_output(run_uri) as run_out:
            write_negatives(rows(run_out), cfg.output)
    n = len(queries)
    tevatron = _write_tevatron(cfg, queries, qrels) if cfg.tevatron else None
    return {
        "job": "bm25_negatives",
        "output": cfg.output,
        "run": run_uri,
        "tevatron": tevatron,
        "queries": n,
        "docs": len(index.doc_ids),
        "queries_without_positive": sum(1 for q in queries if not positives(qrels.get(q, {}))),
        "negatives_per_query": round(counts["negatives"] / max(n, 1), 3),
        "queries_short": counts["short"],
        "queries_no_negatives": counts["none"],
        "positives_dropped": counts["positives_dropped"],
        "vocab_size": len(index.retriever.vocab_dict),
        "index_bytes": index.nbytes,
        "index_seconds": round(index.seconds, 2),
        "retrieve_seconds": round(time.perf_counter() - retrieve_start, 2),
        "seconds": round(time.perf_counter() - start, 2),
        "corpus": index.corpus_stats.as_dict(),
    }
