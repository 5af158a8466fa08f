"""FAISS index shards: exact sharded search, IVF recall, memory planning, persistence and errors."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from pipeline.core import storage
from pipeline.core.errors import ArtifactError, StorageError
from pipeline.retrieval import faiss_index as ix
from pipeline.retrieval import index_memory
from pipeline.retrieval.fanout import merge_topk

DIM = 32


@pytest.fixture(autouse=True)
def one_thread():
    """The test machine is shared: one OpenMP thread keeps FAISS from hogging it."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def clustered(n: int, dim: int = DIM, seed: int = 0, centers: int = 40) -> np.ndarray:
    """Points around a few centres, like real embeddings (uniform noise makes IVF look worse than it is)."""
    rng = np.random.default_rng(seed)
    means = np.random.default_rng(1234).standard_normal((centers, dim)) * 2
    return (means[rng.integers(0, centers, n)] + rng.standard_normal((n, dim))).astype(np.float32)


def build_shards(x, factory="Flat", metric="ip", parts=3, **kwargs):
    rows = np.arange(len(x))
    return [ix.build_index_shard(x[s], rows[s], factory, metric, **kwargs) for s in np.array_split(rows, parts)]


def assert_exact_topk(queries, vectors, scores, rows, metric):
    """Same top-k as brute force, ties allowed: every returned row really has the reference
    score of its rank (recomputed from the vectors), and no row is returned twice."""
    ref_scores, ref_rows = ix.brute_force_topk(queries, vectors, scores.shape[1], metric)
    assert (rows >= 0).all() and all(len(set(r)) == len(r) for r in rows)
    q, v = queries[:, None, :], vectors[rows]
    true = (q * v).sum(-1) if metric == "ip" else ((q - v) ** 2).sum(-1)
    np.testing.assert_allclose(true, ref_scores, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-4, atol=1e-3)
    assert (rows == ref_rows).mean() > 0.99


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_sharded_flat_search_is_exact(metric):
    x, q = clustered(6000), clustered(50, seed=1)
    indexes = build_shards(x, "Flat", metric)
    assert [i.ntotal for i in indexes] == [2000, 2000, 2000]
    scores, rows = ix.search_shards(indexes, q, 10, metric)
    assert scores.dtype == np.float32 and rows.dtype == np.int64 and rows.shape == (50, 10)
    assert_exact_topk(q, x, scores, rows, metric)


def test_ivf_recall_and_full_probe_is_exact():
    x, q = clustered(6000), clustered(50, seed=1)
    train = ix.sample_vectors(x, 1500, seed=0)
    indexes = build_shards(x, "IVF16,Flat", "ip", train_vectors=train, nprobe=1)
    _, exact = ix.brute_force_topk(q, x, 10, "ip")
    _, approx = ix.search_shards(indexes, q, 10, "ip", nprobe=1)
    recall = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(approx, exact)])
    assert recall > 0.5, recall
    scores, rows = ix.search_shards(indexes, q, 10, "ip", nprobe=16)
    assert_exact_topk(q, x, scores, rows, "ip")


