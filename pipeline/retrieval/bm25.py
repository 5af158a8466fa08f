"""BM25 with ``bm25s`` on Ray: the round-1 hard negatives of retriever fine-tuning, and a
BM25 run to evaluate with ``ir_measures``.

Index: the corpus (title + text, as :func:`pipeline.data.corpus.iter_documents` joins them)
is staged as text shards in the run's storage (:func:`pipeline.data.text_shards.stage_text`:
once per run, shared with preparation and the passage servers); one :class:`Bm25Shard`
actor per load of consecutive shards tokenizes it and reports its terms' document frequencies, a Ray task sums them, and each
actor builds its bm25s index with the corpus's document count, mean length and document
frequencies. A shard's scores are then those of one index over the whole corpus, and the
merge of every shard's top-k (:mod:`pipeline.retrieval.fanout`) is the exact
global top-k.

Negatives: retrieve the top ``depth`` documents of every query, drop every judged positive
(qrels score > 0) by id and every document with a zero score (not retrieved at all, only
padding when a query matches fewer than ``depth`` documents), then keep ``count``: the best
ranked (``sample="top"``) or a random ``count`` of them (``sample="random"``, seeded per query
by ``seed`` and the query id, so a query's sample does not depend on the others; kept in
rank order). Judged non-relevant documents (score <= 0) stay: they are negatives by judgment.

Memory: the driver streams the corpus once into the text shards (a row group at a time, and
not at all when the run staged it already) and then holds no document id, text or posting: the shard actors do, each reserving an estimate
of its peak from Ray. Results arrive a block of queries at a time, as ids, and are written
out before the next block is asked for.
"""

from __future__ import annotations

import functools
import itertools
import os
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Iterator, Literal

import bm25s
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from pipeline.core import storage
from pipeline.core.errors import StorageError
from pipeline.core.parts import BlockFiles, claim, finished_blocks, join_blocks, recorded_block, summed
from pipeline.core.progress import get_counted
from pipeline.core.runtime import RayConfig
from pipeline.data.beir import Queries, positives, read_qrels, read_queries
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.examples import build_training_examples
from pipeline.data.groups import select_negatives
from pipeline.data.records import write_json_line
from pipeline.data.runs import negatives_record, read_negatives, write_trec_lines
from pipeline.data.tevatron import passage_lookup, write_tevatron
from pipeline.data.text_shards import group_shards, read_text_load, stage_text
from pipeline.retrieval.fanout import ShardFanout, query_block, ranked_ids, read_qrels_of_corpus


@dataclass
class Bm25Config:
    corpus: str = field(
        metadata={"help": "BEIR corpus.jsonl (file or folder, local or s3://); indexed as title + text"}
    )
    queries: str = field(metadata={"help": "BEIR queries.jsonl to mine negatives for"})
    qrels: str = field(metadata={"help": "BEIR qrels TSV: judged positives (score > 0) are never negatives"})
    text: str = field(
        default="",
        metadata={
            "help": "folder of the corpus's staged text shards (a run's, shared with its other readers); empty = <output without .jsonl[.gz]>.text-shards, kept for reruns"
        },
    )
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
    skip_top: int = field(
        default=0, metadata={"help": "ignore the best-ranked N candidates (likely unjudged positives)"}
    )
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
    threads: int = field(
        default=0, metadata={"help": "retrieval threads of each shard actor; 0 = all cores of its node"}
    )
    batch_size: int = field(
        default=0, metadata={"help": "queries per block sent to the shard actors; 0 = 4,096 over the number of shards"}
    )
    docs_per_shard: int = field(default=1_000_000, metadata={"help": "documents per BM25 shard (one Ray actor each)"})
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


def _retrieve_block(cfg: Bm25Config, folder: str, block: int, hits, qrels: dict) -> None:
    """One block's run lines, negatives and counts, as one object."""
    counts = dict.fromkeys(COUNTS, 0)
    files = BlockFiles(OUTPUTS)
    for qid, ids, scores in hits:
        write_trec_lines(files["run.trec"], qid, ids, scores, tag="bm25")
        judged = set(positives(qrels.get(qid, {})))
        negs, neg_scores = select_negatives(qid, ids, scores, judged, cfg)
        counts["negatives"] += len(negs)
        counts["positives_dropped"] += sum(d in judged for d in ids)
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
        "corpus": index.corpus_stats,
    }


def mine_negatives(cfg: Bm25Config) -> dict:
    """Write the negatives jsonl (and the run); returns the job summary.

    Query blocks go to part files beside the output first (:mod:`pipeline.core.parts`): a
    run stopped mid-way and rerun builds the index again but retrieves only the blocks it
    lacks (none: not even the index), unless a setting or an input changed."""
    start = time.perf_counter()
    for uri in (cfg.corpus, cfg.queries, cfg.qrels):  # fail before spending minutes on the index
        if not storage.exists(uri):
            raise StorageError(f"{uri}: no such file or directory")
    queries = read_queries(cfg.queries)
    folder = _parts_folder(cfg)
    claim(folder, _made_by(cfg), what="retrieved blocks' files")
    text = stage_text(cfg.corpus, _text_folder(cfg), cfg.docs_per_shard)
    block = recorded_block(
        folder, cfg.batch_size or query_block(len(group_shards(text["shards"], cfg.docs_per_shard)), cfg.depth)
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
            hits = search(index, queries, cfg.depth, batch_size=block, threads=cfg.threads, only=todo)
            for b in todo:
                size = min(block, len(queries) - b * block)
                _retrieve_block(cfg, folder, b, itertools.islice(hits, size), qrels)
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
