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


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def restorable_checkpoint(run_dir: str) -> str | None:
    """The checkpoint Ray Train will hand the workers on their next start (None: none yet).

    Ray Train's controller persists its checkpoint registry (``checkpoint_manager_snapshot.json``)
    when it *registers* a checkpoint, which can lag behind the workers' report. That file,
    not our pointer, names what ``ray.train.get_checkpoint()`` will return, so the stream
    follows it. The pointer (written by rank 0 after each report) is the fallback for a Ray
    version whose snapshot we cannot read.
    """
    snapshot_uri = storage.join(run_dir, RAY_SNAPSHOT)
    if storage.exists(snapshot_uri):
        try:
            latest = storage.read_json(snapshot_uri).get("latest_checkpoint_result")
            return latest["checkpoint_dir_name"] if latest else None
        except (storage.StorageError, KeyError, TypeError, AttributeError):
            pass
    pointer_uri = storage.join(run_dir, POINTER)
    if storage.exists(pointer_uri):
        return storage.read_json(pointer_uri)["checkpoint"]
    return None


def read_checkpoint_position(checkpoint_uri: str) -> DataPosition:
    """The merged position of every rank saved in one checkpoint folder."""
    files = [f for f in storage.list_files(checkpoint_uri, ".json")
             if f.replace("\\", "/").rsplit("/", 1)[-1].startswith("position_rank")]
    if not files:
        raise storage.StorageError(f"{checkpoint_uri}: checkpoint holds no position files")
    position = DataPosition()
    for uri in files:
        position = position.merge(DataPosition.from_json(storage.read_json(uri)))
    return position


def read_position(run_dir: str) -> tuple[DataPosition, str | None]:
    """The data position the next stream resumes from, and the checkpoint it belongs to."""
    name = restorable_checkpoint(run_dir)
    if name is None:
        return DataPosition(), None
    return read_checkpoint_position(storage.join(run_dir, name)), name


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
            chunks.append(tokens[start:start + body])
            rows_here = np.unique(owner[start:start + body])
            sources.append(rows_here[rows_here >= 0])
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
        ds = ray.data.read_parquet(paths, filesystem=fs_loc.fs, shuffle=None).select_columns(["row", "input_ids"])
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
