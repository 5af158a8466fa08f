"""The driver's id index of a corpus: lookups equal a dict's, errors name the corpus, and
its memory per passage is a small constant (a dict of strings costs about ten times it)."""

from __future__ import annotations

import os
import sys
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ArtifactError, InputError
from pipeline.data.corpus_ids import CorpusIds, IdRecorder, NamedIds, id_keys


def _shards(folder, ids: list[str], per_shard: int, first_row: int = 0) -> list[dict]:
    shards = []
    for i, start in enumerate(range(0, len(ids), per_shard)):
        part = ids[start : start + per_shard]
        path = f"shard-{i:05d}.parquet"
        rows = np.arange(first_row + start, first_row + start + len(part))
        os.makedirs(folder, exist_ok=True)
        pq.write_table(pa.table({"row": rows, "doc_id": part}), os.path.join(folder, path))
        shards.append({"path": path, "first_row": int(rows[0]), "rows": len(part)})
    return shards


def test_lookups_equal_a_dict_in_both_directions(tmp_path):
    rng = np.random.default_rng(0)
    ids = [f"doc-{x}" for x in rng.choice(10**6, size=2_000, replace=False)]
    corpus = CorpusIds.read(str(tmp_path), _shards(tmp_path, ids, 300))
    by_id = {d: r for r, d in enumerate(ids)}
    probe = [ids[i] for i in rng.choice(len(ids), 500)]
    assert corpus.rows(probe).tolist() == [by_id[d] for d in probe]
    assert corpus.ids(np.array([7, 0, 1999])) == [ids[7], ids[0], ids[1999]]
    assert ids[5] in corpus and "doc-absent" not in corpus and len(corpus) == 2_000
    with pytest.raises(KeyError, match="doc-absent"):
        corpus.rows([ids[0], "doc-absent"])
    assert "é" in CorpusIds.from_strings(["é", "e"])  # ids are UTF-8, not ASCII


def test_an_index_shards_part_keeps_corpus_rows_and_pads_with_empty_ids(tmp_path):
    """A searcher reads only its index shard's embedding shards, which start past row 0."""
    ids = [f"p{i}" for i in range(100, 130)]
    part = CorpusIds.read(str(tmp_path), _shards(tmp_path, ids, 12, first_row=40))
    assert part.first_row == 40 and part.rows(["p100", "p129"]).tolist() == [40, 69]
    assert part.ids(np.array([41, 69])) == ["p101", "p129"]
    found = part.id_bytes(np.array([[45, -1], [40, 69]]))
    assert found.tolist() == [[b"p105", b""], [b"p100", b"p129"]]
    assert part.holds(np.array([b"p100", b"p99", b"p129", b""])).tolist() == [True, False, True, False]


def test_duplicate_ids_and_rows_out_of_order_name_the_problem(tmp_path):
    with pytest.raises(InputError, match=r"document id 'b' is in rows \[1, 3\]"):
        CorpusIds.from_strings(["a", "b", "c", "b"])
    shards = _shards(tmp_path, ["a", "b", "c", "d"], 2)
    shards[1]["first_row"] = 2
    pq.write_table(pa.table({"row": [5, 6], "doc_id": ["c", "d"]}), os.path.join(tmp_path, shards[1]["path"]))
    with pytest.raises(ArtifactError, match="rows 5..6 do not continue from row 2"):
        CorpusIds.read(str(tmp_path), shards)


def test_memory_per_passage_is_a_small_constant(tmp_path):
    """Peak Python-heap growth of reading the ids of a 200k-passage corpus, against 20k:
    at most 64 bytes a passage (MS MARCO-like 7-character ids), where the dict it replaced
    took about 150."""

    def peak_per_passage(n: int) -> float:
        ids = [str(x) for x in range(1_000_000, 1_000_000 + n)]
        folder = tmp_path / str(n)
        shards = _shards(folder, ids, 50_000)
        del ids
        tracemalloc.start()
        corpus = CorpusIds.read(str(folder), shards)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(corpus) == n
        return peak / n

    small, large = peak_per_passage(20_000), peak_per_passage(200_000)
    assert large <= 64, large
    assert large <= 1.2 * small + 8, (small, large)  # linear in the corpus, no worse


