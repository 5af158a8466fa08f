"""Prepared corpora: tokenized, sharded Parquet plus a manifest.

Layout under the output URI (local or s3://)::

    manifest.json            shards, row counts, tokenizer, settings; written last
    tokenizer/               the HF tokenizer the ids belong to
    shards/part-00000.parquet  columns: row (int64), doc_id (string), input_ids (list<int32>)

``row`` is the document's 0-based position in the whole corpus. It is what training
checkpoints record as the data position, so shard ``i`` holds the contiguous rows
``[first_row, first_row + rows)``. Token ids carry no special tokens: [CLS]/[SEP] are
added when sequences are packed or truncated at training time.
They are written by :mod:`pipeline.data.prepare`; this module is the format and its
checks, light enough for every Ray Data task that reads shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from pipeline.core import storage
from pipeline.core.errors import ArtifactError, StorageError

MANIFEST = "manifest.json"
FORMAT = "raydense.corpus/1"
WORD_PIECES = "word_pieces.json"  # which token ids start or continue a word (whole-word masking)
SHARD_SCHEMA = pa.schema([("row", pa.int64()), ("doc_id", pa.string()), ("input_ids", pa.list_(pa.int32()))])


def load_manifest(corpus_uri: str) -> dict:
    """Read and check a prepared corpus' manifest (the corpus URI is its folder)."""
    return storage.read_manifest(
        corpus_uri,
        FORMAT,
        ArtifactError,
        "prepare the corpus first (jobs/prepare_corpus.py)",
        "preparation did not finish",
    )


@dataclass(frozen=True)
class PreparedCorpus:
    """A prepared corpus: its folder and its manifest. The one place that answers "is this
    folder prepared, and with which tokenizer?"."""

    folder: str
    manifest: dict

    @classmethod
    def at(cls, folder: str) -> PreparedCorpus | None:
        """The corpus prepared in ``folder``; None where ``folder`` holds none (a raw corpus
        file, or a folder not yet prepared)."""
        if not storage.exists(storage.join(folder, MANIFEST)):
            return None
        return cls.load(folder)

    @classmethod
    def load(cls, folder: str) -> PreparedCorpus:
        """The corpus prepared in ``folder``; an error naming the folder where none finished there."""
        return cls(folder, load_manifest(folder))

    @property
    def docs(self) -> int:
        return self.manifest["num_docs"]

    @property
    def tokenizer(self) -> str:
        """The folder of the tokenizer its ids belong to."""
        return storage.join(self.folder, self.manifest["tokenizer"])

    @property
    def version(self) -> str:
        """The stored version of its manifest: what an output made from it records."""
        return storage.version(storage.join(self.folder, MANIFEST))


def check_parquet_shard(uri: str, rows: int, columns: set[str], error: type[Exception], what: str = "shard"):
    """Read one shard's Parquet footer (not its data) and check it against its manifest
    entry; returns its Arrow schema. Every failure raises ``error`` naming the shard."""
    if not storage.exists(uri):
        raise error(f"{what} {storage.resolve(uri).describe()} is missing")
    try:  # a transient fault past the retry budget is no StorageError: it is not the shard's
        meta = storage.read_parquet_metadata(uri)
        schema = meta.schema.to_arrow_schema()
    except StorageError as exc:
        raise error(f"{what} {uri} is unreadable (corrupt or truncated Parquet): {exc}") from exc
    if meta.num_rows != rows:
        raise error(f"{what} {uri}: {meta.num_rows} rows, manifest says {rows}")
    missing = columns - set(schema.names)
    if missing:
        raise error(f"{what} {uri}: missing columns {sorted(missing)}")
    return schema


# What mends a prepared corpus damaged after it was made: every error that finds one says it.
PREPARE_AGAIN = "--corpus.overwrite true prepares the corpus again"


