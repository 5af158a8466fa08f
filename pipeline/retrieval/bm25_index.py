"""A BM25 index built once per staged corpus and tokenizer, stored beside the staging, and
reused by every stage and rerun that asks for the same one.

The build has two passes over the staged text (:mod:`pipeline.data.text_shards`), each a
Ray task per load of consecutive shards with its memory reserved:

1. **Term statistics.** A task tokenizes its load and returns its documents, its tokens
   and each term's document frequency, cut into ``partitions`` tables by a hash of the
   term. Each partition's tables are summed in a tree of tasks (``FAN_IN`` tables a task,
   each reserving what its inputs take), level by level, and the sums are stored. No task
   and no process ever holds the whole vocabulary: a partition's share of it at most.
2. **Shards.** A task per load tokenizes it again, looks up its terms' corpus-wide
   frequencies one partition at a time, builds the load's bm25s index with the corpus's
   document count and mean length (so a shard's scores are those of one index over the
   whole corpus, and the merged top-k is exact), and stores its arrays and vocabulary.

Each step commits what it made (the statistics, then each shard, then the manifest), so a
build interrupted mid-way redoes only what it had not stored. The index's folder is named
by what made it (the staging's source and version, the loads' cut, the scoring and bm25s's
version), and the staging's folder holds it, so a corpus staged anew takes its index with
it. The serving side: :mod:`pipeline.retrieval.bm25`.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import resource
import zlib
from dataclasses import dataclass

import bm25s
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from pipeline.core import storage
from pipeline.core.parts import claim
from pipeline.core.progress import get_counted
from pipeline.data.text_shards import group_shards, read_text_load

FORMAT = "raydense-bm25-v1"
PROCESS_BYTES = 512 * 2**20  # a Ray worker with bm25s, numpy and pyarrow imported
# A build task's memory per UTF-8 byte of its load's texts (token id lists, bm25s's build
# arrays); measured on the Nave corpus (docs/retrieval/bm25.md).
BYTES_PER_TEXT_BYTE = 12
# Of the staged text, what one partition of the term statistics covers: a partition's terms
# are what a task merges and a build task looks up at once (about 40 MB of terms at MS
# MARCO's 3 GB of text, in 2 partitions; 100 partitions at 500M passages).
TEXT_BYTES_PER_PARTITION = 2 * 2**30
FAN_IN = 8  # term tables summed by one task of the tree
MERGE_BYTES_PER_INPUT_BYTE = 4  # Arrow's hash aggregation over its inputs, with margin
VOCAB_ENTRY_BYTES = 200  # a vocabulary entry in a Python dict: key, value, slot
ID_BYTES = 64  # a document id as a shard holds it
TASK_OPTIONS = {"num_cpus": 1, "max_retries": 3}  # every build task's; each reserves its own memory
# A task reserving more than this runs in a worker process of its own (max_calls=1): a reused
# worker kept what earlier tasks' Python heaps left, and peaked at 1.5x its reservation at 1M
# passages (bench/bench_bm25_scale.py). Small tasks share workers: a process start each
# would cost more than their work.
OWN_PROCESS_BYTES = PROCESS_BYTES + 256 * 2**20


def _task(fn, memory: int, returns: int = 1):
    """``fn`` as a Ray task reserving ``memory``, in a fresh worker process when that is large."""
    remote = ray.remote(max_calls=1)(fn) if memory > OWN_PROCESS_BYTES else ray.remote(fn)
    return remote.options(**TASK_OPTIONS, memory=memory, num_returns=returns)


@dataclass(frozen=True)
class IndexPlan:
    """What a build of ``loads`` (lists of staged shard items) reserves: one build task and
    then one server per load, the statistics cut into ``partitions``."""

    loads: list[list[dict]]
    partitions: int

    @classmethod
    def of(cls, text: dict, docs_per_shard: int) -> IndexPlan:
        text_bytes = sum(item["text_bytes"] for item in text["shards"])
        return cls(group_shards(text["shards"], docs_per_shard), max(1, -(-text_bytes // TEXT_BYTES_PER_PARTITION)))

    def count_memory(self, load: list[dict]) -> int:
        """Pass 1's task: the load tokenized, its term counts."""
        return PROCESS_BYTES + BYTES_PER_TEXT_BYTE * sum(item["text_bytes"] for item in load)

    def build_memory(self, load: list[dict], largest_partition_bytes: int) -> int:
        """Pass 2's task: the load tokenized and built, and one partition of terms looked up."""
        return self.count_memory(load) + MERGE_BYTES_PER_INPUT_BYTE * largest_partition_bytes