def test_shards_from_one_trained_index_load_as_one_that_answers_as_they_did(tmp_path):
    x, q = clustered(6000), clustered(50, seed=1)
    trained = ix.trained_index("IVF16,SQ8", DIM, "ip", ix.sample_vectors(x, 1500, seed=0), "never")
    other = ix.trained_index("IVF16,SQ8", DIM, "ip", ix.sample_vectors(x, 1500, seed=1), "never")
    key, other_key = ix.trained_key(faiss.serialize_index(trained)), ix.trained_key(faiss.serialize_index(other))
    assert key == ix.trained_key(faiss.serialize_index(faiss.clone_index(trained))) and key != other_key
    # Shards 0-2 share a quantiser; shard 3 has its own; shard 4 shares 0-2's but does not
    # follow them; the Flat shard has none. Saved with their records, as the build does.
    rows = np.array_split(np.arange(len(x)), 6)
    made = [trained, trained, trained, other, trained]
    shards = [ix.build_index_shard(x[r], r, "IVF16,SQ8", trained=t, use_gpu="never") for r, t in zip(rows, made)]
    shards.append(ix.build_index_shard(x[rows[5]], rows[5], "Flat", use_gpu="never"))
    entries = []
    for i, (shard, trained_key) in enumerate(zip(shards, [key, key, key, other_key, key, None])):
        entry = {"path": ix.index_shard_path(i), "trained": trained_key}
        ix.save_index(shard, str(tmp_path / entry["path"]))
        storage.write_json(str(tmp_path / (entry["path"] + ".json")), {**entry, "list_sizes": ix.list_sizes(shard)})
        entries.append(entry)
    apart = ix.search_shards(shards, q, 20, "ip", nprobe=4)
    merged = ix.load_merged_shards(str(tmp_path), entries)
    assert [m.ntotal for m in merged] == [3000, 1000, 1000, 1000]
    assert ix.list_sizes(merged[0]) == list(np.sum([ix.list_sizes(s) for s in shards[:3]], axis=0))
    scores, found = ix.search_shards(merged, q, 20, "ip", nprobe=4)
    # The same lists probed with the same codes: the same scores, the same passages (ties aside).
    np.testing.assert_allclose(scores, apart[0], rtol=1e-6, atol=1e-6)
    assert (found == apart[1]).mean() > 0.99
    # Without recorded sizes (an index built before they were), the shards stay apart.
    storage.write_json(str(tmp_path / (entries[0]["path"] + ".json")), entries[0])
    assert [m.ntotal for m in ix.load_merged_shards(str(tmp_path), entries[:3])] == [1000, 2000]
    # A record whose sizes are not its shard's is an error naming the shard, not a bad copy.
    wrong = {**entries[2], "list_sizes": ix.list_sizes(shards[0])}
    storage.write_json(str(tmp_path / (entries[2]["path"] + ".json")), wrong)
    with pytest.raises(ArtifactError, match=r"index-00002\.faiss: its inverted lists do not match its record"):
        ix.load_merged_shards(str(tmp_path), [entries[1], entries[2]])


def test_merge_drops_padding_and_orders_by_metric():
    a = (np.array([[0.9, 0.1, -3e38]], np.float32), np.array([[7, 3, -1]]))
    b = (np.array([[0.5, -3e38, -3e38]], np.float32), np.array([[11, -1, -1]]))
    scores, rows = merge_topk([a, b], 3, "ip")
    assert rows.tolist() == [[7, 11, 3]] and scores[0, 0] == np.float32(0.9)
    d = (np.array([[0.2, 4.0]], np.float32), np.array([[5, 6]]))
    e = (np.array([[1.0, 3e38]], np.float32), np.array([[8, -1]]))
    assert merge_topk([d, e], 3, "l2")[1].tolist() == [[5, 8, 6]]


def test_bad_factory_and_k_larger_than_corpus_are_clear():
    with pytest.raises(ValueError, match=r"FAISS rejects the index factory 'IVF16,PQ7' for dim 32: .*multiple of"):
        ix.validate_factory("IVF16,PQ7", DIM)
    with pytest.raises(ValueError, match=r"FAISS rejects the index factory 'Flatish' for dim 32: could not parse"):
        ix.build_index_shard(clustered(10), np.arange(10), "Flatish")
    ix.validate_factory("IVF64,PQ8", DIM)
    x, q = clustered(812), clustered(3, seed=1)
    indexes = build_shards(x, parts=2)
    with pytest.raises(ValueError, match=r"k=1000 is larger than the corpus \(812 passages\)"):
        ix.search_shards(indexes, q, 1000)
    with pytest.raises(ValueError, match=r"k=1000 is larger than the corpus \(812 passages\)"):
        ix.brute_force_topk(q, x, 1000)
    assert ix.search_shards(indexes, q, 812)[1].shape == (3, 812)


@pytest.mark.parametrize(
    "factory", ["Flat", "IVF16,Flat", "IVF16,PQ8x4", "SQ8", "HNSW16", "PCA32,IVF16,Flat", "IVF16,PQ8x4fs"]
)
def test_memory_plan_matches_the_serialized_size(factory):
    x = clustered(5000, dim=64)
    built = ix.build_index_shard(x, np.arange(5000), factory, train_vectors=x[:2500])
    actual = len(faiss.serialize_index(built))
    (plan,) = index_memory.plan_memory(factory, 64, [5000])
    assert plan["estimate"] == ("measured" if factory.endswith("fs") else "formula")
    assert abs(plan["bytes"] - actual) <= 0.1 * actual, (plan, actual)


