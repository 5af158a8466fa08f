"""The training stream: prepared shards -> fixed-length examples, for every remaining epoch.

Ray Train calls :class:`TrainingStream` each time it starts the worker group: at the
first start, after a worker failure, and when a run is resumed by re-running the job.
Each call reads the data position of the last checkpoint and builds one dataset that
covers every epoch still to train, with the rows that checkpoint had already consumed
left out. That is what makes a resumed epoch neither skip nor repeat documents: the
trainer's streaming split then hands the remaining rows to the workers as usual.

Epochs are concatenated into one stream (each example carries its ``epoch``) rather
than re-iterated, because a dataset handed to Ray Train is fixed for the life of a
worker group: a filter meant for the resumed epoch would otherwise apply to all.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.data import DataContext
from ray.data.context import ShuffleStrategy

from models.span_pairs import draw_span_pairs
from pipeline.core import storage
from pipeline.data.position import DataPosition, IntervalSet, read_position
from pipeline.data.shards import check_shards, load_manifest


@dataclass(frozen=True)
class StreamSpec:
    corpus: str  # prepared corpus folder (local or s3://)
    max_len: int
    pack: bool
    epochs: int
    seed: int
    shuffle_files: bool
    cls_id: int
    sep_id: int
    pad_id: int
    run_dir: str  # where the trainer's checkpoints and the position pointer live
    # coCondenser: a CoCondenserConfig (span_length, short_span_prob, min_span_length).
    # Set, the stream yields span pairs instead of sequences (see to_span_pairs).
    spans: Any = None


# -- data position on storage ---------------------------------------------------------


# -- examples ---------------------------------------------------------------------------


def frame(
    chunks: list[np.ndarray], max_len: int, cls_id: int, sep_id: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] chunk [SEP] + padding, as an (N, max_len) int32 array, and the lengths.

    Each chunk must fit, i.e. hold at most ``max_len - 2`` tokens.
    """
    out = np.full((len(chunks), max_len), pad_id, dtype=np.int32)
    lengths = np.zeros(len(chunks), dtype=np.int32)
    for i, chunk in enumerate(chunks):
        n = len(chunk) + 2
        out[i, 0] = cls_id
        out[i, 1 : n - 1] = chunk
        out[i, n - 1] = sep_id
        lengths[i] = n
    return out, lengths


def _frame(chunks: list[np.ndarray], spec: StreamSpec) -> tuple[np.ndarray, np.ndarray]:
    return frame(chunks, spec.max_len, spec.cls_id, spec.sep_id, spec.pad_id)


def to_sequences(batch: dict, spec: StreamSpec, epoch: int) -> dict:
    """Truncate each document, or pack consecutive documents, into max_len sequences.

    Packing joins documents with [SEP] and cuts the token stream every max_len - 2
    tokens, so long documents are used whole and short ones waste no padding. Each
    sequence lists the corpus rows it drew from (``source_rows``), which is what the
    worker records as consumed.
    """
    body = spec.max_len - 2
    rows, docs = batch["row"], batch["input_ids"]
    chunks, sources = [], []
    if not spec.pack:
        for row, ids in zip(rows, docs):
            chunks.append(np.asarray(ids[:body], dtype=np.int32))
            sources.append(np.array([row], dtype=np.int64))
    elif len(docs):
        # One token stream for the batch, documents joined by [SEP], with the row that
        # owns each token (-1 for separators): a sequence's sources are exactly the
        # documents with at least one token in it.
        pieces, owners = [], []
        for i, (row, ids) in enumerate(zip(rows, docs)):
            if i:
                pieces.append(np.array([spec.sep_id], dtype=np.int32))
                owners.append(np.array([-1], dtype=np.int64))
            pieces.append(np.asarray(ids, dtype=np.int32))
            owners.append(np.full(len(ids), row, dtype=np.int64))
        tokens, owner = np.concatenate(pieces), np.concatenate(owners)
        for start in range(0, len(tokens), body):
            chunks.append(tokens[start : start + body])
            rows_here = np.unique(owner[start : start + body])
            sources.append(rows_here[rows_here >= 0])
    input_ids, lengths = _frame(chunks, spec)
    source_rows = np.empty(len(sources), dtype=object)
    source_rows[:] = sources
    return {
        "input_ids": input_ids,
        "length": lengths,
        "epoch": np.full(len(chunks), epoch, dtype=np.int32),
        "source_rows": source_rows,
    }