def test_named_ids_find_the_rows_the_whole_corpus_index_finds(tmp_path):
    """:class:`NamedIds` over a sample of a corpus's ids (plus ids it lacks) answers every
    lookup as :class:`CorpusIds` over the whole corpus does; an id in two shards is refused
    as there. Here without Ray: each shard a plain call."""
    rng = np.random.default_rng(1)
    ids = [f"doc-{x}" for x in rng.choice(10**6, size=3_000, replace=False)]
    shards = _shards(tmp_path, ids, 700)
    whole = CorpusIds.read(str(tmp_path), shards)
    asked = [ids[i] for i in rng.choice(len(ids), 400, replace=False)] + ["doc-absent", "z"]
    named = NamedIds.of(str(tmp_path), shards, np.unique(id_keys(asked)), len(ids))
    keys = id_keys(asked + [ids[0]])  # one the sample lacks, though the corpus has it
    expected = whole.find(keys)
    expected[-1] = -1
    assert named.find(keys).tolist() == expected.tolist() and len(named) == 3_000
    assert named.holds(id_keys(["doc-absent", asked[0]])).tolist() == [False, True]
    assert named.ids(whole.rows(asked[:5])) == asked[:5]
    with pytest.raises(KeyError, match="doc-absent"):
        named.rows([asked[0], "doc-absent"])
    doubled = _shards(tmp_path / "doubled", ["a", "b", "c", "a"], 2)
    with pytest.raises(InputError, match=r"document id 'a' is in rows \[0, 3\]"):
        NamedIds.of(str(tmp_path / "doubled"), doubled, id_keys(["a", "c"]), 4)


def test_the_recorder_keeps_every_id_asked_of_it_distinct_and_sorted(monkeypatch):
    """Merged when the pending ids outgrow the merged ones (here past 1,000). Mutation:
    ``_merge`` keeping only the pending ids loses the first merge's."""
    monkeypatch.setattr(IdRecorder, "MERGE_AT", 1_000)
    recorder = IdRecorder(10, "the corpus")
    for start in range(0, 12_000, 400):
        recorder.find(np.char.add(b"d", (np.arange(start, start + 400) % 4_000).astype("S7")))
    assert recorder._pending_count < 12_000  # merged on the way
    assert "x" in recorder and recorder.holds(id_keys(["y"])).tolist() == [True]
    keys = recorder.keys()
    assert len(keys) == 4_002 and np.all(keys[1:] > keys[:-1])


def test_named_ids_are_looked_up_in_one_task_a_shard_off_the_head(tmp_path, shared_ray, monkeypatch):
    """With Ray, each shard's ids are read by a task in a worker process, one a shard, never
    by the driver. Counted by the tasks' marks (each holds its process id); the driver's own
    reads fail. Mutation: ``StorageTasks.map`` as plain calls on the driver reads here and
    fails; ``_rows_in_shard`` over all shards in one task leaves one mark."""
    from ray import cloudpickle

    from pipeline.core import storage
    from pipeline.data import corpus_ids as module

    ids = [f"p{i}" for i in range(1_000)]
    shards = _shards(tmp_path / "corpus", ids, 150)
    marks = tmp_path / "marks"
    marks.mkdir()
    looked_up = module._rows_in_shard

    def marked(uri, first_row, keys):
        (marks / f"{os.getpid()}-{first_row}").write_text("")
        return looked_up(uri, first_row, keys)

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(module, "_rows_in_shard", marked)
    monkeypatch.setattr(storage, "read_parquet", lambda *a, **k: pytest.fail("the driver read a shard"))
    named = NamedIds.of(str(tmp_path / "corpus"), shards, np.unique(id_keys(["p3", "p999", "p500"])), 1_000)
    assert named.rows(["p3", "p500", "p999"]).tolist() == [3, 500, 999]
    seen = [name.split("-") for name in os.listdir(marks)]
    assert sorted(int(first) for _, first in seen) == [s["first_row"] for s in shards]
    assert str(os.getpid()) not in {pid for pid, _ in seen}
