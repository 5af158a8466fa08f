"""Examples from shards (packing/truncation), the data position, and resumable streams."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipeline.core import storage
from pipeline.data.position import (
    DataPosition,
    IntervalSet,
    read_position,
    write_pointer,
)
from pipeline.data.stream import StreamSpec, build_stream, to_sequences

CLS, SEP, PAD = 2, 3, 0


def spec(max_len=8, pack=True, epochs=1, run_dir="/nonexistent"):
    return StreamSpec(
        corpus="",
        max_len=max_len,
        pack=pack,
        epochs=epochs,
        seed=0,
        shuffle_files=False,
        cls_id=CLS,
        sep_id=SEP,
        pad_id=PAD,
        run_dir=run_dir,
    )


def docs_batch(lengths, first_row=0):
    docs = np.empty(len(lengths), dtype=object)
    docs[:] = [np.arange(100 * (i + 1), 100 * (i + 1) + n, dtype=np.int32) for i, n in enumerate(lengths)]
    return {"row": np.arange(first_row, first_row + len(lengths), dtype=np.int64), "input_ids": docs}


def bodies(out):
    return [list(ids[1 : n - 1]) for ids, n in zip(out["input_ids"], out["length"])]


def test_truncate_frames_one_document_per_sequence():
    batch = docs_batch([3, 10, 6])
    out = to_sequences(batch, spec(max_len=8, pack=False), epoch=5)
    assert out["input_ids"].shape == (3, 8)
    assert out["length"].tolist() == [5, 8, 8]
    assert out["input_ids"][0].tolist() == [CLS, 100, 101, 102, SEP, PAD, PAD, PAD]
    assert bodies(out)[1] == list(range(200, 206))  # first max_len - 2 tokens kept
    assert [list(r) for r in out["source_rows"]] == [[0], [1], [2]]
    assert out["epoch"].tolist() == [5, 5, 5]


def test_packing_keeps_every_token_in_order_and_tracks_sources():
    lengths = [3, 10, 1, 6, 2]
    batch = docs_batch(lengths, first_row=40)
    out = to_sequences(batch, spec(max_len=8, pack=True), epoch=0)
    # Every sequence but the last is full; bodies concatenated give the docs joined by [SEP].
    assert all(n == 8 for n in out["length"][:-1])
    joined = [t for body in bodies(out) for t in body]
    expected = []
    for ids in batch["input_ids"]:
        if expected:
            expected.append(SEP)
        expected.extend(ids.tolist())
    assert joined == expected
    # A sequence lists exactly the documents whose tokens it holds.
    owner = {}
    for row, ids in zip(batch["row"], batch["input_ids"]):
        owner.update({int(t): int(row) for t in ids})
    for body, sources in zip(bodies(out), out["source_rows"]):
        assert sorted({owner[t] for t in body if t != SEP}) == sorted(sources.tolist())


def test_interval_set_matches_python_sets():
    rng = random.Random(7)
    for _ in range(50):
        a_rows = {rng.randrange(200) for _ in range(rng.randrange(120))}
        b_rows = {rng.randrange(200) for _ in range(rng.randrange(120))}
        a = IntervalSet.from_rows(sorted(a_rows))
        b = IntervalSet()
        b.add_rows(list(b_rows))
        probe = np.arange(-5, 210)
        assert a.contains(probe).tolist() == [int(p) in a_rows for p in probe]
        assert a.union(b).count() == len(a_rows | b_rows)
        assert a.difference_count(b) == len(a_rows - b_rows)
        start = rng.randrange(200)
        end = start + rng.randrange(1, 20)
        assert a.covers(start, end) == all(r in a_rows for r in range(start, end))
    merged = IntervalSet([[0, 5], [5, 9], [20, 30], [25, 26]])
    assert merged.to_list() == [[0, 9], [20, 30]]


def test_position_round_trip_and_merge():
    p = DataPosition()
    p.add(0, [0, 1, 2, 10])
    q = DataPosition()
    q.add(0, [3, 4])
    q.add(1, [7])
    merged = DataPosition.from_json(p.merge(q).to_json())
    assert merged.consumed(0).to_list() == [[0, 5], [10, 11]]
    assert merged.consumed(1).to_list() == [[7, 8]]
    assert merged.count() == 7


def test_read_position_merges_the_ranks_of_the_checkpoint_ray_will_restore(tmp_path):
    run_dir = str(tmp_path / "run")
    assert read_position(run_dir)[0].count() == 0  # no pointer yet: start from scratch
    for rank, rows in enumerate([[0, 1, 2], [5, 6]]):
        p = DataPosition()
        p.add(0, rows)
        storage.write_json(storage.join(run_dir, "checkpoint_000000010", f"position_rank{rank}.json"), p.to_json())
    stale = DataPosition()
    stale.add(0, [99])
    storage.write_json(storage.join(run_dir, "checkpoint_000000005", "position_rank0.json"), stale.to_json())
    write_pointer(run_dir, "checkpoint_000000010", 10)
    position, name = read_position(run_dir)
    assert name == "checkpoint_000000010"
    assert position.consumed(0).to_list() == [[0, 3], [5, 7]]
    # Ray Train's own registry, when present, names what it will restore: it wins over the
    # pointer (a checkpoint can be reported but not yet registered when a worker dies).
    storage.write_json(
        storage.join(run_dir, "checkpoint_manager_snapshot.json"),
        {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_000000005"}},
    )
    position, name = read_position(run_dir)
    assert name == "checkpoint_000000005" and position.consumed(0).to_list() == [[99, 100]]
    storage.write_json(storage.join(run_dir, "checkpoint_manager_snapshot.json"), {"latest_checkpoint_result": None})
    assert read_position(run_dir)[1] is None


@pytest.mark.ray
def test_stream_leaves_out_consumed_rows_of_the_resumed_epoch_only(tmp_path, shared_ray):
    from conftest import synthetic_docs, write_jsonl

    from pipeline.data.prepare import PrepareConfig, prepare_corpus
    from pipeline.data.shards import load_manifest

    corpus = str(tmp_path / "corpus")
    prepare_corpus(
        PrepareConfig(
            input=write_jsonl(tmp_path / "raw.jsonl", synthetic_docs(90)),
            output=corpus,
            vocab_size=120,
            docs_per_shard=25,
        )
    )
    manifest = load_manifest(corpus)
    position = DataPosition()
    consumed = list(range(0, 30)) + list(range(60, 70))  # shard 0 whole, shard 1 partly, an island
    position.add(0, consumed)
    s = StreamSpec(
        corpus=corpus,
        max_len=16,
        pack=False,
        epochs=2,
        seed=1,
        shuffle_files=True,
        cls_id=CLS,
        sep_id=SEP,
        pad_id=PAD,
        run_dir=str(tmp_path / "run"),
    )
    rows = build_stream(s, position, manifest).take_all()
    by_epoch = {0: [], 1: []}
    for r in rows:
        by_epoch[int(r["epoch"])].extend(int(x) for x in r["source_rows"])
    assert sorted(by_epoch[0]) == [i for i in range(90) if i not in set(consumed)]
    assert sorted(by_epoch[1]) == list(range(90))


# -- coCondenser span pairs ------------------------------------------------------------------


def span_spec(span_length=10, min_span_length=3, short_span_prob=0.1, seed=0):
    from models.cocondenser import CoCondenserConfig

    spans = CoCondenserConfig(span_length=span_length, min_span_length=min_span_length, short_span_prob=short_span_prob)
    base = spec(max_len=span_length + 2, pack=False)
    return StreamSpec(**{**base.__dict__, "seed": seed, "spans": spans})


def test_span_pairs_are_two_disjoint_slices_of_their_document():
    from pipeline.data.stream import to_span_pairs

    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(300)]
    batch = docs_batch(lengths, first_row=1000)
    s = span_spec()
    out = to_span_pairs(batch, s, epoch=0)
    by_row = {int(r): np.asarray(ids) for r, ids in zip(batch["row"], batch["input_ids"])}
    assert out["input_ids"].shape[1:] == (2, 12)
    for pair, lens in zip(out["input_ids"], out["length"]):
        assert lens[0] == lens[1]  # both spans of a pair have one length
        a, b = pair[0][1 : lens[0] - 1], pair[1][1 : lens[1] - 1]
        assert pair[0][0] == CLS and pair[0][lens[0] - 1] == SEP
        doc = by_row[(int(a[0]) // 100 - 1) + 1000]  # token values encode their document
        start_a, start_b = int(a[0]) % 100, int(b[0]) % 100
        assert start_a + len(a) <= start_b  # non-overlapping, in document order
        assert a.tolist() == doc[start_a : start_a + len(a)].tolist()
        assert b.tolist() == doc[start_b : start_b + len(b)].tolist()
        assert s.spans.min_span_length <= len(a) <= min(s.spans.span_length, len(doc) // 2)


def test_short_documents_are_skipped_counted_and_still_consumed():
    from pipeline.data.stream import to_span_pairs

    lengths = [2, 40, 5, 1, 30, 3, 50, 4]  # under 2 x 3 tokens: rows 0, 2, 3, 5, 7
    batch = docs_batch(lengths)
    out = to_span_pairs(batch, span_spec(), epoch=0)
    assert len(out["input_ids"]) == 3
    assert out["skipped_docs"].tolist() == [1, 2, 2]  # folded into the next pair; the tail into the last
    sources = [sorted(r.tolist()) for r in out["source_rows"]]
    assert sources == [[0, 1], [2, 3, 4], [5, 6, 7]]  # every row consumed exactly once
    empty = to_span_pairs(docs_batch([1, 2]), span_spec(), epoch=0)
    assert len(empty["input_ids"]) == 0 and empty["input_ids"].shape[1:] == (2, 12)


def test_spans_are_redrawn_each_epoch_and_independent_of_batching():
    from pipeline.data.stream import to_span_pairs

    lengths = [60] * 200
    s = span_spec(span_length=10)
    whole = to_span_pairs(docs_batch(lengths), s, epoch=0)
    halves = [
        to_span_pairs(docs_batch(lengths[:120]), s, epoch=0),
        to_span_pairs(docs_batch(lengths[120:], first_row=120), s, epoch=0),
    ]
    # Same document, same epoch: the same spans whichever batch it lands in. docs_batch
    # numbers tokens by position in the batch, so compare offsets within the document.
    offsets = lambda out: [
        (int(p[0][1]) % 100, int(p[1][1]) % 100, int(n[0])) for p, n in zip(out["input_ids"], out["length"])
    ]
    assert offsets(whole) == offsets(halves[0]) + offsets(halves[1])
    other_epoch = to_span_pairs(docs_batch(lengths), s, epoch=1)
    changed = sum(a != b for a, b in zip(offsets(whole), offsets(other_epoch)))
    assert changed > 150
    # About 10% of pairs are short (uniform in [3, 10)); the rest are full length.
    short = np.mean([n < 12 for _, _, n in offsets(whole)] + [n < 12 for _, _, n in offsets(other_epoch)])
    assert 0.04 < short < 0.18


def test_spans_of_short_documents_are_capped_at_half_the_document():
    from models.cocondenser import CoCondenserConfig
    from models.span_pairs import draw_span_pairs

    cfg = CoCondenserConfig(span_length=80, min_span_length=8, short_span_prob=0.0)
    lengths = np.array([15, 16, 17, 100, 160, 400])
    valid, first, second, span_len = draw_span_pairs(lengths, np.arange(6), cfg, seed=0, epoch=0)
    assert valid.tolist() == [False, True, True, True, True, True]
    assert span_len[1:].tolist() == [8, 8, 50, 80, 80]
    assert ((second + span_len)[1:] <= lengths[1:]).all() and ((first + span_len) <= second)[1:].all()


def test_training_batches_shuffle_rows_reproducibly_and_keep_every_row_once(shared_ray):
    """A corpus stored grouped by topic (20 topics of 30 consecutive rows): the worker's
    local shuffle buffer leaves no micro-batch to one topic, yields every row exactly once,
    and is a function of its seed."""
    import ray

    from pipeline.training.loop import training_batches
    from pipeline.training.train_config import TrainConfig

    rows = np.arange(600)
    ds = ray.data.from_numpy(rows).repartition(10)  # blocks of 60 rows: two topics each

    def order(seed, buffer):
        train = TrainConfig(micro_batch_size=8, shuffle_buffer=buffer, prefetch_batches=1)
        return [b["data"].tolist() for b in training_batches(ds.iterator(), train, seed)]

    in_order, shuffled, again, other = order(0, 0), order(3, 128), order(3, 128), order(4, 128)
    assert sum(in_order, []) == rows.tolist()  # shuffle_buffer 0: stream order
    assert sorted(sum(shuffled, [])) == rows.tolist() and shuffled == again and shuffled != other
    topics_per_batch = [len({r // 30 for r in batch}) for batch in shuffled]
    assert sum(t == 1 for t in topics_per_batch) == 0, topics_per_batch
    # In stream order, 60 of the 75 batches hold one topic.
    assert sum(len({r // 30 for r in batch}) == 1 for batch in in_order) == 60
