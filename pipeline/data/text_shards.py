"""A raw corpus cut into Parquet text shards (``doc_id``, ``text``) in the run's storage.

Ray tasks and actors on any node read a part of the corpus from them: preparation's
tokenizer tasks, BM25's shard actors and the passage servers of re-ranker scoring. Staging
tasks read the raw input in pieces side by side (a large JSONL or TSV file is cut at byte
offsets, each piece starting at its first whole line; see
:func:`pipeline.data.corpus.corpus_pieces`), validate it (errors name file and line) and
write each shard a row group at a time. The driver only plans the pieces and sums what the
tasks return; the check for repeated ids runs in tasks too, over the ids' 8-byte hashes.

:func:`stage_text` keeps the shards with a manifest naming the input's stored version and
the staging settings, so every consumer of a run's corpus reads one staging, a rerun reuses
it, an actor restarted on another node reloads its part from it, and a corpus rewritten at
the same path is staged anew. :func:`group_shards` hands a consumer the shards in loads of
its own size (a BM25 actor holds more documents than a tokenizer task).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import sys
from dataclasses import asdict
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core import storage
from pipeline.core.errors import InputError
from pipeline.core.tasks import StorageTasks
from pipeline.data.corpus import (
    MAX_SKIPPED_EXAMPLES,
    CorpusStats,
    IdHashes,
    Piece,
    corpus_files,
    corpus_pieces,
    is_parquet,
    piece_documents,
    raise_duplicate,
    repeated_hashes,
)
from pipeline.data.join import JoinConfig, join_consecutive
from pipeline.data.records import count_line_starts

SCHEMA = pa.schema([("doc_id", pa.string()), ("text", pa.string())])
ROW_GROUP = 4096
PIECE_BYTES = 32 << 20  # of raw input a staging task reads: MS MARCO's 2.9 GB collection is 87 of them
HASH_BUCKET_BITS = 4
HASH_BUCKETS = 1 << HASH_BUCKET_BITS
PIECES = "pieces"  # each staged piece's record, stored once its shards are
# A gzip file is one piece (it cannot be cut at byte offsets): past this size its one task
# bounds the staging, and the driver says so. The rate a task stages compressed JSONL at,
# measured here (2 cores; bench/README.md), names the time it will take.
ONE_TASK_WARN_BYTES = 1 << 30
GZIP_STAGE_BYTES_PER_S = 8e6


class _ShardWriter:
    """One text shard, written to a local temporary file and stored under its name only when
    it is closed whole (:func:`storage.open_output`): a ParquetWriter straight onto S3 that
    an error interrupted was closed by its destructor, leaving a valid-looking shard of part
    of its rows under the final name."""

    def __init__(self, uri: str):
        self.uri = uri
        self.output = storage.open_output(uri)
        self.writer = pq.ParquetWriter(self.output.__enter__(), SCHEMA)
        self.rows = self.text_bytes = 0

    def write(self, ids: list[str], texts: list[str]) -> None:
        self.writer.write_table(pa.table({"doc_id": ids, "text": texts}, schema=SCHEMA))
        self.rows += len(ids)
        self.text_bytes += sum(len(t.encode("utf-8")) for t in texts)

    def close(self) -> None:
        self.writer.close()
        self.output.__exit__(None, None, None)

    def abandon(self, exc: BaseException) -> None:
        """Leave nothing under the shard's name (the temporary file goes)."""
        self.writer.close()
        with contextlib.suppress(BaseException):
            self.output.__exit__(type(exc), exc, exc.__traceback__)