def merge_memory(input_bytes: int) -> int:
    """A tree task's reservation: its inputs and Arrow's aggregation over them."""
    return PROCESS_BYTES + MERGE_BYTES_PER_INPUT_BYTE * input_bytes


def serve_memory(shard: dict) -> int:
    """What a server of a stored shard holds: its arrays (read, then copied once), its
    vocabulary and its documents' ids."""
    return (
        PROCESS_BYTES + 2 * shard["index_bytes"] + VOCAB_ENTRY_BYTES * shard["vocab_entries"] + ID_BYTES * shard["docs"]
    )


def tokenizer_of(scoring: dict) -> bm25s.tokenization.Tokenizer:
    stopwords = scoring["stopwords"]
    return bm25s.tokenization.Tokenizer(
        lower=scoring["lowercase"],
        stopwords=None if stopwords.lower() in ("", "none") else stopwords,
        stemmer=stemmer_of(scoring["stemmer"]),
    )


def stemmer_of(name: str):
    if not name:
        return None
    try:
        import Stemmer
    except ImportError as exc:
        raise ImportError(f"stemmer {name!r} needs PyStemmer: pip install PyStemmer") from exc
    return Stemmer.Stemmer(name)


def _tokenized(load: list[dict], scoring: dict) -> tuple[bm25s.tokenization.Tokenizer, list]:
    texts = read_text_load(load).column("text").to_pylist()
    tokenizer = tokenizer_of(scoring)
    return tokenizer, list(tokenizer.streaming_tokenize(texts))


def _terms(tokenizer) -> np.ndarray:
    """A tokenizer's vocabulary by token id (bm25s numbers its tokens from 0)."""
    vocab = tokenizer.get_vocab_dict()
    terms = np.empty(len(vocab), dtype=object)
    terms[np.fromiter(vocab.values(), np.int64, len(vocab))] = list(vocab)
    return terms


def partition_of(terms: np.ndarray, partitions: int) -> np.ndarray:
    """Each term's partition: a hash every process computes alike (Python's own is salted)."""
    return np.fromiter((zlib.crc32(t.encode()) % partitions for t in terms), np.int64, len(terms))


def _count_terms(load: list[dict], scoring: dict, partitions: int) -> tuple:
    """Pass 1's task: ``{docs, tokens, bytes}`` (``bytes``: each partition table's), then the
    load's (term, df) tables, one a partition."""
    tokenizer, token_ids = _tokenized(load, scoring)
    terms = _terms(tokenizer)
    present = np.concatenate([np.unique(np.asarray(t, np.int64)) for t in token_ids])
    df = np.bincount(present, minlength=len(terms))
    part = partition_of(terms, partitions)
    tables = [
        pa.table({"term": pa.array(terms[part == p], pa.string()), "df": df[part == p]}) for p in range(partitions)
    ]
    counts = {
        "docs": len(token_ids),
        "tokens": int(sum(len(t) for t in token_ids)),
        "bytes": [t.nbytes for t in tables],
    }
    return (counts, *tables)


def _sum_terms(*tables: pa.Table) -> tuple[pa.Table, int]:
    """A tree task: the (term, df) sum of its tables, and its bytes (the next level's reservation)."""
    merged = pa.concat_tables(tables).group_by("term").aggregate([("df", "sum")]).rename_columns(["term", "df"])
    return merged, merged.nbytes


def _store_terms(table: pa.Table, uri: str) -> int:
    storage.write_bytes(uri, _parquet_bytes(table))
    return table.num_rows


