"""Encoded corpora: embedding shards plus a manifest.

Layout under the output URI (local or s3://)::

    made_by.json                 what makes the vectors: written before the first shard
    manifest.json                written last, once every shard is done
    shards/part-00000.parquet    columns: row (int64), doc_id (string),
                                 embedding (fixed_size_list<float32|float16, dim>)

``row`` is the passage's row in the prepared corpus (see :mod:`pipeline.data.shards`), so
search results map back to corpus rows without a lookup table. Shards are written
independently, one per encoding task, and possibly retried: each one appears under its
final name only once it is complete, so a rerun can skip :func:`finished_shards` and the
manifest is only written when all of them exist. A rerun keeps them only when
``made_by.json`` records what makes the vectors now (:func:`claim`): shards of another model,
model version, pooling or corpus are never mixed with, or mistaken for, this encoding's.
"""

from __future__ import annotations

import posixpath
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core import parts, storage
from pipeline.core.errors import ArtifactError, StorageError
from pipeline.data.corpus_ids import id_keys
from pipeline.data.shards import check_parquet_shard

MANIFEST = "manifest.json"
MADE_BY = parts.MADE_BY
FORMAT = "raydense-embeddings-v1"
DTYPES = {"float32": pa.float32(), "float16": pa.float16()}
SIMILARITIES = ("dot", "cos")
_SHARD_NAME = re.compile(r"^part-(\d{5,})\.parquet$")


def shard_path(index: int) -> str:
    """A shard's path relative to the embeddings folder (what the manifest records)."""
    return f"shards/part-{index:05d}.parquet"


def shard_schema(dim: int, dtype: str = "float32") -> pa.Schema:
    if dtype not in DTYPES:
        raise ArtifactError(f"embedding dtype {dtype!r} is not supported (use one of {sorted(DTYPES)})")
    return pa.schema([("row", pa.int64()), ("doc_id", pa.string()), ("embedding", pa.list_(DTYPES[dtype], dim))])


def write_shard(
    folder_uri: str, index: int, rows: np.ndarray, doc_ids: list[str], embeddings: np.ndarray, *, dtype: str = "float32"
) -> dict:
    """Write shard ``index`` and return its manifest entry.

    The file goes through :func:`storage.open_output`, which only moves it under its final
    name once Parquet has written the footer: a killed or failing writer leaves nothing
    that :func:`finished_shards` would mistake for a finished shard.
    """
    rows = np.asarray(rows, dtype=np.int64)
    embeddings = np.asarray(embeddings)
    path = shard_path(index)
    if embeddings.ndim != 2 or not len(rows) == len(doc_ids) == embeddings.shape[0] or not embeddings.size:
        raise ArtifactError(
            f"embedding shard {path}: {len(rows)} rows, {len(doc_ids)} doc ids and "
            f"embeddings of shape {embeddings.shape}; expected the same non-zero count"
        )
    schema = shard_schema(embeddings.shape[1], dtype)
    # A flat values array wrapped as fixed-size lists: no per-row Python objects, no copy for float32.
    flat = np.ascontiguousarray(embeddings, dtype=np.float16 if dtype == "float16" else np.float32).reshape(-1)
    table = pa.table(
        [
            pa.array(rows),
            pa.array(doc_ids, pa.string()),
            pa.FixedSizeListArray.from_arrays(pa.array(flat), embeddings.shape[1]),
        ],
        schema=schema,
    )
    with storage.open_output(storage.join(folder_uri, path)) as f:
        pq.write_table(table, f, row_group_size=8192)
    return {"index": int(index), "path": path, "rows": len(rows), "first_row": int(rows[0])}


def finished_shards(folder_uri: str) -> set[int]:
    """Indexes of the shards already under their final name, i.e. complete (for resuming).

    Local temporary files are dot-prefixed, so they never match; S3 uploads are atomic.
    """
    names = (posixpath.basename(p) for p in storage.list_files(storage.join(folder_uri, "shards"), ".parquet"))
    return {int(m.group(1)) for m in map(_SHARD_NAME.match, names) if m}


def claim(folder_uri: str, made_by: dict) -> str | None:
    """Make ``folder_uri`` the encoding ``made_by`` describes (the model, its stored version,
    the encoder's settings, the prepared corpus), before any shard is written: shards it made
    are kept for resuming, others deleted (:func:`pipeline.core.parts.claim`)."""
    return parts.claim(folder_uri, made_by, ("shards", MANIFEST), "embedding shards")


def write_manifest(
    folder_uri: str,
    dim: int,
    shards: list[dict],
    *,
    dtype: str = "float32",
    normalized: bool,
    similarity: str,
    model: str,
    made_by: dict | None = None,
) -> dict:
    """Write the manifest that marks the embeddings as complete; returns it. ``made_by``
    (what made the vectors) is kept in it, so embeddings made otherwise have another
    manifest, and what was built from the old one (an index) is not taken as current."""
    shard_schema(dim, dtype)  # validates dtype
    if similarity not in SIMILARITIES:
        raise ArtifactError(f"similarity {similarity!r} is not one of {SIMILARITIES}")
    shards = sorted(
        (
            {"index": int(s["index"]), "path": s["path"], "rows": int(s["rows"]), "first_row": int(s["first_row"])}
            for s in shards
        ),
        key=lambda s: s["index"],
    )
    indexes = [s["index"] for s in shards]
    if len(set(indexes)) != len(indexes):
        raise ArtifactError(f"{folder_uri}: duplicate shard indexes in {indexes}")
    manifest = {
        "format": FORMAT,
        "dim": int(dim),
        "dtype": dtype,
        "normalized": bool(normalized),
        "similarity": similarity,
        "model": model,
        "shards": shards,
        "count": sum(s["rows"] for s in shards),
        "made_by": made_by or {},
        "completed": True,
    }
    storage.write_json(storage.join(folder_uri, MANIFEST), manifest, keep_same=True)
    return manifest