def test_plan_over_the_limit_names_the_shard():
    plan = index_memory.plan_memory("Flat", 768, [1_000_000, 4_500_000])
    index_memory.check_plan(plan[:1], 8 * 2**30)
    with pytest.raises(
        ValueError,
        match=r"index shard 1 needs 12\.9 GiB, more than the 8\.0 GiB limit: use more "
        r"shards or a compressed factory such as IVF8192,SQ8 or IVF8192,PQ64",
    ):
        index_memory.check_plan(plan, 8 * 2**30)
    table = index_memory.format_plan(plan)
    assert "4,500,000" in table and table.splitlines()[-1].startswith("total")
    assert index_memory.memory_limit_bytes(2) == 2 * 2**30 and index_memory.memory_limit_bytes(0) > 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_save_load_round_trip(where, tmp_path, request):
    folder = str(tmp_path / "index") if where == "local" else f"s3://{request.getfixturevalue('s3_bucket')}/index"
    x, q = clustered(3000), clustered(20, seed=1)
    indexes = build_shards(x, "IVF16,Flat", parts=2, nprobe=4)
    before = ix.search_shards(indexes, q, 10, "ip", nprobe=4)
    shards = []
    for i, index in enumerate(indexes):
        ix.save_index(index, storage.join(folder, ix.index_shard_path(i)))
        shards.append({"index": i, "path": ix.index_shard_path(i), "vectors": index.ntotal, "embedding_shards": [i]})
    ix.write_index_manifest(
        folder, factory="IVF16,Flat", metric="ip", dim=DIM, shards=shards, embeddings="s3://bucket/embeddings"
    )
    manifest = ix.load_index_manifest(folder)
    assert [s["vectors"] for s in manifest["shards"]] == [1500, 1500]
    assert [s["embedding_shards"] for s in manifest["shards"]] == [[0], [1]]
    after = ix.search_shards(ix.load_index_shards(folder, manifest), q, 10, "ip", nprobe=4)
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[0], after[0])