def _parquet_bytes(table: pa.Table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def summed_terms(leaves: list[list], sizes: list[list[int]]) -> tuple[list, list[int]]:
    """Each partition's tables (``leaves[p]``, of ``sizes[p]`` bytes) summed in a tree of
    tasks, ``FAN_IN`` a task, every partition's level at once: (a table ref, its bytes) per
    partition. Each task reserves :func:`merge_memory` of what its inputs measured, so the
    next level is planned from the sizes this one returned."""
    level = 0
    while any(len(refs) > 1 for refs in leaves):
        level += 1
        asked = []  # (partition, table ref, bytes ref) of this level's tasks
        for p, (refs, part_sizes) in enumerate(zip(leaves, sizes)):
            if len(refs) == 1:
                continue
            for i in range(0, len(refs), FAN_IN):
                group = range(i, min(i + FAN_IN, len(refs)))
                memory = merge_memory(sum(part_sizes[j] for j in group))
                asked.append((p, *_task(_sum_terms, memory, 2).remote(*[refs[j] for j in group])))
        measured = get_counted([size for _, _, size in asked], f"bm25 terms (merge level {level})", "merges")
        for p in {p for p, _, _ in asked}:
            leaves[p], sizes[p] = [], []
        for (p, table, _), size in zip(asked, measured):
            leaves[p].append(table)
            sizes[p].append(size)
    return [refs[0] for refs in leaves], [part[0] for part in sizes]


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


ARRAYS = ("data", "indices", "indptr")  # bm25s's score matrix, CSC
VOCAB = "vocab.json"  # the tokenizer's dictionaries, as bm25s saves them
SHARD = "shard.json"  # written last: a shard present is whole


def _corpus_df(terms: np.ndarray, partitions: list[str]) -> np.ndarray:
    """The corpus-wide document frequency of each of ``terms``, read one stored partition at
    a time (a partition's terms are all a build task holds of the corpus's vocabulary)."""
    part = partition_of(terms, len(partitions))
    df = np.zeros(len(terms), np.int64)
    for p, uri in enumerate(partitions):
        mine = np.flatnonzero(part == p)
        if not len(mine):
            continue
        table = storage.read_parquet(uri)
        at = pc.index_in(pa.array(terms[mine], pa.string()), value_set=table.column("term")).to_numpy()
        df[mine] = table.column("df").to_numpy()[at.astype(np.int64)]
    return df


def _build_shard(load: list[dict], scoring: dict, partitions: list[str], docs: int, avgdl: float, folder: str) -> dict:
    """Pass 2's task: the load's index built with the corpus's statistics and stored in
    ``folder``; returns its record (also stored, last)."""
    tokenizer, token_ids = _tokenized(load, scoring)
    df = _corpus_df(_terms(tokenizer), partitions)
    retriever = _CorpusStatsBM25(df, docs, avgdl, k1=scoring["k1"], b=scoring["b"], method=scoring["method"])
    retriever.index(tokenizer.to_tokenized_tuple(token_ids), show_progress=False)
    arrays = {name: retriever.scores[name] for name in ARRAYS}
    if retriever.nonoccurrence_array is not None:
        arrays["nonoccurrence"] = retriever.nonoccurrence_array
    for name, array in arrays.items():
        storage.write_array(storage.join(folder, f"{name}.npy"), array)
    vocab = {
        "word_to_stem": tokenizer.word_to_stem,
        "stem_to_sid": tokenizer.stem_to_sid,
        "word_to_id": tokenizer.word_to_id,
    }
    storage.write_bytes(storage.join(folder, VOCAB), json.dumps(vocab, ensure_ascii=False).encode())
    record = {
        "docs": len(token_ids),
        "first_row": load[0]["first_row"],
        "arrays": sorted(arrays),
        "index_bytes": int(sum(a.nbytes for a in arrays.values())),
        "vocab_entries": sum(len(d) for d in vocab.values()),
        "build_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    storage.write_json(storage.join(folder, SHARD), record)
    return record


def load_shard(folder: str, scoring: dict) -> tuple[bm25s.tokenization.Tokenizer, bm25s.BM25]:
    """A stored shard as the tokenizer and bm25s retriever its build left (arrays read with
    ``allow_pickle=False``: nothing read from storage runs)."""
    record = storage.read_json(storage.join(folder, SHARD))
    tokenizer = tokenizer_of(scoring)
    vocab = json.loads(storage.read_bytes(storage.join(folder, VOCAB)))
    tokenizer.word_to_stem, tokenizer.stem_to_sid, tokenizer.word_to_id = (
        vocab["word_to_stem"],
        vocab["stem_to_sid"],
        vocab["word_to_id"],
    )
    arrays = {name: storage.read_array(storage.join(folder, f"{name}.npy")) for name in record["arrays"]}
    retriever = bm25s.BM25(k1=scoring["k1"], b=scoring["b"], method=scoring["method"])
    retriever.scores = {name: arrays[name] for name in ARRAYS} | {"num_docs": record["docs"]}
    retriever.nonoccurrence_array = arrays.get("nonoccurrence")
    retriever.vocab_dict = tokenizer.get_vocab_dict()  # as index() left it: "" included
    retriever.unique_token_ids_set = set(retriever.vocab_dict.values())
    return tokenizer, retriever


def index_folder(text: dict, made_by: dict) -> str:
    """Where the index ``made_by`` describes lives: in the staging's own folder, so that a
    corpus staged anew (its folder deleted) takes its indexes with it."""
    staging = posixpath.dirname(text["shards"][0]["text_uri"])
    return storage.join(staging, "bm25", hashlib.sha1(json.dumps(made_by, sort_keys=True).encode()).hexdigest()[:10])


def _stored_terms(plan: IndexPlan, scoring: dict, folder: str) -> dict:
    """Pass 1, or its stored result: ``{docs, tokens, avgdl, vocab_size, partitions (uris),
    partition_bytes}``."""
    record_uri = storage.join(folder, "terms", "terms.json")
    if storage.exists(record_uri):
        return storage.read_json(record_uri)
    refs = [
        _task(_count_terms, plan.count_memory(load), 1 + plan.partitions).remote(load, scoring, plan.partitions)
        for load in plan.loads
    ]
    counts = get_counted(
        [r[0] for r in refs], "bm25 terms", "documents", [sum(i["rows"] for i in ld) for ld in plan.loads]
    )
    roots, root_bytes = summed_terms(
        [[r[1 + p] for r in refs] for p in range(plan.partitions)],
        [[c["bytes"][p] for c in counts] for p in range(plan.partitions)],
    )
    uris = [storage.join(folder, "terms", f"terms-{p:04d}.parquet") for p in range(plan.partitions)]
    stores = [_task(_store_terms, merge_memory(b)).remote(t, u) for t, b, u in zip(roots, root_bytes, uris)]
    rows = get_counted(stores, "bm25 terms (stored)", "partitions")
    docs, tokens = sum(c["docs"] for c in counts), sum(c["tokens"] for c in counts)
    record = {
        "docs": docs,
        "tokens": tokens,
        "avgdl": tokens / docs,
        "vocab_size": int(sum(rows)),
        "partitions": uris,
        "partition_bytes": root_bytes,
    }
    storage.write_json(record_uri, record)
    return record


def _stored_shards(plan: IndexPlan, scoring: dict, terms: dict, folder: str) -> list[dict]:
    """Pass 2 for the loads whose shard is not stored yet; every shard's record, with its folder."""
    folders = [storage.join(folder, "shards", f"{i:05d}") for i in range(len(plan.loads))]
    records: dict[int, dict] = {
        i: storage.read_json(storage.join(f, SHARD))
        for i, f in enumerate(folders)
        if storage.exists(storage.join(f, SHARD))
    }
    todo = [i for i in range(len(plan.loads)) if i not in records]
    largest = max(terms["partition_bytes"])
    refs = [
        _task(_build_shard, plan.build_memory(plan.loads[i], largest)).remote(
            plan.loads[i], scoring, terms["partitions"], terms["docs"], terms["avgdl"], folders[i]
        )
        for i in todo
    ]
    sizes = [sum(item["rows"] for item in plan.loads[i]) for i in todo]
    records.update(zip(todo, get_counted(refs, "bm25 index", "documents", sizes)))
    return [{"folder": f, **records[i]} for i, f in enumerate(folders)]


def stored_index(text: dict, scoring: dict, docs_per_shard: int) -> dict:
    """The BM25 index of the staged corpus ``text`` with ``scoring``, one shard per load of
    ``docs_per_shard`` documents: the stored one when what made it matches, else built now
    (resuming a build cut short). Returns its manifest: ``folder``, ``docs``, ``avgdl``,
    ``vocab_size``, ``shards`` (each ``folder``, ``first_row``, ``docs``, ``index_bytes``,
    ``vocab_entries``, ``build_peak_rss_bytes``), and ``reused``."""
    plan = IndexPlan.of(text, docs_per_shard)
    made_by = {
        "format": FORMAT,
        "source": text["source"],
        "version": text["version"],
        "loads": [[load[0]["first_row"], sum(i["rows"] for i in load)] for load in plan.loads],
        "scoring": scoring,
        "bm25s": bm25s.__version__,
    }
    folder = index_folder(text, made_by)
    manifest_uri = storage.join(folder, "index.json")
    if storage.exists(manifest_uri):
        manifest = storage.read_json(manifest_uri)
        if manifest.get("made_by") == json.loads(json.dumps(made_by)):
            return manifest | {"reused": True}
    claim(folder, made_by, work=("terms", "shards"), what="BM25 index files")
    terms = _stored_terms(plan, scoring, folder)
    manifest = {
        "format": FORMAT,
        "made_by": made_by,
        "folder": folder,
        **{k: terms[k] for k in ("docs", "avgdl", "vocab_size")},
        "partitions": len(terms["partitions"]),
        "shards": _stored_shards(plan, scoring, terms, folder),
    }
    storage.write_json(manifest_uri, manifest)  # last: present means whole
    return manifest | {"reused": False}
