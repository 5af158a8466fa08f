"""Embedding shards and their manifest: round trips, resume, and the errors a broken folder gives."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core import storage
from pipeline.retrieval import embeddings as emb


def _shard(first: int, n: int, dim: int = 8, seed: int = 0):
    rows = np.arange(first, first + n, dtype=np.int64)
    vectors = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows, [f"d{r}" for r in rows], vectors


def _write_all(folder: str, sizes=(5, 7, 3), dim: int = 8, dtype: str = "float32") -> tuple[dict, list]:
    entries, parts, first = [], [], 0
    for i, n in enumerate(sizes):
        part = _shard(first, n, dim, seed=i)
        entries.append(emb.write_shard(folder, i, *part, dtype=dtype))
        parts.append(part)
        first += n
    manifest = emb.write_manifest(
        folder, dim, entries[::-1], dtype=dtype, normalized=True, similarity="cos", model="tiny-bert"
    )
    return manifest, parts


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_local(tmp_path, dtype):
    folder = str(tmp_path / "emb")
    written, parts = _write_all(folder, dtype=dtype)
    manifest = emb.load_manifest(folder)
    assert manifest == written
    assert [s["index"] for s in manifest["shards"]] == [0, 1, 2]
    assert [s["first_row"] for s in manifest["shards"]] == [0, 5, 12]
    assert manifest["count"] == 15 and manifest["dtype"] == dtype and manifest["completed"]
    emb.check_embedding_shards(folder, manifest)
    for entry, (rows, ids, vectors) in zip(manifest["shards"], parts):
        got_rows, got_ids, got = emb.read_shard(folder, entry, dim=8)
        assert got.dtype == np.float32 and got.shape == (entry["rows"], 8)
        np.testing.assert_array_equal(got_rows, rows)
        assert got_ids == ids
        tolerance = 1e-3 if dtype == "float16" else 0
        np.testing.assert_allclose(got, vectors, rtol=tolerance, atol=tolerance)
    schema = pq.read_schema(tmp_path / "emb" / emb.shard_path(1))
    kind = schema.field("embedding").type
    assert kind.list_size == 8 and str(kind.value_type) == ("halffloat" if dtype == "float16" else "float")


def test_round_trip_s3(s3_bucket):
    folder = f"s3://{s3_bucket}/run/embeddings"
    written, parts = _write_all(folder, sizes=(4, 6))
    manifest = emb.load_manifest(folder)
    assert manifest == written
    emb.check_embedding_shards(folder, manifest)
    assert emb.finished_shards(folder) == {0, 1}
    rows, ids, vectors = emb.read_shard(storage.join(folder, emb.shard_path(1)))
    np.testing.assert_array_equal(rows, parts[1][0])
    assert ids == parts[1][1]
    np.testing.assert_array_equal(vectors, parts[1][2])


def test_finished_shards_after_partial_writes(tmp_path):
    folder = str(tmp_path / "emb")
    assert emb.finished_shards(folder) == set()
    emb.write_shard(folder, 0, *_shard(0, 3))
    emb.write_shard(folder, 2, *_shard(6, 3))
    # Debris of a writer killed mid-shard: a temporary name, never the final one.
    (tmp_path / "emb" / "shards" / ".part-00001.parquet.tmp-1234abcd").write_bytes(b"PAR1 half")
    assert emb.finished_shards(folder) == {0, 2}
    with pytest.raises(emb.ArtifactError, match="no manifest"):
        emb.load_manifest(folder)


def test_failing_writer_leaves_no_shard(tmp_path, monkeypatch):
    folder = str(tmp_path / "emb")

    def dies_midway(table, where, **kwargs):
        where.write(b"PAR1" + b"\0" * 100)
        raise RuntimeError("worker killed")

    monkeypatch.setattr(pq, "write_table", dies_midway)
    with pytest.raises(RuntimeError, match="worker killed"):
        emb.write_shard(folder, 0, *_shard(0, 4))
    assert not (tmp_path / "emb" / emb.shard_path(0)).exists()
    assert list((tmp_path / "emb" / "shards").iterdir()) == []
    assert emb.finished_shards(folder) == set()


def test_wrong_width_shard_is_named(tmp_path):
    folder = str(tmp_path / "emb")
    manifest, _ = _write_all(folder, dim=8)
    emb.write_shard(folder, 1, *_shard(5, 7, dim=6))  # a retry with another model's width
    with pytest.raises(
        emb.ArtifactError, match=r"embedding shard .*part-00001\.parquet has width 6, the manifest's dim is 8"
    ):
        emb.check_embedding_shards(folder, manifest)
    with pytest.raises(emb.ArtifactError, match=r"part-00001\.parquet has width 6, the manifest's dim is 8"):
        emb.read_shard(folder, manifest["shards"][1], dim=8)


def test_missing_shard_and_bad_manifests_are_named(tmp_path):
    folder = str(tmp_path / "emb")
    manifest, _ = _write_all(folder)
    (tmp_path / "emb" / emb.shard_path(2)).unlink()
    with pytest.raises(emb.ArtifactError, match=r"embedding shard .*part-00002\.parquet is missing"):
        emb.check_embedding_shards(folder, manifest)
    with pytest.raises(emb.ArtifactError, match=r"part-00002\.parquet: no such file"):
        emb.read_shard(folder, manifest["shards"][2])
    storage.write_json(str(tmp_path / "emb" / "manifest.json"), {**manifest, "completed": False})
    with pytest.raises(emb.ArtifactError, match="did not finish"):
        emb.load_manifest(folder)
    storage.write_json(str(tmp_path / "emb" / "manifest.json"), {**manifest, "format": "other"})
    with pytest.raises(emb.ArtifactError, match="expected 'raydense-embeddings-v1'"):
        emb.load_manifest(folder)


def test_inconsistent_inputs_are_rejected(tmp_path):
    rows, ids, vectors = _shard(0, 4)
    with pytest.raises(emb.ArtifactError, match="part-00003.parquet: 4 rows, 3 doc ids"):
        emb.write_shard(str(tmp_path), 3, rows, ids[:3], vectors)
    with pytest.raises(emb.ArtifactError, match="dtype 'int8'"):
        emb.write_shard(str(tmp_path), 3, rows, ids, vectors, dtype="int8")
    with pytest.raises(emb.ArtifactError, match="similarity 'euclid'"):
        emb.write_manifest(str(tmp_path), 8, [], normalized=False, similarity="euclid", model="m")
