"""The data position of a training run: which corpus rows each epoch has consumed.

Workers receive blocks of rows from Ray Data's streaming split in no fixed order, so
"how far we got" is not a single offset. It is a set of row ids per epoch, kept as
merged half-open intervals: a worker consumes whole blocks in order, so the union
over all workers is one long prefix plus a few islands, however big the corpus.
"""

from __future__ import annotations

import re
import sys

import numpy as np

from pipeline.core import sealed, storage
from pipeline.core.errors import ArtifactError, StorageError


class IntervalSet:
    """A set of non-negative integers stored as sorted, disjoint, non-adjacent [start, end)."""

    def __init__(self, intervals=None):
        arr = np.asarray(intervals if intervals is not None else [], dtype=np.int64).reshape(-1, 2)
        self._iv = _merge(arr)

    @classmethod
    def from_rows(cls, rows) -> "IntervalSet":
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if rows.size == 0:
            return cls()
        breaks = np.nonzero(np.diff(rows) != 1)[0]
        starts = np.concatenate([rows[:1], rows[breaks + 1]])
        ends = np.concatenate([rows[breaks], rows[-1:]]) + 1
        return cls(np.stack([starts, ends], axis=1))

    def union(self, other: "IntervalSet") -> "IntervalSet":
        return IntervalSet(np.concatenate([self._iv, other._iv]))

    def add_rows(self, rows) -> None:
        self._iv = _merge(np.concatenate([self._iv, IntervalSet.from_rows(rows)._iv]))

    def contains(self, rows) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if not len(self._iv):
            return np.zeros(rows.shape, dtype=bool)
        idx = np.searchsorted(self._iv[:, 0], rows, side="right") - 1
        ok = idx >= 0
        inside = np.zeros(rows.shape, dtype=bool)
        inside[ok] = rows[ok] < self._iv[idx[ok], 1]
        return inside

    def covers(self, start: int, end: int) -> bool:
        """Whether every integer in [start, end) is in the set."""
        if end <= start:
            return True
        idx = np.searchsorted(self._iv[:, 0], start, side="right") - 1
        return idx >= 0 and self._iv[idx, 1] >= end

    def count(self) -> int:
        return int((self._iv[:, 1] - self._iv[:, 0]).sum())

    def difference_count(self, other: "IntervalSet") -> int:
        """How many members of self are not in other."""
        return self.count() - _intersection_count(self._iv, other._iv)

    def to_list(self) -> list[list[int]]:
        return self._iv.tolist()

    def __eq__(self, other) -> bool:
        return isinstance(other, IntervalSet) and np.array_equal(self._iv, other._iv)

    def __repr__(self) -> str:
        return f"IntervalSet({self.to_list()})"


def _merge(iv: np.ndarray) -> np.ndarray:
    if len(iv) == 0:
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    ends_so_far = np.maximum.accumulate(iv[:, 1])
    new_group = np.ones(len(iv), dtype=bool)
    new_group[1:] = iv[1:, 0] > ends_so_far[:-1]  # adjacent intervals (start == end) merge
    group = np.cumsum(new_group) - 1
    starts = iv[new_group, 0]
    ends = np.zeros(len(starts), dtype=np.int64)
    np.maximum.at(ends, group, iv[:, 1])
    return np.stack([starts, ends], axis=1)


def _intersection_count(a: np.ndarray, b: np.ndarray) -> int:
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        total += max(0, hi - lo)
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return int(total)


class DataPosition:
    """Consumed rows per epoch, and the documents a packed sequence cut part-way (opened:
    row -> tokens consumed), which a resumed stream starts at their next token."""

    def __init__(self, epochs: dict[int, IntervalSet] | None = None, opened: dict[int, dict[int, int]] | None = None):
        self.epochs: dict[int, IntervalSet] = dict(epochs or {})
        self._opened: dict[int, dict[int, int]] = {e: dict(d) for e, d in (opened or {}).items()}

    def add(self, epoch: int, rows, opened=()) -> None:
        """``rows`` finished in ``epoch``; ``opened``: (row, tokens consumed) of documents begun."""
        epoch = int(epoch)
        done = self.epochs.setdefault(epoch, IntervalSet())
        done.add_rows(rows)
        begun = self._opened.setdefault(epoch, {})
        for row, tokens in opened:
            begun[int(row)] = max(begun.get(int(row), 0), int(tokens))
        self._close_finished(epoch)

    def _close_finished(self, epoch: int) -> None:
        begun = self._opened.get(epoch)
        if begun:
            finished = self.consumed(epoch).contains(list(begun))
            self._opened[epoch] = {row: n for (row, n), gone in zip(begun.items(), finished) if not gone}

    def consumed(self, epoch: int) -> IntervalSet:
        return self.epochs.get(int(epoch), IntervalSet())

    def opened(self, epoch: int) -> dict[int, int]:
        return dict(self._opened.get(int(epoch), {}))

    def merge(self, other: "DataPosition") -> "DataPosition":
        out = DataPosition(self.epochs, self._opened)
        for epoch in set(other.epochs) | set(other._opened):
            out.epochs[epoch] = out.consumed(epoch).union(other.consumed(epoch))
            out.add(epoch, [], other.opened(epoch).items())
        return out

    def to_json(self) -> dict:
        return {
            "epochs": {str(e): iv.to_list() for e, iv in sorted(self.epochs.items())},
            "opened": {str(e): sorted(d.items()) for e, d in sorted(self._opened.items()) if d},
        }

    @classmethod
    def from_json(cls, data: dict) -> "DataPosition":
        data = data or {}
        return cls(
            {int(e): IntervalSet(iv) for e, iv in data.get("epochs", {}).items()},
            {int(e): {int(r): int(n) for r, n in pairs} for e, pairs in data.get("opened", {}).items()},
        )

    def count(self) -> int:
        return sum(iv.count() for iv in self.epochs.values())

    def difference_count(self, other: "DataPosition") -> int:
        return sum(iv.difference_count(other.consumed(e)) for e, iv in self.epochs.items())