def write_text_shards(
    pieces: list[Piece],
    folder: str,
    prefix: str,
    docs_per_shard: int,
    on_empty: str = "skip",
    join: JoinConfig | None = None,
) -> tuple:
    """A staging task (or a plain call, without Ray): the documents of ``pieces``, in order
    and joined into passages where ``join`` says, cut into ``folder/{prefix}-NNNN.parquet``.
    Returns ``{"shards": [{text_uri, rows, text_bytes}], "stats": CorpusStats.as_dict()}``
    and the documents' id hashes (empty ones' included), for the duplicate check."""
    stats, seen = CorpusStats(), IdHashes()
    shards: list[dict] = []
    writer: _ShardWriter | None = None
    ids: list[str] = []
    texts: list[str] = []

    def close_shard() -> None:
        nonlocal writer
        if writer is not None:
            writer.close()
            shards.append({"text_uri": writer.uri, "rows": writer.rows, "text_bytes": writer.text_bytes})
            writer = None

    documents = itertools.chain.from_iterable(piece_documents(p, on_empty, stats, seen) for p in pieces)
    try:
        for doc in join_consecutive(documents, join or JoinConfig()):
            if writer is None:
                writer = _ShardWriter(storage.join(folder, f"{prefix}-{len(shards):04d}.parquet"))
            ids.append(doc.doc_id)
            texts.append(doc.text)
            if len(ids) == ROW_GROUP or writer.rows + len(ids) == docs_per_shard:
                writer.write(ids, texts)
                ids, texts = [], []
                if writer.rows == docs_per_shard:
                    close_shard()
        if ids and writer is not None:
            writer.write(ids, texts)
        close_shard()
    except BaseException as exc:
        if writer is not None:
            writer.abandon(exc)
        raise
    return {"shards": shards, "stats": stats.as_dict()}, seen.array()


def _staged_piece(
    pieces: list[Piece], folder: str, prefix: str, docs_per_shard: int, on_empty: str, join: JoinConfig | None
) -> tuple:
    """A staging task that commits: :func:`write_text_shards`, then the piece's record (its
    shards, stats and id hashes), stored last. A piece whose record is there was staged by
    an earlier attempt of this staging and is read back, not staged again. Returns the
    summary and the id hashes in :data:`HASH_BUCKETS` arrays, split by hash, so the
    duplicate check over the whole corpus runs in as many tasks and never on the head."""
    record_uri = storage.join(folder, PIECES, f"{prefix}.json")
    hashes_uri = storage.join(folder, PIECES, f"{prefix}.hashes.npy")
    if storage.exists(record_uri):
        summary = storage.read_json(record_uri)
        hashes = storage.read_array(hashes_uri)
    else:
        summary, hashes = write_text_shards(pieces, folder, prefix, docs_per_shard, on_empty, join)
        storage.write_array(hashes_uri, hashes)
        storage.write_json(record_uri, summary)
    bucket = hashes >> np.uint64(64 - HASH_BUCKET_BITS)
    return (summary, *(hashes[bucket == b] for b in range(HASH_BUCKETS)))


def _repeated(*arrays: np.ndarray) -> set[int]:
    return repeated_hashes(list(arrays))


def _numbered(pieces: list[Piece], tasks: StorageTasks) -> list[Piece]:
    """``pieces`` with each one's ``first_line``: the lines before it in its file, counted
    in parallel (a byte count of newlines, not a parse)."""
    # A Parquet piece is a row group, numbered by its rows when it was cut.
    counted = [
        i
        for i, p in enumerate(pieces)
        if p.end is not None and not is_parquet(p.source) and i + 1 < len(pieces) and pieces[i + 1].start
    ]
    counts = dict(
        zip(
            counted, tasks.map(count_line_starts, [(pieces[i].source, pieces[i].start, pieces[i].end) for i in counted])
        )
    )
    numbered, line = [], 1
    for i, piece in enumerate(pieces):
        if is_parquet(piece.source):
            numbered.append(piece)
            continue
        line = 1 if piece.start == 0 else line
        numbered.append(dataclasses.replace(piece, first_line=line))
        line += counts.get(i, 0)
    return numbered


