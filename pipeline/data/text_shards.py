"""A raw corpus cut into Parquet text shards (``doc_id``, ``text``) in the run's storage.

Ray tasks and actors on any node read a part of the corpus from them: preparation's
tokenizer tasks, BM25's shard actors and the passage servers of re-ranker scoring. The
driver streams the raw input once (validated by :func:`pipeline.data.corpus.iter_documents`,
errors name file and line) and writes each shard a row group at a time, so its memory is
one row group's texts whatever the shard size.

:func:`stage_text` keeps the shards with a manifest naming the input's stored version and
the staging settings, so every consumer of a run's corpus reads one staging, a rerun reuses
it, an actor restarted on another node reloads its part from it, and a corpus rewritten at
the same path is staged anew. :func:`group_shards` hands a consumer the shards in loads of
its own size (a BM25 actor holds more documents than a tokenizer task).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.core import storage
from pipeline.core.errors import InputError, StorageError
from pipeline.core.progress import progress
from pipeline.data.corpus import CorpusStats, iter_documents
from pipeline.data.join import JoinConfig, join_consecutive

SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string())])
ROW_GROUP = 4096


class _ShardWriter:
    def __init__(self, uri: str):
        self.uri, self.loc = uri, storage.resolve(uri)
        try:
            if isinstance(self.loc.fs, pafs.LocalFileSystem):
                os.makedirs(os.path.dirname(self.loc.path), exist_ok=True)
            self.writer = pq.ParquetWriter(self.loc.path, SCHEMA, filesystem=self.loc.fs)
        except Exception as exc:
            raise StorageError(f"cannot write {self.loc.describe()}: {exc}") from exc
        self.rows = self.text_bytes = 0

    def write(self, ids: list[str], texts: list[str]) -> None:
        self.writer.write_table(pa.table({"doc_id": ids, "text": texts}, schema=SCHEMA))
        self.rows += len(ids)
        self.text_bytes += sum(len(t.encode("utf-8")) for t in texts)

    def close(self) -> None:
        self.writer.close()


def write_text_shards(
    corpus: str,
    folder: str,
    docs_per_shard: int,
    *,
    on_empty: str = "skip",
    stats: CorpusStats | None = None,
    join: JoinConfig | None = None,
) -> list[dict]:
    """Cut ``corpus`` into ``folder/text-NNNNN.parquet`` (its records joined into passages
    where ``join`` says so); one item per shard: ``index``,
    ``text_uri``, ``first_row`` (corpus row of its first document), ``rows`` and
    ``text_bytes`` (UTF-8 bytes of its texts, for sizing what reads it)."""
    if docs_per_shard < 1:
        raise ValueError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    stats = stats if stats is not None else CorpusStats()
    items: list[dict] = []
    writer: _ShardWriter | None = None
    ids: list[str] = []
    texts: list[str] = []
    rows = 0

    def close_shard() -> None:
        nonlocal writer
        if writer is not None:
            writer.close()
            items.append(
                {
                    "index": len(items),
                    "text_uri": writer.uri,
                    "first_row": rows - writer.rows,
                    "rows": writer.rows,
                    "text_bytes": writer.text_bytes,
                }
            )
            writer = None

    bar = progress(None, "stage text", "documents")
    documents = iter_documents(corpus, on_empty=on_empty, stats=stats)
    for doc in join_consecutive(documents, join or JoinConfig()):
        bar.update()
        if writer is None:
            writer = _ShardWriter(storage.join(folder, f"text-{len(items):05d}.parquet"))
        ids.append(doc.doc_id)
        texts.append(doc.text)
        rows += 1
        if len(ids) == ROW_GROUP or writer.rows + len(ids) == docs_per_shard:
            writer.write(ids, texts)
            ids, texts = [], []
            if writer.rows == docs_per_shard:
                close_shard()
    if ids:
        writer.write(ids, texts)
    close_shard()
    bar.close()
    if not items:
        raise InputError(f"{corpus}: no documents ({stats.skipped_empty} empty ones skipped)", source=corpus)
    return items


TEXT_FORMAT = "raydense-text-shards-v1"


def stage_text(
    corpus: str, folder: str, docs_per_shard: int, *, on_empty: str = "skip", join: JoinConfig | None = None
) -> dict:
    """``corpus`` staged as text shards below ``folder``, or the staging already there when it
    was made from the same stored version with the same validation and joining (its cut,
    ``docs_per_shard``, is then the first stager's: consumers regroup shards into their own
    loads). Returns its manifest: ``source``, ``version``, ``settings``, ``docs``,
    ``corpus_stats`` and ``shards`` (the items of :func:`write_text_shards`). Each input and
    way of reading it gets its own subfolder, so a pre-training corpus, its passages joined,
    and the retrieval corpus share one folder without evicting each other."""
    source = storage.resolve(corpus).uri
    reading = {"on_empty": on_empty, "join": asdict(join or JoinConfig())}
    key = json.dumps({"source": source, **reading}, sort_keys=True)
    target = storage.join(folder, hashlib.sha1(key.encode()).hexdigest()[:10])
    manifest_uri = storage.join(target, "manifest.json")
    version = storage.version(source)
    if storage.exists(manifest_uri):
        manifest = storage.read_json(manifest_uri)
        if (manifest.get("format"), manifest.get("source"), manifest.get("version")) == (TEXT_FORMAT, source, version):
            return manifest
    storage.delete_dir(target)  # another version's shards, or a staging cut short
    stats = CorpusStats()
    shards = write_text_shards(source, target, docs_per_shard, on_empty=on_empty, stats=stats, join=join)
    manifest = {
        "format": TEXT_FORMAT,
        "source": source,
        "version": version,
        "settings": {**reading, "docs_per_shard": docs_per_shard},
        "docs": sum(item["rows"] for item in shards),
        "corpus_stats": stats.as_dict(),
        "shards": shards,
    }
    storage.write_json(manifest_uri, manifest)  # last: present means complete
    return manifest


def group_shards(shards: list[dict], docs_per_load: int) -> list[list[dict]]:
    """Consecutive shards in loads of at most ``docs_per_load`` documents (a shard larger than
    that is a load of its own), so one actor serves a contiguous range of corpus rows."""
    loads: list[list[dict]] = []
    docs = 0
    for item in shards:
        if loads and docs + item["rows"] <= docs_per_load:
            loads[-1].append(item)
            docs += item["rows"]
        else:
            loads.append([item])
            docs = item["rows"]
    return loads


def read_text_load(load: list[dict]) -> pa.Table:
    """The shards of a load, concatenated in corpus order."""
    return pa.concat_tables([storage.read_parquet(item["text_uri"]) for item in load])


def iter_texts(items: list[dict]) -> Iterator[str]:
    """Every shard's texts, in corpus order."""
    for item in items:
        yield from storage.read_parquet(item["text_uri"], ["text"]).column("text").to_pylist()


def read_text_shard(item: dict) -> pa.Table:
    return storage.read_parquet(item["text_uri"])
