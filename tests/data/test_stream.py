"""Examples from shards (packing/truncation), the data position, and resumable streams."""

from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import pytest

from pipeline.core import sealed, storage
from pipeline.data.position import (
    DataPosition,
    IntervalSet,
    read_position,
    write_pointer,
)
from pipeline.data.stream import StreamSpec, build_stream, configure_data_context, to_sequences
from tests.helpers import SEAL_KEY

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
    # A sequence lists the documents whose last token it holds, and names the one it cuts,
    # with how many of that document's tokens are used up by its end. A [SEP] is counted
    # with the document it introduces.
    owners = []  # (row, index within the document's [SEP] + tokens) of every token
    for i, (row, ids) in enumerate(zip(batch["row"], batch["input_ids"])):
        owners += [(int(row), k) for k in range(len(ids) + (i > 0))]
    last = {row: k for row, k in owners}
    start = 0
    for body, sources, cut in zip(bodies(out), out["source_rows"], out["partial"]):
        end = start + len(body)
        assert sources.tolist() == [row for row, k in owners[start:end] if k == last[row]]
        expected_cut = [-1, 0] if end == len(owners) or owners[end][1] == 0 else list(owners[end])
        assert cut.tolist() == expected_cut
        start = end
    assert start == len(owners)


@pytest.mark.parametrize("pack", [True, False])
def test_a_resumed_block_yields_exactly_the_sequences_an_uninterrupted_one_had_left(pack):
    """Whatever number of sequences a checkpoint consumed, the block rebuilt from the data
    position (finished rows left out, the cut document resumed at its next token) gives the
    remaining sequences, cut where the uninterrupted run cut them; also with the rows
    shuffled (the order is a function of the rows, not of what is left)."""
    from pipeline.data.stream import block_examples

    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 30, size=40)  # some span several sequences; empty ones are consumed too
    batch = docs_batch(lengths.tolist(), first_row=500)
    s = StreamSpec(**{**spec(max_len=10, pack=pack).__dict__, "shuffle_window": 16, "seed": 9})
    whole = block_examples(batch, s, 2, [], {})
    assert sorted(r for rows in whole["source_rows"] for r in rows.tolist()) == list(range(500, 540))
    for consumed in range(len(whole["length"]) + 1):
        position = DataPosition()
        for sources, cut in zip(whole["source_rows"][:consumed], whole["partial"][:consumed]):
            position.add(2, sources, [cut] if cut[0] >= 0 else ())
        position = DataPosition.from_json(position.to_json())  # as a checkpoint stores it
        rest = block_examples(batch, s, 2, position.consumed(2).to_list(), position.opened(2))
        assert np.array_equal(rest["input_ids"], whole["input_ids"][consumed:]), consumed
        assert np.array_equal(rest["partial"], whole["partial"][consumed:])
        assert [r.tolist() for r in rest["source_rows"]] == [r.tolist() for r in whole["source_rows"][consumed:]]