def test_an_index_is_read_from_s3_in_a_few_large_requests(s3_endpoint, monkeypatch):
    """FAISS reads an IVF index field by field and list by list (two small reads a list);
    the stream under it is buffered, so a shard of 256 lists (1.1 MB) costs a couple of
    GETs, not one per read. Mutation: an unbuffered S3 stream makes 500+ GETs here."""
    import boto3

    from tests.helpers import SlowS3

    s3 = SlowS3(0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    boto3.client("s3").create_bucket(Bucket="counted")
    index = build_shards(clustered(4000), "IVF256,Flat", parts=1, nprobe=4)[0]
    uri = "s3://counted/index-00000.faiss"
    ix.save_index(index, uri)
    s3.taken()
    loaded = ix.load_index(uri)
    gets = s3.taken().get("GET", 0)
    assert loaded.ntotal == 4000 and ix.list_sizes(loaded) == ix.list_sizes(index)
    assert gets <= 3, gets
    s3.server.shutdown()


def test_missing_index_shard_is_named(tmp_path):
    folder = str(tmp_path / "index")
    with pytest.raises(ix.ArtifactError, match="no manifest"):
        ix.load_index_manifest(folder)
    index = build_shards(clustered(100), parts=1)[0]
    ix.save_index(index, storage.join(folder, ix.index_shard_path(0)))
    ix.write_index_manifest(
        folder,
        factory="Flat",
        metric="ip",
        dim=DIM,
        embeddings="emb",
        shards=[{"index": i, "path": ix.index_shard_path(i), "vectors": 100, "embedding_shards": [i]} for i in (0, 1)],
    )
    with pytest.raises(ix.ArtifactError, match=r"index shard .*index-00001\.faiss is missing"):
        ix.load_index_manifest(folder)
    with pytest.raises(StorageError, match=r"index-00001\.faiss: no such file"):
        ix.load_index(storage.join(folder, ix.index_shard_path(1)))


@pytest.mark.skipif(hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0, reason="a GPU is present")
def test_gpu_settings_on_a_cpu_build():
    assert ix.resolve_gpu("auto") is False and ix.resolve_gpu("never") is False
    with pytest.raises(ValueError, match="use_gpu='always' but FAISS sees no GPU"):
        ix.resolve_gpu("always")
    with pytest.raises(ValueError, match="use_gpu='sometimes'"):
        ix.resolve_gpu("sometimes")


@pytest.mark.parametrize("factory", ["PQ8", "IVF16,PQ8", "OPQ8,IVF16,PQ8", "IVF16,PQ8,RFlat", "HNSW16_PQ8"])
def test_pq_indexes_skip_the_polysemous_training_no_search_reads(factory):
    """FAISS trains a polysemous code order for PQ by default (~1.5 s a sub-quantiser on a
    core: 12 s of the GPU canary's 12.4). Mutation: dropping ``_skip_polysemous_training``
    leaves the flag set on the PQ inside each wrapper."""
    index = ix.new_index(factory, DIM, "ip")
    flags = [p.do_polysemous_training for p in ix.index_parts(index) if hasattr(p, "do_polysemous_training")]
    assert flags == [False]


def test_a_pq_index_without_the_polysemous_order_answers_as_faiss_default_does():
    """The order only permutes the codebook: every score and id is FAISS's own."""
    x, queries = clustered(1000), clustered(50, seed=3)
    ours = ix.build_index_shard(x, np.arange(len(x)), "IVF8,PQ2", nprobe=8, use_gpu="never")
    default = faiss.index_factory(DIM, "IVF8,PQ2", faiss.METRIC_INNER_PRODUCT)
    assert faiss.downcast_index(default).do_polysemous_training
    default.train(x)
    default.add_with_ids(x, np.arange(len(x)))
    default.nprobe = 8
    (scores, rows), (expected_scores, expected_rows) = ix.search_shard(ours, queries, 10), default.search(queries, 10)
    assert np.array_equal(rows, expected_rows) and np.array_equal(scores, expected_scores)


def test_the_gpu_canary_trains_on_one_faiss_thread_and_puts_the_count_back(monkeypatch):
    """The canary reserves next to no CPU: its IVF-PQ training runs one FAISS thread, and
    the worker's count is put back after, a failed canary included. Mutation: dropping the thread cap
    (or its ``finally``) fails the first (or last) assertion."""
    from pipeline.retrieval import gpu_search

    monkeypatch.setenv(gpu_search.FAULT_VAR, "none")  # the stand-in for a FAISS GPU build
    seen = []
    monkeypatch.setattr(gpu_search, "_canary_search", lambda: seen.append(faiss.omp_get_max_threads()))
    faiss.omp_set_num_threads(2)
    gpu_search.gpu_canary()
    assert seen == [1] and faiss.omp_get_max_threads() == 2

    def broken():
        raise RuntimeError("FAISS's GPU Flat search differs")

    monkeypatch.setattr(gpu_search, "_canary_search", broken)
    with pytest.raises(RuntimeError, match="differs"):
        gpu_search.gpu_canary()
    assert faiss.omp_get_max_threads() == 2


def test_the_quantisers_sample_is_sized_by_its_factory_and_read_from_a_spread_of_shards(tmp_path, monkeypatch):
    """40 embedding shards of 50 vectors: a sample of 100 reads the 8 shards that hold 4x it
    (not all 40, as reading the whole corpus would), drawn in proportion from each, seeded;
    an IVF of 64 lists asks 64 vectors a list. Mutation: every shard read (the former
    loop) fails the count of shards read."""
    from pipeline.retrieval import embeddings as emb
    from pipeline.retrieval import index_build

    rows = np.arange(40 * 50)
    vectors = np.random.default_rng(0).standard_normal((len(rows), 8)).astype(np.float32)
    entries = [
        emb.write_shard(str(tmp_path), i, rows[s], [f"d{r}" for r in rows[s]], vectors[s])
        for i, s in enumerate(np.split(rows, 40))
    ]
    emb.write_manifest(str(tmp_path), 8, entries, normalized=False, similarity="dot", model="m")
    manifest = emb.load_manifest(str(tmp_path))
    read, reader = [], emb.read_shard
    monkeypatch.setattr(emb, "read_shard", lambda folder, entry: read.append(entry["index"]) or reader(folder, entry))
    sample = index_build._train_sample(str(tmp_path), manifest, 100, seed=0)
    assert len(read) == 8 and len(set(read)) == 8 and sample.shape == (104, 8)  # 13 from each of 8
    assert {tuple(v) for v in sample} <= {tuple(v) for v in vectors[np.isin(rows // 50, read)]}
    again = index_build._train_sample(str(tmp_path), manifest, 100, seed=0)
    assert np.array_equal(sample, again)
    assert index_build.training_size("IVF64,Flat", 100) == 4096
    assert index_build.training_size("OPQ16,IVF65536,PQ16", 100_000) == 64 * 65536
    assert index_build.training_size("Flat", 100_000) == 100_000
