"""Fine-tuning groups joined to corpus passages in Ray Data, against the driver's plan."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import synthetic_docs, write_jsonl

from models.framing import Framing
from pipeline.core import sealed, storage
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.examples import TrainExample
from pipeline.data.group_stream import (
    GroupSpec,
    build_epochs,
    plan_epoch,
)
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from tests.helpers import SEAL_KEY

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_ray):
    root = tmp_path_factory.mktemp("groups")
    docs = synthetic_docs(90, seed=7)
    cfg = PrepareConfig(
        input=write_jsonl(root / "raw.jsonl", docs), output=str(root / "corpus"), vocab_size=120, docs_per_shard=25
    )
    manifest = prepare_corpus(cfg).manifest
    tokens = {}
    for shard in manifest["shards"]:
        table = storage.read_parquet(storage.join(cfg.output, shard["path"]))
        tokens.update(zip(table.column("doc_id").to_pylist(), table.column("input_ids").to_pylist()))
    return cfg.output, manifest, tokens


def test_every_group_holds_exactly_its_planned_passages_in_the_planned_order(corpus):
    uri, manifest, tokens = corpus
    rng = np.random.default_rng(0)
    ids = sorted(tokens)
    examples = []
    for q in range(30):
        picked = list(rng.choice(ids, size=8, replace=False))
        examples.append(TrainExample(f"q{q}", "", positives=picked[:2], negatives=picked[2:] if q % 5 else []))
    query_ids = [np.arange(q + 1, dtype=np.int32) + 10 for q in range(30)]
    spec = GroupSpec(
        corpus=uri,
        group_size=4,
        query_max_len=12,
        passage_max_len=16,
        seed=3,
        framing=Framing.bert(2, 3, 0),
        passage_prefix=(7, 8),  # the retriever's passage prefix, as token ids
    )
    corpus_ids = CorpusIds.read(uri, manifest["shards"])
    id_by_row = dict(enumerate(corpus_ids.ids(np.arange(len(corpus_ids)))))
    plan = plan_epoch(examples, epoch=1, spec=spec, corpus_ids=corpus_ids, skip_rows=np.array([4, 9]))
    assert sorted(plan.example_rows.tolist()) == [r for r in range(30) if r not in (4, 9)]

    out = build_epochs(spec, [(1, plan)], query_ids, manifest=manifest).take_all()
    assert sorted(r["position"] for r in out) == list(range(28))  # every planned query exactly once
    for r in out:
        position = r["position"]
        example_row = int(r["source_rows"][0])
        assert example_row == plan.example_rows[position]
        assert r["epoch"] == 1
        (expected_q,), (q_len,) = spec.framing.frame_truncated([query_ids[example_row]], 12)
        assert r["q_input_ids"].tolist() == expected_q.tolist() and r["q_length"] == q_len
        for slot in range(4):
            doc = id_by_row[int(plan.corpus_rows[position, slot])]
            framed = [2, 7, 8, *tokens[doc]][:15] + [3]  # [CLS] prefix passage, cut to 16 with [SEP]
            want = framed + [0] * (16 - len(framed))
            assert r["d_input_ids"][slot].tolist() == want and r["d_length"][slot] == len(framed)
        ex = examples[example_row]
        assert id_by_row[int(plan.corpus_rows[position, 0])] in ex.positives
        negatives = {id_by_row[int(x)] for x in plan.corpus_rows[position, 1:]}
        assert not negatives & set(ex.positives)
        if ex.negatives:
            assert negatives <= set(ex.negatives)


def test_a_passage_missing_from_the_corpus_is_a_clear_error(corpus):
    uri, manifest, _ = corpus
    spec = GroupSpec(
        corpus=uri, group_size=2, query_max_len=8, passage_max_len=8, seed=0, framing=Framing.bert(2, 3, 0)
    )
    examples = [TrainExample("qx", "", positives=["nope"], negatives=["d1"])]
    with pytest.raises(ValueError, match="passage 'nope' is not in the corpus"):
        plan_epoch(examples, 0, spec, CorpusIds.read(uri, manifest["shards"]))


def test_the_stream_keeps_the_planned_order_across_epochs_and_resumes_with_the_rest(corpus, tmp_path):
    """Every epoch's groups come in their planned order, epochs one after another, and the
    stream rebuilt from a checkpoint's position is the rest of the whole one (what makes a
    resumed fine-tuning run equal an uninterrupted one)."""
    from pipeline.data.examples import ExampleRows
    from pipeline.data.group_stream import GroupStream
    from pipeline.data.position import DataPosition, write_pointer

    uri, manifest, tokens = corpus
    ids = sorted(tokens)
    examples = [TrainExample(f"q{q}", "", [ids[q]], [ids[(q + k) % len(ids)] for k in range(1, 5)]) for q in range(20)]
    spec = GroupSpec(
        corpus=uri, group_size=3, query_max_len=8, passage_max_len=12, seed=5, framing=Framing.bert(2, 3, 0)
    )
    corpus_ids = CorpusIds.read(uri, manifest["shards"])
    rows = ExampleRows.from_examples(examples, corpus_ids)
    queries = [np.arange(q + 1, dtype=np.int32) + 10 for q in range(20)]
    run_dir = str(tmp_path / "run")

    def stream():
        parts = GroupStream(spec, rows, queries, 3, len(corpus_ids), run_dir).parts
        return [row for part in parts for row in part().take_all()]

    whole = stream()
    order = [(int(r["epoch"]), int(r["position"])) for r in whole]
    assert order == [(e, p) for e in range(3) for p in range(20)]
    taken = 27  # into the second epoch
    position = DataPosition()
    for r in whole[:taken]:
        position.add(int(r["epoch"]), r["source_rows"])
    storage.write_json(storage.join(run_dir, "checkpoint_000000009", "position_rank0.json"), position.to_json())
    sealed.seal(storage.join(run_dir, "checkpoint_000000009"), "rank0", SEAL_KEY)
    write_pointer(run_dir, "checkpoint_000000009", 9)
    rest = stream()
    # Each epoch is its own dataset, joining only that epoch's groups: what a start or a
    # restart waits for before its first batch is one epoch's join, not every remaining
    # epoch's (the whole stream as one dataset joined all 60 groups first). After the
    # resume, the first epoch's dataset is empty and the second holds its 13 groups left.
    parts = GroupStream(spec, rows, queries, 3, len(corpus_ids), run_dir).parts
    assert [part().count() for part in parts] == [0, 13, 20]
    assert [int(r["source_rows"][0]) for r in rest] == [int(r["source_rows"][0]) for r in whole[taken:]]
    assert all(np.array_equal(a["d_input_ids"], b["d_input_ids"]) for a, b in zip(rest, whole[taken:]))


def test_epochs_read_one_after_another_are_batched_as_one_stream():
    """Epochs of 7 and 5 rows read as two parts give the micro-batches of one 12-row stream:
    the first epoch's last row shares a batch with the next epoch's first two (the parts
    yield 3, 3, 1 and 3, 2), ragged columns included. Mutation: batching each part apart
    gives 3, 3, 1, 3, 2."""
    from pipeline.training.batches import chained

    def part(epoch: int, rows: int, sizes: list[int]):
        def batches():
            start = 0
            for size in sizes:
                ids = np.arange(start, start + size)
                tokens = np.empty(size, dtype=object)
                tokens[:] = [np.arange(i % 4 + 1) for i in ids]
                yield {"epoch": np.full(size, epoch), "row": ids, "tokens": tokens}
                start += size
            assert start == rows

        return batches

    out = list(chained([part(0, 7, [3, 3, 1]), part(1, 5, [3, 2])], 3))
    assert [len(b["row"]) for b in out] == [3, 3, 3, 3]
    assert [(int(e), int(r)) for b in out for e, r in zip(b["epoch"], b["row"])] == [(0, r) for r in range(7)] + [
        (1, r) for r in range(5)
    ]
    assert [len(t) for b in out for t in b["tokens"]] == [r % 4 + 1 for r in range(7)] + [r % 4 + 1 for r in range(5)]
