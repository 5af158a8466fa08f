"""The training stream: prepared shards -> fixed-length examples, for every remaining epoch.

Ray Train calls :class:`TrainingStream` each time it starts the worker group: at the
first start, after a worker failure, and when a run is resumed by re-running the job.
Each call reads the data position of the last checkpoint and builds one dataset that
covers every epoch still to train, with the rows that checkpoint had already consumed
left out, and the document a packed sequence cut resumed at its next token. That is
what makes a resumed epoch neither skip nor repeat documents: the trainer's streaming
split then hands the remaining rows to the workers as usual. Row order and packing are
functions of the corpus rows alone (:func:`window_order`, :func:`block_examples`), so
with one worker the resumed stream is the rest of the uninterrupted one, example for
example.

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

from models.framing import Framing
from models.span_pairs import draw_span_pairs
from pipeline.core import storage
from pipeline.data.position import DataPosition, IntervalSet, read_position
from pipeline.data.shards import check_shards, load_manifest, shard_dataset


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
    # Rows are shuffled within windows of this many consecutive corpus rows (0: stream order).
    shuffle_window: int = 0
    # coCondenser: a CoCondenserConfig (span_length, short_span_prob, min_span_length).
    # Set, the stream yields span pairs instead of sequences (see to_span_pairs).
    spans: Any = None


# -- examples ---------------------------------------------------------------------------


def _frame(chunks: list[np.ndarray], spec: StreamSpec) -> tuple[np.ndarray, np.ndarray]:
    return Framing.bert(spec.cls_id, spec.sep_id, spec.pad_id).frame(chunks, spec.max_len)


def window_order(rows: np.ndarray, seed: int, epoch: int, window: int) -> np.ndarray:
    """The epoch's order of a block's rows (indices into ``rows``): windows of ``window``
    consecutive corpus rows in turn, each shuffled by a hash of (seed, epoch, row).

    A corpus stored grouped by topic (MS MARCO keeps a query's candidates together) would
    otherwise fill coCondenser's batches with same-topic false negatives. The order is a
    function of the row ids alone, not of a shuffle buffer's state: a resumed stream, which
    lacks the rows consumed before, yields the rest exactly as the uninterrupted one does.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if window <= 0:
        return np.arange(len(rows))
    salt = _mix64(np.array([(seed * 1_000_003 + epoch) % 2**64], dtype=np.uint64))
    key = _mix64(rows.astype(np.uint64) ^ salt)
    return np.lexsort((key, rows // window))


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a well-spread 64-bit hash of each element."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _shard_examples(shard: dict, epoch, spec: StreamSpec, resume: dict) -> dict:
    return block_examples(shard, spec, int(epoch), **resume[int(epoch)])


def block_examples(batch: dict, spec: StreamSpec, epoch: int, consumed: list, opened: dict) -> dict:
    """One whole shard -> the epoch's examples: rows in the epoch's order, those
    a checkpoint consumed left out, a document it consumed in part resumed at its next
    token (``opened``: row -> tokens consumed). Whole shards, so that the order and the
    packing never depend on how Ray Data batched what was left after a resume."""
    order = window_order(batch["row"], spec.seed, epoch, spec.shuffle_window)
    batch = {k: v[order] for k, v in batch.items()}
    done = IntervalSet(consumed)
    if spec.spans is None:
        return to_sequences(batch, spec, epoch, done, opened)
    keep = ~done.contains(batch["row"])
    return to_span_pairs({k: v[keep] for k, v in batch.items()}, spec, epoch)


def to_sequences(
    batch: dict, spec: StreamSpec, epoch: int, consumed: IntervalSet | None = None, opened: dict | None = None
) -> dict:
    """Truncate each document, or pack consecutive documents, into max_len sequences.

    Packing joins documents with [SEP] and cuts the token stream every max_len - 2
    tokens, so long documents are used whole and short ones waste no padding. Each
    sequence lists the corpus rows whose last token it holds (``source_rows``: what the
    worker records as consumed) and the document it cuts, if any, with the tokens of it
    consumed through this sequence (``partial``: [row, tokens], row -1 for none).

    A [SEP] belongs to the document it introduces, so the documents of a block, the
    ``consumed`` ones left out and an ``opened`` one started at its next token, give the
    same stream from that point as the whole block: sequences consumed before a resume
    are cut exactly where the uninterrupted run cut them.
    """
    body = spec.max_len - 2
    consumed = consumed if consumed is not None else IntervalSet()
    opened = opened or {}
    rows, docs = np.asarray(batch["row"], dtype=np.int64), batch["input_ids"]
    left = ~consumed.contains(rows)
    chunks, sources, partial = [], [], []
    if not spec.pack:
        for row, ids in zip(rows[left], docs[left]):
            chunks.append(np.asarray(ids[:body], dtype=np.int32))
            sources.append(np.array([row], dtype=np.int64))
            partial.append((-1, 0))
    else:
        # Each document left is a piece of the block's token stream: its [SEP] (but the
        # block's first) and its tokens, from where a checkpoint left it (``offset``).
        pieces, piece_rows, offsets = [], [], []
        for i in np.flatnonzero(left):
            ids = np.asarray(docs[i], dtype=np.int32)
            piece = np.concatenate([np.array([spec.sep_id], dtype=np.int32), ids]) if i else ids
            offset = int(opened.get(int(rows[i]), 0))
            pieces.append(piece[offset:])
            piece_rows.append(rows[i])
            offsets.append(offset)
        piece_lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        ends = np.cumsum(piece_lengths)
        starts = ends - piece_lengths
        piece_rows, offsets = np.asarray(piece_rows, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
        cuts = np.minimum(np.arange(body, len(tokens) + body, body), len(tokens))
        # Piece k ends in the first sequence whose cut is at or after its end.
        finished_in = np.searchsorted(cuts, ends, side="left")
        for j, cut in enumerate(cuts):
            chunks.append(tokens[j * body : cut])
            sources.append(piece_rows[finished_in == j])
            k = np.searchsorted(ends, cut, side="right")  # the first piece still open at the cut
            if k < len(pieces) and starts[k] < cut:
                partial.append((piece_rows[k], offsets[k] + cut - starts[k]))
            else:
                partial.append((-1, 0))
    input_ids, lengths = _frame(chunks, spec)
    source_rows = np.empty(len(sources), dtype=object)
    source_rows[:] = sources
    return {
        "input_ids": input_ids,
        "length": lengths,
        "epoch": np.full(len(chunks), epoch, dtype=np.int32),
        "source_rows": source_rows,
        "partial": np.asarray(partial, dtype=np.int64).reshape(-1, 2),
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


# -- the dataset ------------------------------------------------------------------------


def epoch_files(manifest: dict, spec: StreamSpec, epoch: int, consumed: IntervalSet) -> list[dict]:
    """The shards an epoch still has to read, in this epoch's order (drawn over all shards,
    then the finished ones left out: a resumed epoch reads the rest in the same order)."""
    shards = manifest["shards"]
    if spec.shuffle_files:
        order = np.random.default_rng([spec.seed, epoch]).permutation(len(shards))
        shards = [shards[i] for i in order]
    return [s for s in shards if not consumed.covers(s["first_row"], s["first_row"] + s["rows"])]


def build_stream(spec: StreamSpec, position: DataPosition, manifest: dict | None = None):
    manifest = manifest or load_manifest(spec.corpus)
    items, resume = [], {}
    for epoch in range(spec.epochs):
        consumed = position.consumed(epoch)
        resume[epoch] = {"consumed": consumed.to_list(), "opened": position.opened(epoch)}
        items += [
            {"uri": storage.join(spec.corpus, s["path"]), "epoch": epoch}
            for s in epoch_files(manifest, spec, epoch, consumed)
        ]
    if items:
        return shard_dataset(items, _shard_examples, {"spec": spec, "resume": resume})
    # Everything consumed: an empty stream, so a resumed finished run just exports.
    shape = (2, spec.max_len) if spec.spans is not None else (spec.max_len,)
    row = {
        "input_ids": np.zeros(shape, np.int32),
        "length": np.zeros(shape[:-1], np.int32),
        "epoch": 0,
        "source_rows": np.zeros(0, np.int64),
    }
    if spec.spans is not None:
        row["skipped_docs"] = 0
    else:
        row["partial"] = np.array([-1, 0], np.int64)
    return ray.data.from_items([row]).limit(0)


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