def to_span_pairs(batch: dict, spec: StreamSpec, epoch: int) -> dict:
    """Two random spans per document, as one (2, max_len) example, re-drawn each epoch.

    A pair is one row, so no split or batch boundary can separate partners. Documents too
    short for a pair are skipped, but not silently: each is folded into the
    ``source_rows`` of the nearest following pair of the block (trailing ones into the
    last pair), so the worker marks it consumed like any other row, and counted in
    ``skipped_docs``. A block with no valid pair at all yields nothing; with whole-block
    batches (how this function is mapped) that means a whole shard of such documents.
    """

    rows, docs = np.asarray(batch["row"], dtype=np.int64), batch["input_ids"]
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    valid, first, second, span_len = draw_span_pairs(lengths, rows, spec.spans, spec.seed, epoch)
    keep = np.flatnonzero(valid)
    chunks, sources, skipped = [], [], np.zeros(len(keep), dtype=np.int32)
    if len(keep):
        # Each document's pair index: the next valid document at or after it, else the last.
        owner = np.minimum(np.searchsorted(keep, np.arange(len(rows))), len(keep) - 1)
        np.add.at(skipped, owner[~valid], 1)
        for pair, i in enumerate(keep):
            ids = np.asarray(docs[i], dtype=np.int32)
            chunks += [ids[first[i] : first[i] + span_len[i]], ids[second[i] : second[i] + span_len[i]]]
            sources.append(rows[owner == pair])
    input_ids, span_lengths = _frame(chunks, spec)
    source_rows = np.empty(len(sources), dtype=object)
    source_rows[:] = sources
    return {
        "input_ids": input_ids.reshape(len(keep), 2, spec.max_len),
        "length": span_lengths.reshape(len(keep), 2),
        "epoch": np.full(len(keep), epoch, dtype=np.int32),
        "source_rows": source_rows,
        "skipped_docs": skipped,
    }


def drop_consumed(batch: dict, consumed: list[list[int]]) -> dict:
    keep = ~IntervalSet(consumed).contains(batch["row"])
    return {k: v[keep] for k, v in batch.items()}


# -- the dataset ------------------------------------------------------------------------


def epoch_files(manifest: dict, spec: StreamSpec, epoch: int, consumed: IntervalSet) -> list[dict]:
    """The shards an epoch still has to read, in this epoch's order."""
    shards = [s for s in manifest["shards"] if not consumed.covers(s["first_row"], s["first_row"] + s["rows"])]
    if spec.shuffle_files:
        order = np.random.default_rng([spec.seed, epoch]).permutation(len(shards))
        shards = [shards[i] for i in order]
    return shards


def build_stream(spec: StreamSpec, position: DataPosition, manifest: dict | None = None):
    manifest = manifest or load_manifest(spec.corpus)
    fs_loc = storage.resolve(spec.corpus)
    parts = []
    for epoch in range(spec.epochs):
        consumed = position.consumed(epoch)
        shards = epoch_files(manifest, spec, epoch, consumed)
        if not shards:
            continue
        paths = [storage.resolve(storage.join(spec.corpus, s["path"])).path for s in shards]
        ds = ray.data.read_parquet(paths, filesystem=fs_loc.fs, shuffle=None).select_columns(["row", "input_ids"])
        if consumed.count():
            ds = ds.map_batches(
                drop_consumed, fn_kwargs={"consumed": consumed.to_list()}, batch_format="numpy", zero_copy_batch=True
            )
        if spec.spans is not None:
            ds = ds.map_batches(
                to_span_pairs, fn_kwargs={"spec": spec, "epoch": epoch}, batch_format="numpy", batch_size=None
            )
        else:
            ds = ds.map_batches(to_sequences, fn_kwargs={"spec": spec, "epoch": epoch}, batch_format="numpy")
        parts.append(ds)
    if not parts:  # everything consumed: an empty stream, so a resumed finished run just exports
        shape = (2, spec.max_len) if spec.spans is not None else (spec.max_len,)
        row = {
            "input_ids": np.zeros(shape, np.int32),
            "length": np.zeros(shape[:-1], np.int32),
            "epoch": 0,
            "source_rows": np.zeros(0, np.int64),
        }
        if spec.spans is not None:
            row["skipped_docs"] = 0
        return ray.data.from_items([row]).limit(0)
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


def configure_data_context() -> None:
    """Ray Data settings for every training stream, applied in the process that builds it
    (Ray Train may build datasets outside the driver)."""
    ctx = DataContext.get_current()
    # Epochs are concatenated into one stream and must stay in order.
    ctx.execution_options.preserve_order = True
    # Not Parquet datasource V1, though V2 starts 32 footer-reading actors to list a few
    # files (12 of a tiny run's 30 s of ingest on 2 cores): with V1 the union of epochs came
    # out interleaved, which the killed-worker test's per-micro-step audit caught.
    # Fine-tuning groups are assembled by a groupby: the task-based sort shuffle starts no
    # aggregator actors (16 -> 6 s for a tiny epoch on 2 cores) and keeps the planned order.
    ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    if not sys.stderr.isatty():
        # Into a log file, Ray Data's bars are redrawn with cursor codes, a line each time:
        # most of a run's stderr. The trainers' own log lines say how far a run is.
        ctx.enable_progress_bars = False
        ctx.enable_operator_progress_bars = False


class TrainingStream:
    """The callable handed to Ray Train as the ``train`` dataset (see module docstring)."""

    def __init__(self, spec: StreamSpec):
        self.spec = spec

    def __call__(self):
        configure_data_context()
        manifest = load_manifest(self.spec.corpus)
        check_shards(self.spec.corpus, manifest)
        position, _ = read_position(self.spec.run_dir)
        return build_stream(self.spec, position, manifest)


def estimate_sequences_per_epoch(manifest: dict, max_len: int, pack: bool, span_pairs: bool = False) -> int:
    """Examples one epoch yields (exact for truncation, close for packing, at most for span pairs)."""
    if not pack or span_pairs:
        return manifest["num_docs"]
    return int(np.ceil((manifest["num_tokens"] + manifest["num_docs"]) / (max_len - 2)))
