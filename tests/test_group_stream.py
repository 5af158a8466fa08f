"""Fine-tuning groups joined to corpus passages in Ray Data, against the driver's plan."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import synthetic_docs, write_jsonl

from pipeline.core import storage
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.examples import TrainExample
from pipeline.data.group_stream import (
    GroupSpec,
    build_epoch,
    frame_truncated,
    plan_epoch,
)
from pipeline.data.prepare import PrepareConfig, prepare_corpus

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_ray):
    root = tmp_path_factory.mktemp("groups")
    docs = synthetic_docs(90, seed=7)
    cfg = PrepareConfig(
        input=write_jsonl(root / "raw.jsonl", docs), output=str(root / "corpus"), vocab_size=120, docs_per_shard=25
    )
    manifest = prepare_corpus(cfg)
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
        corpus=uri, group_size=4, query_max_len=12, passage_max_len=16, seed=3, cls_id=2, sep_id=3, pad_id=0
    )
    corpus_ids = CorpusIds.read(uri, manifest["shards"])
    id_by_row = dict(enumerate(corpus_ids.ids(np.arange(len(corpus_ids)))))
    plan = plan_epoch(examples, epoch=1, spec=spec, corpus_ids=corpus_ids, skip_rows=np.array([4, 9]))
    assert sorted(plan.example_rows.tolist()) == [r for r in range(30) if r not in (4, 9)]

    out = build_epoch(spec, plan, query_ids, epoch=1, manifest=manifest).take_all()
    assert sorted(r["position"] for r in out) == list(range(28))  # every planned query exactly once
    for r in out:
        position = r["position"]
        example_row = int(r["source_rows"][0])
        assert example_row == plan.example_rows[position]
        assert r["epoch"] == 1
        (expected_q,), (q_len,) = frame_truncated([query_ids[example_row]], 12, spec)
        assert r["q_input_ids"].tolist() == expected_q.tolist() and r["q_length"] == q_len
        for slot in range(4):
            doc = id_by_row[int(plan.corpus_rows[position, slot])]
            (want,), (length,) = frame_truncated([tokens[doc]], 16, spec)
            assert r["d_input_ids"][slot].tolist() == want.tolist() and r["d_length"][slot] == length
        ex = examples[example_row]
        assert id_by_row[int(plan.corpus_rows[position, 0])] in ex.positives
        negatives = {id_by_row[int(x)] for x in plan.corpus_rows[position, 1:]}
        assert not negatives & set(ex.positives)
        if ex.negatives:
            assert negatives <= set(ex.negatives)


def test_a_passage_missing_from_the_corpus_is_a_clear_error(corpus):
    uri, manifest, _ = corpus
    spec = GroupSpec(corpus=uri, group_size=2, query_max_len=8, passage_max_len=8, seed=0, cls_id=2, sep_id=3, pad_id=0)
    examples = [TrainExample("qx", "", positives=["nope"], negatives=["d1"])]
    with pytest.raises(ValueError, match="passage 'nope' is not in the corpus"):
        plan_epoch(examples, 0, spec, CorpusIds.read(uri, manifest["shards"]))