def load_manifest(folder_uri: str) -> dict:
    """Read and check an embeddings folder's manifest."""
    return storage.read_manifest(
        folder_uri,
        FORMAT,
        ArtifactError,
        "encode the corpus first (or the encoding did not finish)",
        "encoding did not finish",
    )


def _width_error(uri: str, field: pa.Field, dim: int | None, dtype: str | None) -> str | None:
    kind = field.type
    if not pa.types.is_fixed_size_list(kind):
        return f"embedding shard {uri}: column 'embedding' is {kind}, expected fixed_size_list"
    if dim is not None and kind.list_size != dim:
        return f"embedding shard {uri} has width {kind.list_size}, the manifest's dim is {dim}"
    if dtype is not None and kind.value_type != DTYPES.get(dtype):
        return f"embedding shard {uri} holds {kind.value_type}, the manifest says {dtype}"
    return None


def check_embedding_shards(folder_uri: str, manifest: dict) -> None:
    """Read every shard's Parquet footer (not the data): a missing, truncated or mismatched
    shard fails here, by name, before any index is built from it."""
    for shard in manifest["shards"]:
        uri = storage.join(folder_uri, shard["path"])
        schema = check_parquet_shard(
            uri, shard["rows"], {"row", "doc_id", "embedding"}, ArtifactError, "embedding shard"
        )
        error = _width_error(uri, schema.field("embedding"), manifest["dim"], manifest.get("dtype", "float32"))
        if error:
            raise ArtifactError(error)


def read_shard(
    uri: str,
    entry: dict | None = None,
    *,
    dim: int | None = None,
    columns: tuple[str, ...] = ("row", "doc_id", "embedding"),
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """``(rows int64, doc_ids, embeddings float32 (n, dim))`` of one shard.

    ``uri`` is the shard file, or the embeddings folder when ``entry`` (a manifest shard
    entry) is given. float32 embeddings in a single chunk are a read-only view of the Arrow
    buffer, not a copy. Leave ``doc_id`` out of ``columns`` to skip building the strings.
    """
    if entry is not None:
        uri = storage.join(uri, entry["path"])
    try:
        table = storage.read_parquet(uri, columns=list(columns))
    except StorageError as exc:
        raise ArtifactError(f"embedding shard {exc}") from exc
    rows = table.column("row").to_numpy() if "row" in columns else np.empty(0, np.int64)
    doc_ids = table.column("doc_id").to_pylist() if "doc_id" in columns else []
    if "embedding" not in columns:
        return rows, doc_ids, np.empty((0, dim or 0), np.float32)
    error = _width_error(uri, table.schema.field("embedding"), dim, None)
    if error:
        raise ArtifactError(error)
    width = table.schema.field("embedding").type.list_size
    column = table.column("embedding")
    if column.null_count:
        raise ArtifactError(f"embedding shard {uri}: {column.null_count} null embeddings")
    chunks = [c.flatten().to_numpy(zero_copy_only=False) for c in column.chunks]
    flat = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.empty(0, np.float32)
    embeddings = flat.astype(np.float32, copy=False).reshape(-1, width)
    if entry is not None and len(embeddings) != entry["rows"]:
        raise ArtifactError(f"embedding shard {uri}: {len(embeddings)} rows, manifest says {entry['rows']}")
    return rows, doc_ids, embeddings


def pair_scores(
    folder: str, entry: dict, wanted_docs: np.ndarray, wanted_queries: np.ndarray, *vector_blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(query index, score) of every (query, stored passage) pair asked for whose passage
    lives in this shard: pair ``i`` is query ``wanted_queries[i]`` and passage
    ``wanted_docs[i]`` (bytes ids, sorted), scored as the query's vector against the
    passage's stored embedding (inner product). Query ``q``'s vector is row ``q`` of
    ``vector_blocks`` laid end to end (they are not joined: a copy of every query's vector
    per task)."""
    _, doc_ids, embeddings = read_shard(folder, entry)
    keys = id_keys(doc_ids)
    first = np.searchsorted(wanted_docs, keys, side="left")
    counts = np.searchsorted(wanted_docs, keys, side="right") - first
    passage = np.repeat(np.arange(len(keys)), counts)
    # Pair j of passage p is wanted pair first[p] + j.
    pairs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(first, counts)
    queries = wanted_queries[pairs].astype(np.int64)
    starts = np.cumsum([0] + [len(block) for block in vector_blocks])
    owner = np.searchsorted(starts, queries, side="right") - 1
    scores = [float(vector_blocks[b][q - starts[b]] @ embeddings[i]) for q, b, i in zip(queries, owner, passage)]
    return queries, np.asarray(scores, dtype=np.float32)
