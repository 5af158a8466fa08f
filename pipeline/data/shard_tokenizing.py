"""Tokenizing staged text shards into corpus shards: the Ray tasks of corpus preparation
(:mod:`pipeline.data.prepare`), and the word-piece roles they count for whole-word masking.

A task runs the tokenizer's own Rust backend (the ``tokenizers`` library), which the driver
hands it serialized: the task imports neither transformers nor torch, which cost each fresh
worker process ~3 s of CPU and ~120 MB more (``bench/bench_tokenize_task.py``), and it
fetches nothing from storage. The backend is the object the Hugging Face tokenizer calls itself,
settings and all, so the ids and word ids are the tokenizer's (checked against it in
``tests/data/test_shards.py``). A tokenizer without one (a pure-Python or SentencePiece-library
tokenizer) is loaded through transformers in the task instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from pipeline.core import model_ref, storage
from pipeline.data.shards import SHARD_SCHEMA
from pipeline.data.text_shards import read_text_shard


@dataclass(frozen=True)
class ShardTokenizer:
    """What a tokenizing task needs of the corpus's tokenizer: its serialized backend (or,
    without one, where the tokenizer is stored) and its size with added tokens."""

    backend: str | None  # tokenizers' JSON of the HF tokenizer's backend_tokenizer
    uri: str  # the stored tokenizer: loaded through transformers only when backend is None
    vocab_size: int

    @classmethod
    def of(cls, tokenizer, uri: str) -> ShardTokenizer:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        return cls(backend.to_str() if backend is not None else None, uri, len(tokenizer))

    def encode(self, texts: list[str]) -> tuple[list[list[int]], list | None]:
        """Each text's ids without special tokens, untruncated, and the per-text encodings
        that carry word ids (None where the tokenizer has none)."""
        if self.backend is not None:
            backend = Tokenizer.from_str(self.backend)
            backend.no_truncation()  # as the HF tokenizer sets it for a call without truncation
            backend.no_padding()
            encodings = backend.encode_batch(texts, add_special_tokens=False)
            return [e.ids for e in encodings], encodings
        from pipeline.data.tokenizer import load_tokenizer  # transformers: only for these tokenizers

        tokenizer = load_tokenizer(model_ref.materialize(self.uri, "tokenizer"))
        # Documents are stored whole and cut to length by the readers: without this, HF warns
        # that a long one "will result in indexing errors", which it will not.
        tokenizer.model_max_length = 2**62
        batch = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
        return batch["input_ids"], batch.encodings


def tokenize_shard(item: dict, tokenizer: ShardTokenizer, output: str) -> tuple[dict, np.ndarray | None]:
    """A Ray task: tokenizes one staged text shard into one final shard. Returns its entry,
    and apart (a second object) its word-piece counts (:func:`word_piece_counts`)."""
    table = read_text_shard(item)
    encoded, encodings = tokenizer.encode(table.column("text").to_pylist())
    first = item["first_row"]
    shard = pa.table(
        {
            "row": pa.array(range(first, first + len(encoded)), pa.int64()),
            "doc_id": table.column("doc_id"),
            "input_ids": pa.array(encoded, pa.list_(pa.int32())),
        },
        schema=SHARD_SCHEMA,
    )
    path = f"shards/part-{item['index']:05d}.parquet"
    with storage.open_output(storage.join(output, path)) as f:  # the shard appears whole or not at all
        pq.write_table(shard, f, row_group_size=4096)
    entry = {
        "index": item["index"],
        "path": path,
        "first_row": first,
        "rows": len(encoded),
        "tokens": int(sum(len(e) for e in encoded)),
    }
    return entry, word_piece_counts(encodings, tokenizer.vocab_size)


PROGRESS = "_progress"  # in a preparation's output: what each attempt committed, until the manifest


def tokenized_shard(item: dict, tokenizer: ShardTokenizer, output: str) -> tuple[dict, np.ndarray | None]:
    """:func:`tokenize_shard`, committed: its entry and word-piece counts are stored once
    the shard is, so a preparation cut short and rerun reads them back for the shards it
    finished instead of tokenizing them again."""
    record_uri = storage.join(output, PROGRESS, f"part-{item['index']:05d}.json")
    counts_uri = storage.join(output, PROGRESS, f"part-{item['index']:05d}.counts.npy")
    if storage.exists(record_uri):
        entry = storage.read_json(record_uri)
        counts = storage.read_array(counts_uri) if entry["counted"] else None
        return {k: v for k, v in entry.items() if k != "counted"}, counts
    entry, counts = tokenize_shard(item, tokenizer, output)
    if counts is not None:
        storage.write_array(counts_uri, counts)
    storage.write_json(record_uri, {**entry, "counted": counts is not None})
    return entry, counts


def word_piece_counts(encodings: list | None, vocab_size: int) -> np.ndarray | None:
    """(2, vocab) counts of how often each token id starts a word (row 0) and continues one
    (row 1) in ``encodings`` (one ``tokenizers`` encoding per text, without special tokens:
    a fast HF tokenizer's ``BatchEncoding.encodings``), with word boundaries from the
    tokenizer's own word ids. None without encodings (a slow tokenizer has no word ids)."""
    if encodings is None:
        return None
    ids, continues = [], []
    for encoding in encodings:
        if encoding.ids:
            words = np.asarray([-1 if w is None else w for w in encoding.word_ids])
            ids.append(np.asarray(encoding.ids))
            continues.append(np.r_[False, (words[1:] == words[:-1]) & (words[1:] >= 0)])
    if not ids:
        return np.zeros((2, vocab_size), dtype=np.int64)
    ids, continues = np.concatenate(ids), np.concatenate(continues)
    return np.stack(
        [np.bincount(ids[~continues], minlength=vocab_size), np.bincount(ids[continues], minlength=vocab_size)]
    ).astype(np.int64)


def continuation_table(counts: np.ndarray) -> dict[str, list[int]]:
    """The ids seen mostly continuing a word, and those seen mostly starting one: what
    whole-word masking needs (``models.masking.MaskingVocab``)."""
    seen = counts.sum(0) > 0
    continues = counts[1] > counts[0]
    return {
        "continuation_ids": np.flatnonzero(seen & continues).tolist(),
        "start_ids": np.flatnonzero(seen & ~continues).tolist(),
    }
