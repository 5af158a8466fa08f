"""Fine-tuning examples: each query with its group of passages, as token ids, per epoch.

Queries reference passages by id, and the passages live in the prepared corpus shards
(``pipeline/data/shards.py``). The join happens in Ray Data, so no worker ever holds the
corpus text:

1. The driver picks every query's group for the epoch (``select_group``: the positive
   rotates, the negatives slide through a per-query shuffle) and turns the passage ids
   into corpus rows. It knows ids only: an id index of the corpus, the groups and the
   query token ids (all broadcast through the object store).
2. A map over the corpus shards emits one ``(position, slot, passage ids)`` record per
   request of each passage it reads: a passage in many groups is emitted once per group.
3. One ``groupby(position)`` shuffle brings a group's passages together. ``position`` is
   the query's place in the epoch's seeded random order; the shuffle (a hash shuffle in
   Ray 2.60) may emit groups in another order, which is no less random.

Each example carries its query's example row as ``source_rows``, which is what the
trainer records as the data position, exactly as for pre-training sequences. Examples
with teacher scores (distillation) also carry ``d_teacher_scores``, the score of each
passage of the group, in slot order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import ray

from models.framing import Framing
from pipeline.core import storage
from pipeline.core.errors import InputError
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.examples import ExampleRows, TrainExample
from pipeline.data.groups import select_group_with_sources
from pipeline.data.position import read_position
from pipeline.data.shards import check_shards, load_manifest, shard_dataset
from pipeline.data.stream import configure_data_context


@dataclass(frozen=True)
class GroupSpec:
    corpus: str  # prepared corpus (tokenized with the retriever's tokenizer)
    group_size: int
    query_max_len: int
    passage_max_len: int
    seed: int
    framing: Framing  # the retriever's special tokens around each query and passage
    passage_prefix: tuple[int, ...] = ()  # the retriever's passage prefix, as token ids


@dataclass
class EpochGroups:
    """The driver's plan for one epoch, in the epoch's random order."""

    example_rows: np.ndarray  # (E,) which example sits at each position
    corpus_rows: np.ndarray  # (E, group_size) positive first
    teacher_scores: np.ndarray | None = None  # (E, group_size) float32, aligned with corpus_rows


def plan_epoch(
    examples: ExampleRows | list[TrainExample],
    epoch: int,
    spec: GroupSpec,
    corpus_ids: CorpusIds | None = None,
    skip_rows: np.ndarray | None = None,
    num_rows: int = 0,
) -> EpochGroups:
    """Every example's group for ``epoch`` (as corpus rows), in a seeded random order,
    leaving out the example rows in ``skip_rows`` (consumed before a resume).

    Examples are :class:`ExampleRows`, with ``num_rows`` the corpus size, or (with
    ``corpus_ids``) examples by passage id, looked up there.
    When the examples carry teacher scores, so does the plan, aligned with its groups.
    """
    if corpus_ids is not None:
        examples = ExampleRows.from_examples(examples, corpus_ids, spec.corpus)
        num_rows = len(corpus_ids)
    rng = np.random.default_rng([spec.seed, epoch])
    order = rng.permutation(len(examples))
    if skip_rows is not None and len(skip_rows):
        order = order[~np.isin(order, skip_rows)]
    # Queries without negatives draw from a seeded sample of the corpus.
    fallback = []
    if (np.diff(examples.negative_offsets)[order] == 0).any():
        fallback = rng.choice(num_rows, size=min(1000, num_rows), replace=False).tolist()
    scored = examples.scores is not None
    groups = np.zeros((len(order), spec.group_size), dtype=np.int64)
    teacher = np.zeros((len(order), spec.group_size), dtype=np.float32) if scored else None
    for position, row in enumerate(order):
        example = examples[row]
        groups[position], sources = select_group_with_sources(example, epoch, spec.group_size, spec.seed, fallback)
        if teacher is not None:
            if (sources < 0).any():
                raise InputError(
                    f"query {example.query_id!r} has no negatives: random fallback passages have no teacher score"
                )
            teacher[position] = np.asarray(example.scores)[sources]
    return EpochGroups(order.astype(np.int64), groups, teacher)


_RESOLVED: dict[str, object] = {}


def _resolved(value):
    """Ray Data passes fn_kwargs as given: the plan travels as object refs (put once, not
    pickled into every task), fetched here once per worker process and kept (the UDF runs
    once per group: a fetch per call would deserialize the whole plan each time)."""

    if not isinstance(value, ray.ObjectRef):
        return value
    key = value.hex()
    if key not in _RESOLVED:
        if len(_RESOLVED) >= 8:  # plans of earlier epochs
            _RESOLVED.clear()
        _RESOLVED[key] = ray.get(value)
    return _RESOLVED[key]


def _emit_requests(batch: dict, requests) -> dict:
    """For the corpus rows of this batch, one record per (position, slot) that needs them."""
    requests = _resolved(requests)
    targets_row, targets_pos, targets_slot = requests["row"], requests["position"], requests["slot"]
    lo = np.searchsorted(targets_row, batch["row"], side="left")
    hi = np.searchsorted(targets_row, batch["row"], side="right")
    counts = hi - lo
    take = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if counts.sum() else np.zeros(0, np.int64)
    source = np.repeat(np.arange(len(batch["row"])), counts)
    passages = np.empty(len(take), dtype=object)
    passages[:] = [batch["input_ids"][i] for i in source]
    return {"position": targets_pos[take], "slot": targets_slot[take], "input_ids": passages}


def _assemble(group: dict, spec: GroupSpec, plan, query_ids) -> dict:
    plan, query_ids = _resolved(plan), _resolved(query_ids)
    key = int(group["position"][0])  # the group's place in the whole stream
    epoch, position = int(plan["epochs"][key]), int(plan["positions"][key])
    if len(group["slot"]) != spec.group_size:
        raise RuntimeError(
            f"group at position {position} of epoch {epoch} has {len(group['slot'])} passages, "
            f"expected {spec.group_size}"
        )
    in_slot_order = np.argsort(group["slot"])
    passages, lengths = spec.framing.frame_truncated(
        [group["input_ids"][i] for i in in_slot_order], spec.passage_max_len, spec.passage_prefix
    )
    example_row = int(plan["example_rows"][key])
    query, query_length = spec.framing.frame_truncated([query_ids[example_row]], spec.query_max_len)
    source_rows = np.empty(1, dtype=object)
    source_rows[0] = np.array([example_row], dtype=np.int64)
    out = {
        "q_input_ids": query,
        "q_length": query_length,
        "d_input_ids": passages[None],
        "d_length": lengths[None],
        "position": np.array([position], np.int64),
        "epoch": np.array([epoch], np.int32),
        "source_rows": source_rows,
    }
    if plan.get("teacher_scores") is not None:
        out["d_teacher_scores"] = plan["teacher_scores"][key][None]  # planned in slot order
    return out


def passage_requests(plan: EpochGroups) -> dict[str, np.ndarray]:
    """Every (position, slot) of the plan, sorted by the corpus row that fills it, so that a
    corpus batch finds its requests by binary search (:func:`_emit_requests`)."""
    n = plan.corpus_rows.shape[1]
    flat = plan.corpus_rows.reshape(-1)
    order = np.argsort(flat, kind="stable")
    return {
        "row": flat[order],
        "position": (np.arange(flat.size) // n)[order],
        "slot": (np.arange(flat.size) % n)[order],
    }


def build_epochs(spec: GroupSpec, plans: list[tuple[int, EpochGroups]], query_ids: list, manifest: dict | None = None):
    """The Ray Dataset of the given epochs' groups, one row per planned position, epoch after
    epoch in their planned order: one groupby over a key running through every epoch (a
    union of per-epoch datasets does not keep their order), and each shard read once."""

    manifest = manifest or load_manifest(spec.corpus)
    whole = EpochGroups(
        np.concatenate([p.example_rows for _, p in plans]),
        np.concatenate([p.corpus_rows for _, p in plans]),
        None if plans[0][1].teacher_scores is None else np.concatenate([p.teacher_scores for _, p in plans]),
    )
    requests = passage_requests(whole)
    needed = np.unique(requests["row"])
    shards = [
        s
        for s in manifest["shards"]  # a shard no group needs is not read at all
        if np.any((needed >= s["first_row"]) & (needed < s["first_row"] + s["rows"]))
    ]
    requests_ref, queries_ref = ray.put(requests), ray.put(query_ids)
    plan_ref = ray.put(
        {
            "example_rows": whole.example_rows,
            "teacher_scores": whole.teacher_scores,
            "epochs": np.concatenate([np.full(len(p.example_rows), e, np.int32) for e, p in plans]),
            "positions": np.concatenate([np.arange(len(p.example_rows)) for _, p in plans]),
        }
    )
    items = [{"uri": storage.join(spec.corpus, s["path"])} for s in shards]
    ds = shard_dataset(items, _emit_requests, {"requests": requests_ref})
    # Ray's default of 200 shuffle partitions costs more than the shuffle itself at this size
    # (a 4,434-query epoch: 22 s with 200, 15 s with 1, on 2 cores).
    partitions = max(1, min(32, len(whole.example_rows) // 10_000 + 1))
    return ds.groupby("position", num_partitions=partitions).map_groups(
        _assemble, fn_kwargs={"spec": spec, "plan": plan_ref, "query_ids": queries_ref}, batch_format="numpy"
    )


class GroupStream:
    """The fine-tuning ``train`` datasets handed to Ray Train, one per epoch (:attr:`parts`),
    which the trainer reads one after another.

    Like :class:`pipeline.data.stream.TrainingStream`, each part is built at every start
    (first start, restart after a failure, re-run of the job) from the data position of the
    checkpoint Ray Train will restore, leaving out the example rows it consumed. An epoch's
    join of groups to passages (a Ray Data groupby, an all-to-all) runs when the trainer
    starts reading that epoch, so a start or restart waits for one epoch's join, however many
    epochs remain. It holds ids only: examples as corpus rows (:class:`ExampleRows`), and the
    query token ids.
    """

    def __init__(
        self, spec: GroupSpec, examples: ExampleRows, query_ids: list, epochs: int, num_rows: int, run_dir: str
    ):
        self.spec, self.examples, self.query_ids = spec, examples, query_ids
        self.epochs, self.num_rows, self.run_dir = epochs, num_rows, run_dir

    @property
    def parts(self) -> list:
        """One dataset factory per epoch, in epoch order."""
        return [functools.partial(self.epoch, epoch) for epoch in range(self.epochs)]

    def epoch(self, epoch: int):
        """The Ray Dataset of ``epoch``'s groups not yet consumed, in their planned order (an
        empty one when the position has them all)."""
        configure_data_context()
        manifest = load_manifest(self.spec.corpus)
        check_shards(self.spec.corpus, manifest)
        consumed = read_position(self.run_dir)[0].consumed(epoch)
        skip = np.flatnonzero(consumed.contains(np.arange(len(self.examples)))) if consumed.count() else None
        plan = plan_epoch(self.examples, epoch, self.spec, skip_rows=skip, num_rows=self.num_rows)
        if len(plan.example_rows):
            return build_epochs(self.spec, [(epoch, plan)], self.query_ids, manifest)
        g, lq, ld = self.spec.group_size, self.spec.query_max_len, self.spec.passage_max_len
        row = {
            "q_input_ids": np.zeros(lq, np.int32),
            "q_length": 0,
            "d_input_ids": np.zeros((g, ld), np.int32),
            "d_length": np.zeros(g, np.int32),
            "position": 0,
            "epoch": 0,
            "source_rows": np.zeros(0, np.int64),
        }
        if self.examples.scores is not None:
            row["d_teacher_scores"] = np.zeros(g, np.float32)
        return ray.data.from_items([row]).limit(0)