def test_window_order_mixes_topics_is_seeded_and_ignores_what_is_missing():
    """A corpus stored grouped by topic (20 topics of 30 consecutive rows): shuffled in windows
    of 128 rows, no batch of 8 holds one topic; the order is a function of (seed, epoch); rows
    missing (consumed before a resume) leave the others in the same relative order."""
    from pipeline.data.stream import window_order

    rows = np.arange(600)
    shuffled = rows[window_order(rows, 3, 0, 128)]
    assert sorted(shuffled.tolist()) == rows.tolist()
    assert np.array_equal(shuffled, rows[window_order(rows, 3, 0, 128)])
    assert not np.array_equal(shuffled, rows[window_order(rows, 4, 0, 128)])
    assert not np.array_equal(shuffled, rows[window_order(rows, 3, 1, 128)])
    assert np.array_equal(rows[window_order(rows, 3, 0, 0)], rows)  # window 0: stream order
    batches = shuffled.reshape(-1, 8)
    assert sum(len({r // 30 for r in b}) == 1 for b in batches) == 0
    assert all((b // 128).max() - (b // 128).min() <= 1 for b in batches)  # windows in turn
    left = np.setdiff1d(rows, rows[:250])
    assert np.array_equal(left[window_order(left, 3, 0, 128)], shuffled[np.isin(shuffled, left)])


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
    q.add(0, [], [(20, 7)])  # a document begun: 7 of its tokens used
    p.add(0, [], [(20, 3), (30, 4)])
    p.add(0, [30])  # finished: no longer open
    merged = DataPosition.from_json(p.merge(q).to_json())
    assert merged.opened(0) == {20: 7} and merged.opened(1) == {}
    assert merged.consumed(0).to_list() == [[0, 5], [10, 11], [30, 31]]
    assert merged.consumed(1).to_list() == [[7, 8]]
    assert merged.count() == 8


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
    for name in ("checkpoint_000000005", "checkpoint_000000010"):
        sealed.seal(storage.join(run_dir, name), "rank0", SEAL_KEY)
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


def _checkpoint(run_dir, name: str, payload: bytes = b"weights" * 100) -> str:
    folder = storage.join(run_dir, name)
    storage.write_bytes(storage.join(folder, "state", "model.pt"), payload)
    storage.write_json(storage.join(folder, "position_rank0.json"), DataPosition().to_json())
    sealed.seal(folder, "rank0", SEAL_KEY)
    return folder


def test_a_sealed_folder_is_whole_only_with_every_file_at_its_size_and_hash(tmp_path):
    folder = _checkpoint(str(tmp_path), "checkpoint_000000004")
    assert sealed.damage(folder) is None and sealed.verify(folder, SEAL_KEY) is None
    model = os.path.join(folder, "state", "model.pt")
    data = open(model, "rb").read()
    with open(model, "r+b") as f:  # a bit flipped: the listing cannot tell, the hash can
        f.seek(10)
        f.write(bytes([data[10] ^ 1]))
    assert sealed.damage(folder) is None
    assert sealed.verify(folder, SEAL_KEY) == "state/model.pt does not hold what was written (SHA-256 differs)"
    with open(model, "wb") as f:
        f.write(data[:100])
    assert (
        sealed.damage(folder) == sealed.verify(folder, SEAL_KEY) == "state/model.pt holds 100 bytes, 700 were written"
    )
    os.remove(model)
    assert sealed.damage(folder) == "state/model.pt is missing"
    os.remove(os.path.join(folder, "seal_rank0.json"))
    assert sealed.damage(folder).startswith("not sealed")
    sealed.mark_damaged(folder, "state/model.pt does not hold what was written (SHA-256 differs)")
    assert sealed.damage(folder) == "state/model.pt does not hold what was written (SHA-256 differs)"


def test_a_seal_rewritten_without_the_key_is_refused_before_any_file_is_hashed(tmp_path, monkeypatch):
    """Whoever can write the bucket can write a checkpoint and a seal for it, but not sign the
    seal. Mutation: verify without its signature check; the planted files' seal then passes
    as whole (None) and the resume loads them."""
    from pipeline.core.errors import ArtifactError

    folder = _checkpoint(str(tmp_path), "checkpoint_000000004")
    planted = b"a pickle that runs code" * 10
    with open(os.path.join(folder, "state", "model.pt"), "wb") as f:
        f.write(planted)
    seal_path = os.path.join(folder, "seal_rank0.json")
    content = json.loads(open(seal_path).read())
    content["files"]["state/model.pt"] = [len(planted), hashlib.sha256(planted).hexdigest()]
    hashed = []
    monkeypatch.setattr(sealed, "_sha256", lambda path: hashed.append(path) or "")
    forgeries = [
        ({"files": content["files"], "hmac": "0" * 64}, "is not signed with this run's key (tests.helpers.SEAL_KEY)"),
        ({"files": content["files"]}, "is not signed:"),  # as seals were before they were signed
    ]
    for forged, how in forgeries:
        with open(seal_path, "w") as f:
            json.dump(forged, f)
        with pytest.raises(ArtifactError) as refused:
            sealed.verify(folder, SEAL_KEY, "s3://bucket/run/checkpoint_000000004")
        message = str(refused.value)
        assert message.startswith("checkpoint s3://bucket/run/checkpoint_000000004: seal_rank0.json ")
        assert how in message and sealed.KEY_ENV in message and "\n" not in message
    assert hashed == []  # refused on the seal alone
    # The key itself: a different one refuses the same folder, sealed properly with the first.
    monkeypatch.undo()
    sealed.seal(folder, "rank0", SEAL_KEY)
    assert sealed.verify(folder, SEAL_KEY) is None
    with pytest.raises(ArtifactError, match="is not signed with this run's key"):
        sealed.verify(folder, sealed.SealKey(b"another run's key", "elsewhere"))


def test_a_run_without_a_key_set_gets_one_of_its_own_kept_outside_its_storage(tmp_path, monkeypatch):
    monkeypatch.delenv(sealed.KEY_ENV, raising=False)
    monkeypatch.setenv("RAYDENSE_CACHE", str(tmp_path / "cache"))
    first, again, other = (sealed.seal_key(run) for run in ("s3://b/run-a", "s3://b/run-a", "s3://b/run-b"))
    assert first == again and first.secret != other.secret and len(first.secret) == 64
    assert first.source.startswith(str(tmp_path / "cache")) and os.stat(first.source).st_mode & 0o077 == 0
    assert "secret" not in repr(first) and first.secret.decode() not in repr(first)
    monkeypatch.setenv(sealed.KEY_ENV, "from-the-secret")
    assert sealed.seal_key("s3://b/run-a") == sealed.SealKey(b"from-the-secret", "$RAYDENSE_CHECKPOINT_KEY")


def test_a_damaged_latest_checkpoint_is_passed_over_for_the_newest_whole_one(tmp_path, capsys):
    from pipeline.core.errors import ArtifactError
    from pipeline.data.position import restorable_checkpoint

    run_dir = str(tmp_path / "run")
    for step in (2, 4, 6):
        _checkpoint(run_dir, f"checkpoint_{step:09d}")
    _checkpoint(run_dir, "checkpoint_000000008")  # saved after the registry's latest: not a candidate
    write_pointer(run_dir, "checkpoint_000000006", 6)
    assert restorable_checkpoint(run_dir) == "checkpoint_000000006"
    model = os.path.join(run_dir, "checkpoint_000000006", "state", "model.pt")
    os.truncate(model, 50)
    assert restorable_checkpoint(run_dir) == "checkpoint_000000004"
    assert capsys.readouterr().err == ""  # a worker's or the stream's call: the driver warns
    assert restorable_checkpoint(run_dir, warn=True) == "checkpoint_000000004"
    warning = capsys.readouterr().err
    assert "checkpoint_000000006 is not whole (state/model.pt holds 50 bytes, 700 were written)" in warning
    for step in (2, 4):
        sealed.mark_damaged(storage.join(run_dir, f"checkpoint_{step:09d}"), "hash differs")
    with pytest.raises(ArtifactError, match="no whole checkpoint to resume from"):
        restorable_checkpoint(run_dir)


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
    # As every process that builds a training stream does (TrainingStream): without it Ray
    # Data may hand out the shards' blocks out of order, which failed this test in CI once
    # other tests loaded the machine (it passed when an earlier test in its process had set it).
    configure_data_context()
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

    # Packed and shuffled, over three epochs: rebuilt from the position of any prefix, the
    # stream is the rest of the whole one, example for example (epochs in order).
    s = StreamSpec(**{**s.__dict__, "pack": True, "epochs": 3, "shuffle_window": 16})
    whole = build_stream(s, DataPosition(), manifest).take_all()
    assert [int(r["epoch"]) for r in whole] == sorted(int(r["epoch"]) for r in whole)
    for taken in (7, len(whole) // 3 + 1, len(whole) - 2):
        position = DataPosition()
        for example in whole[:taken]:
            cut = example["partial"]
            position.add(int(example["epoch"]), example["source_rows"], [cut] if cut[0] >= 0 else ())
        rest = build_stream(s, position, manifest).take_all()
        assert len(rest) == len(whole) - taken
        assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(rest, whole[taken:]))


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