def _write_staging(
    corpus: str, folder: str, docs_per_shard: int, on_empty: str, join: JoinConfig | None, columns: str
) -> tuple:
    """Stage ``corpus`` into ``folder`` with parallel tasks, one a piece of the input (one in
    all when records are joined: a joined passage may span pieces). Returns the shard items
    (``index``, ``text_uri``, ``first_row``, ``rows``, ``text_bytes``) and the stats."""
    if docs_per_shard < 1:
        raise ValueError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    tasks = StorageTasks(corpus, folder)
    pieces = _numbered(corpus_pieces(corpus, PIECE_BYTES, columns), tasks)
    _warn_of_large_single_pieces(pieces)
    groups = [pieces] if (join or JoinConfig()).group_by else [[p] for p in pieces]
    calls = [(group, folder, f"text-{i:05d}", docs_per_shard, on_empty, join) for i, group in enumerate(groups)]
    results = tasks.map(_staged_piece, calls, "stage text", "pieces", num_returns=1 + HASH_BUCKETS)
    buckets = [[r[1 + b] for r in results] for b in range(HASH_BUCKETS)]
    repeated = set().union(*tasks.map(_repeated, buckets))
    if repeated:
        raise_duplicate(corpus_files(corpus), repeated)
    stats = CorpusStats()
    items: list[dict] = []
    for summary, *_ in results:
        part = summary["stats"]
        stats.documents += part["documents"]
        stats.skipped_empty += part["skipped_empty"]
        stats.skipped_examples = (stats.skipped_examples + part["skipped_examples"])[:MAX_SKIPPED_EXAMPLES]
        for shard in summary["shards"]:
            first_row = items[-1]["first_row"] + items[-1]["rows"] if items else 0
            items.append({"index": len(items), "first_row": first_row, **shard})
    if not items:
        raise InputError(f"{corpus}: no documents ({stats.skipped_empty} empty ones skipped)", source=corpus)
    return items, stats


def _warn_of_large_single_pieces(pieces: list[Piece]) -> None:
    """One line on stderr for each whole compressed file big enough to bound the staging:
    how long its one task will take, and how to split it so that tasks share the work."""
    for piece in pieces:
        if piece.end is not None:
            continue
        size = storage.info(piece.source).size
        if size > ONE_TASK_WARN_BYTES:
            hours = size / GZIP_STAGE_BYTES_PER_S / 3600
            print(
                f"stage text: warning: {piece.source} is one compressed file of {size / 1e9:.1f} GB, staged by one "
                f"task (about {hours:.1f} h at {GZIP_STAGE_BYTES_PER_S / 1e6:g} MB/s); split it into files of about "
                f"{PIECE_BYTES >> 20} MB (e.g. zcat FILE | split -C {PIECE_BYTES >> 20}M -d --filter='gzip > $FILE.gz' - part-) "
                "and pass their folder, so that tasks stage them side by side",
                file=sys.stderr,
                flush=True,
            )


TEXT_FORMAT = "raydense-text-shards-v2"


def stage_text(
    corpus: str,
    folder: str,
    docs_per_shard: int,
    *,
    on_empty: str = "skip",
    join: JoinConfig | None = None,
    columns: str = "",
) -> dict:
    """``corpus`` staged as text shards below ``folder``, or the staging already there when it
    was made from the same stored version with the same validation and joining (its cut,
    ``docs_per_shard``, is then the first stager's: consumers regroup shards into their own
    loads). Returns its manifest: ``source``, ``version``, ``settings``, ``docs``,
    ``corpus_stats`` and ``shards`` (``index``, ``text_uri``, ``first_row``, ``rows``,
    ``text_bytes``). Each input and way of reading it gets its own subfolder, so a
    pre-training corpus, its passages joined, and the retrieval corpus share one folder
    without evicting each other."""
    source = storage.resolve(corpus).uri
    reading = {"on_empty": on_empty, "join": asdict(join or JoinConfig())}
    if columns:  # a Parquet corpus's mapping; absent when unset, so earlier stagings keep their key
        reading["columns"] = columns
    key = json.dumps({"source": source, **reading}, sort_keys=True)
    target = storage.join(folder, hashlib.sha1(key.encode()).hexdigest()[:10])
    manifest_uri = storage.join(target, "manifest.json")
    version = storage.version(source)
    if storage.exists(manifest_uri):
        manifest = storage.read_json(manifest_uri)
        if (manifest.get("format"), manifest.get("source"), manifest.get("version")) == (TEXT_FORMAT, source, version):
            return manifest
    # A staging cut short by the same input, reading and cut resumes from its stored pieces;
    # another version's, or another cut's, is deleted first.
    made_by = {"format": TEXT_FORMAT, "source": source, "version": version, **reading}
    made_by |= {"docs_per_shard": docs_per_shard, "piece_bytes": PIECE_BYTES}
    record = storage.join(target, "made_by.json")
    if not storage.exists(record) or storage.read_json(record) != json.loads(json.dumps(made_by)):
        storage.delete_dir(target)
        storage.write_json(record, made_by)
    shards, stats = _write_staging(source, target, docs_per_shard, on_empty, join, columns)
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
    storage.delete_dir(storage.join(target, PIECES))  # the shards' own records: kept in the manifest
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
