"""The driver's id index of a corpus: lookups equal a dict's, errors name the corpus, and
its memory per passage is a small constant (a dict of strings costs about ten times it)."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import ArtifactError, InputError
from pipeline.data.corpus_ids import CorpusIds


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
