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

from dataclasses import dataclass

import numpy as np

from pipeline import storage
from pipeline.position import DataPosition, IntervalSet
from pipeline.shards import check_shards, load_manifest

POINTER = "data_position.json"


@dataclass(frozen=True)
class StreamSpec:
    corpus: str            # prepared corpus folder (local or s3://)
    max_len: int
    pack: bool
    epochs: int
    seed: int
    shuffle_files: bool
    cls_id: int
    sep_id: int
    pad_id: int
    run_dir: str           # where the trainer's checkpoints and the position pointer live


# -- data position on storage ---------------------------------------------------------

def write_pointer(run_dir: str, checkpoint_dir: str, step: int) -> None:
    """Record which checkpoint the next stream should resume from (rank 0, after report)."""
    storage.write_json(storage.join(run_dir, POINTER), {"checkpoint": checkpoint_dir, "step": step})


def read_position(run_dir: str) -> tuple[DataPosition, int]:
    """The merged position of every rank in the pointed checkpoint, and its step."""
    pointer_uri = storage.join(run_dir, POINTER)
    if not storage.exists(pointer_uri):
        return DataPosition(), 0
    pointer = storage.read_json(pointer_uri)
    position = DataPosition()
    ckpt = storage.join(run_dir, pointer["checkpoint"])
    files = [f for f in storage.list_files(ckpt, ".json") if "/position_rank" in f.replace("\\", "/")]
    if not files:
        raise storage.StorageError(f"{ckpt}: the checkpoint named by {pointer_uri} holds no position files")
    for uri in files:
        position = position.merge(DataPosition.from_json(storage.read_json(uri)))
    return position, int(pointer["step"])


# -- examples ---------------------------------------------------------------------------

def _frame(chunks: list[np.ndarray], spec: StreamSpec) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] chunk [SEP] + padding, as an (N, max_len) int32 array, and the lengths."""
    out = np.full((len(chunks), spec.max_len), spec.pad_id, dtype=np.int32)
    lengths = np.zeros(len(chunks), dtype=np.int32)
    for i, chunk in enumerate(chunks):
        n = len(chunk) + 2
        out[i, 0] = spec.cls_id
        out[i, 1:n - 1] = chunk
        out[i, n - 1] = spec.sep_id
        lengths[i] = n
    return out, lengths


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
    else:
        buf: list[int] = []
        buf_rows: list[int] = []
        for row, ids in zip(rows, docs):
            ids = list(ids)
            if buf:
                buf.append(spec.sep_id)
            buf_rows.append(int(row))
            buf.extend(ids)
            while len(buf) >= body:
                chunks.append(np.asarray(buf[:body], dtype=np.int32))
                sources.append(np.asarray(buf_rows, dtype=np.int64))
                buf = buf[body:]
                # The document whose tokens cross the cut continues in the next sequence.
                # Before this document was added the buffer held fewer than `body` tokens,
                # so whatever is left after the cut belongs to this document alone.
                buf_rows = [int(row)] if buf else []
        if buf:
            chunks.append(np.asarray(buf, dtype=np.int32))
            sources.append(np.asarray(buf_rows, dtype=np.int64))
    input_ids, lengths = _frame(chunks, spec)
    source_rows = np.empty(len(sources), dtype=object)
    source_rows[:] = sources
    return {"input_ids": input_ids, "length": lengths,
            "epoch": np.full(len(chunks), epoch, dtype=np.int32), "source_rows": source_rows}


def drop_consumed(batch: dict, consumed: list[list[int]]) -> dict:
    keep = ~IntervalSet(consumed).contains(batch["row"])
    return {k: v[keep] for k, v in batch.items()}


# -- the dataset ------------------------------------------------------------------------

def epoch_files(manifest: dict, spec: StreamSpec, epoch: int, consumed: IntervalSet) -> list[dict]:
    """The shards an epoch still has to read, in this epoch's order."""
    shards = [s for s in manifest["shards"]
              if not consumed.covers(s["first_row"], s["first_row"] + s["rows"])]
    if spec.shuffle_files:
        order = np.random.default_rng([spec.seed, epoch]).permutation(len(shards))
        shards = [shards[i] for i in order]
    return shards


def build_stream(spec: StreamSpec, position: DataPosition, manifest: dict | None = None):
    import ray

    manifest = manifest or load_manifest(spec.corpus)
    fs_loc = storage.resolve(spec.corpus)
    parts = []
    for epoch in range(spec.epochs):
        consumed = position.consumed(epoch)
        shards = epoch_files(manifest, spec, epoch, consumed)
        if not shards:
            continue
        paths = [storage.resolve(storage.join(spec.corpus, s["path"])).path for s in shards]
        ds = ray.data.read_parquet(paths, filesystem=fs_loc.fs, columns=["row", "input_ids"],
                                   shuffle=None)
        if consumed.count():
            ds = ds.map_batches(drop_consumed, fn_kwargs={"consumed": consumed.to_list()},
                                batch_format="numpy", zero_copy_batch=True)
        parts.append(ds.map_batches(to_sequences, fn_kwargs={"spec": spec, "epoch": epoch},
                                    batch_format="numpy"))
    if not parts:  # everything consumed: an empty stream, so a resumed finished run just exports
        return ray.data.from_items([{"input_ids": np.zeros(spec.max_len, np.int32), "length": 0,
                                     "epoch": 0, "source_rows": np.zeros(0, np.int64)}]).limit(0)
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


class TrainingStream:
    """The callable handed to Ray Train as the ``train`` dataset (see module docstring)."""

    def __init__(self, spec: StreamSpec):
        self.spec = spec

    def __call__(self):
        manifest = load_manifest(self.spec.corpus)
        check_shards(self.spec.corpus, manifest)
        position, _ = read_position(self.spec.run_dir)
        return build_stream(self.spec, position, manifest)


def estimate_sequences_per_epoch(manifest: dict, max_len: int, pack: bool) -> int:
    """Sequences one epoch yields (exact for truncation, close for packing)."""
    if not pack:
        return manifest["num_docs"]
    return int(np.ceil((manifest["num_tokens"] + manifest["num_docs"]) / (max_len - 2)))