# -- the data position of a run's checkpoints, on storage ------------------------------

POINTER = "data_position.json"


def write_pointer(run_dir: str, checkpoint_dir: str, step: int) -> None:
    """Record which checkpoint the next stream should resume from (rank 0, after report)."""
    storage.write_json(storage.join(run_dir, POINTER), {"checkpoint": checkpoint_dir, "step": step})


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)(-r\d+)?$")


def registered_checkpoint(run_dir: str) -> str | None:
    """The newest checkpoint Ray Train registered (None: none yet).

    Ray Train's controller persists its checkpoint registry (``checkpoint_manager_snapshot.json``)
    when it *registers* a checkpoint, which can lag behind the workers' report. That file,
    not our pointer, names what ``ray.train.get_checkpoint()`` would return. The pointer
    (written by rank 0 after each report) is the fallback for a Ray version whose snapshot
    we cannot read.
    """
    snapshot_uri = storage.join(run_dir, RAY_SNAPSHOT)
    if storage.exists(snapshot_uri):
        try:
            latest = storage.read_json(snapshot_uri).get("latest_checkpoint_result")
            return latest["checkpoint_dir_name"] if latest else None
        except (StorageError, KeyError, TypeError, AttributeError):
            pass
    pointer_uri = storage.join(run_dir, POINTER)
    if storage.exists(pointer_uri):
        return storage.read_json(pointer_uri)["checkpoint"]
    return None


def restorable_checkpoint(run_dir: str, warn: bool = False) -> str | None:
    """The checkpoint the next start resumes from: the newest registered one when it is whole
    (sealed, every file there at its size: :mod:`pipeline.core.sealed`), else the newest
    earlier one that is; ``warn`` (the driver, once) names each passed over. The stream and
    every worker call this, so the model and the data position come from the same checkpoint."""
    latest = registered_checkpoint(run_dir)
    if latest is None:
        return None
    folders = checkpoint_folders(run_dir)
    step = checkpoint_step(latest)
    earlier = sorted((n for n in folders if n != latest and checkpoint_step(n) <= step), key=checkpoint_order)
    candidates = [latest] + earlier[::-1]
    for name in candidates:
        problem = sealed.damage(storage.join(run_dir, name), folders[name]) if name in folders else "gone"
        if problem is None:
            return name
        if warn:
            state = "is gone" if name not in folders else f"is not whole ({problem})"
            _warn_once(f"warning: checkpoint {storage.join(run_dir, name)} {state}: passed over")
    raise ArtifactError(
        f"{run_dir}: no whole checkpoint to resume from ({', '.join(candidates)} are damaged); "
        f"delete {run_dir} to train from the start"
    )


def checkpoint_folders(run_dir: str) -> dict[str, dict[str, int]]:
    """Every checkpoint folder of the run: its files' sizes, from one listing."""
    folders: dict[str, dict[str, int]] = {}
    for rel, size in storage.file_sizes(run_dir).items():
        head, _, rest = rel.partition("/")
        if rest and CHECKPOINT_NAME.match(head):
            folders.setdefault(head, {})[rest] = size
    return folders


def checkpoint_step(name: str) -> int:
    match = CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else -1


def checkpoint_order(name: str) -> tuple[int, int]:
    """Step, then the attempt that wrote it (``-r<n>``: saved again after a fallback)."""
    match = CHECKPOINT_NAME.match(name)
    return checkpoint_step(name), int(match.group(2)[2:]) if match and match.group(2) else 0


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(message, file=sys.stderr, flush=True)


def read_checkpoint_position(checkpoint_uri: str) -> DataPosition:
    """The merged position of every rank saved in one checkpoint folder."""
    files = [
        f
        for f in storage.list_files(checkpoint_uri, ".json")
        if f.replace("\\", "/").rsplit("/", 1)[-1].startswith("position_rank")
    ]
    if not files:
        raise StorageError(f"{checkpoint_uri}: checkpoint holds no position files")
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