def check_shards(corpus_uri: str, manifest: dict) -> None:
    """Every shard there at the size it was written, from one listing: a truncated or missing
    shard fails here, by name, before any worker starts. Its bytes are checked by the task
    that opens it (:func:`read_shard_tokens`), never one by one on the driver: at every
    start of a trainer (each restart included) that read every footer, a request or more a
    shard (1,000 shards: over 2,000 requests before the first step)."""
    check_shard_sizes(corpus_uri, manifest)


def check_shard_sizes(corpus_uri: str, manifest: dict) -> None:
    """From one listing: an ArtifactError naming the first shard that is missing or not at
    the size the manifest recorded (a manifest that predates recorded sizes: presence only)."""
    sizes = storage.file_sizes(corpus_uri)
    for shard in manifest["shards"]:
        uri, size = storage.join(corpus_uri, shard["path"]), sizes.get(shard["path"])
        if size is None:
            raise ArtifactError(f"corpus shard {uri} is missing: {PREPARE_AGAIN}")
        if "bytes" in shard and size != shard["bytes"]:
            raise ArtifactError(f"corpus shard {uri} is {size} bytes, written as {shard['bytes']}: {PREPARE_AGAIN}")


def shard_uris(corpus_uri: str, manifest: dict) -> list[str]:
    return [storage.join(corpus_uri, s["path"]) for s in manifest["shards"]]


def read_shard_tokens(uri: str) -> dict[str, np.ndarray]:
    """A prepared shard's ``row`` and ``input_ids`` (an object array of int32 views of one
    buffer, without a Python int per token)."""
    try:
        table = storage.read_parquet(uri, ["row", "input_ids"])
    except StorageError as exc:  # its size passed check_shards: its bytes do not decode
        raise ArtifactError(f"corpus shard {uri} is damaged ({exc}): {PREPARE_AGAIN}") from None
    ids = table.column("input_ids").combine_chunks()
    values = ids.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    offsets = ids.offsets.to_numpy()
    docs = np.empty(len(ids), dtype=object)
    docs[:] = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return {"row": table.column("row").to_numpy(), "input_ids": docs}


def _each_shard(batch: dict, fn: Callable, fn_kwargs: dict) -> dict:
    item = {k: v[0] for k, v in batch.items()}
    return fn(read_shard_tokens(str(item.pop("uri"))), **item, **fn_kwargs)


def shard_dataset(items: list[dict], fn: Callable, fn_kwargs: dict):
    """A Ray Dataset of ``fn(shard, **item, **fn_kwargs)`` for each item (``uri``: a prepared
    shard, and any other fields, e.g. its epoch), one task and one block per item, in the
    order given. Blocks are exactly shards (what a resumed stream rebuilds must not depend
    on how Ray cut the input), and no file is listed or its footer read ahead:
    ``ray.data.read_parquet`` spent 1-2.5 s doing so for three shards. One dataset for
    every epoch: a union of datasets does not keep their order."""
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _each_shard, fn_kwargs={"fn": fn, "fn_kwargs": fn_kwargs}, batch_size=1, batch_format="numpy"
    )


def _held_in_shard(uri: str, ids: np.ndarray) -> np.ndarray:
    doc_ids = storage.read_parquet(uri, ["doc_id"])["doc_id"].cast(pa.binary())
    return pc.is_in(pa.array(ids, pa.binary()), value_set=doc_ids).to_numpy(zero_copy_only=False)


def held_ids(corpus_uri: str, manifest: dict, ids: np.ndarray) -> np.ndarray:
    """Which of ``ids`` (bytes) the prepared corpus holds, answered by one Ray task per shard
    (each reads its ``doc_id`` column), so a judged id is checked before any encoding without
    the corpus's ids on the driver: a bool mask."""
    found = np.zeros(len(ids), bool)
    if not len(ids):
        return found
    ids_ref = ray.put(np.asarray(ids))
    lookup = ray.remote(_held_in_shard).options(num_cpus=0.5, max_retries=3)
    for mask in ray.get([lookup.remote(u, ids_ref) for u in shard_uris(corpus_uri, manifest)]):
        found |= mask
    return found
