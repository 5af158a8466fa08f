"""What the retrieval actors reserve, on a Ray that declares GPUs it does not have
(``num_gpus=2``, as ``ray start --num-gpus`` on a CPU machine): pools ask for the GPUs their
config names, searchers for the index planner's memory, a token CPU and their share of the
GPUs. CUDA itself is not mocked: an actor given a GPU reports it, and one that would run a
model on it fails, naming the GPU, instead of silently running on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core import storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval.encode import EncoderSettings, store_query_vectors
from pipeline.retrieval.faiss_index import IndexConfig, brute_force_topk, load_index_manifest, plan_memory
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.query_vectors import StoredQueryVectors
from pipeline.retrieval.search import PROCESS_BYTES, SEARCHER_CPUS, SearcherConfig, ShardedIndex, plan_searchers
from tests.helpers import save_tiny_bert

pytestmark = pytest.mark.ray

DIM, SHARDS, PER_SHARD = 16, 12, 20


@pytest.fixture(scope="module")
def index_of_shards(tmp_path_factory, fake_gpu_ray):
    root = tmp_path_factory.mktemp("placement")
    vectors = np.random.default_rng(0).standard_normal((SHARDS * PER_SHARD, DIM)).astype(np.float32)
    rows = np.arange(len(vectors))
    entries = [
        emb.write_shard(str(root / "emb"), i, rows[s], [f"d{r}" for r in rows[s]], vectors[s])
        for i, s in enumerate(np.split(rows, SHARDS))
    ]
    emb.write_manifest(str(root / "emb"), DIM, entries, normalized=False, similarity="dot", model="m")
    run_indexing(
        IndexJobConfig(embeddings=str(root / "emb"), output=str(root / "index"), index=IndexConfig(factory="IVF4,Flat"))
    )
    return str(root / "index"), vectors, rows


def test_one_searcher_per_gpu_holds_a_run_of_shards_and_reserves_its_memory(index_of_shards):
    """12 index shards on a cluster of 2 GPUs: 2 searchers, one GPU each, 6 shards each,
    reserving their shards' planned memory and a token CPU; the merged top-k is the
    brute-force one (IVF with every list probed)."""
    index_uri, vectors, rows = index_of_shards
    with ShardedIndex(index_uri, nprobe=4, searchers=SearcherConfig(use_gpu=True)) as index:
        stats = index.stats()
        queries = vectors[:5] + 0.01
        scores, found = index.search(queries, 10)
    planned = [p["bytes"] for p in plan_memory("IVF4,Flat", DIM, [PER_SHARD] * SHARDS)]
    assert [s["shards"] for s in stats] == [SHARDS // 2] * 2
    assert sum(s["vectors"] for s in stats) == len(vectors)
    for i, searcher in enumerate(stats):
        reserved = searcher["reserved"]
        assert reserved["GPU"] == 1 and reserved["CPU"] == pytest.approx(SEARCHER_CPUS)
        assert reserved["memory"] == sum(planned[i * 6 : (i + 1) * 6]) + PROCESS_BYTES
        assert not searcher["on_gpu"]  # faiss-cpu and no CUDA: served from host memory
    ref_scores, ref_rows = brute_force_topk(queries, vectors, 10, rows=rows)
    assert np.allclose(scores, ref_scores, atol=1e-4) and (found == ref_rows).all()

    # Searchers on CPUs (the encoders may hold the GPUs): none reserved, one searcher for an
    # index this small, unless asked for more.
    with ShardedIndex(index_uri, nprobe=4) as index:
        assert [("GPU" in s["reserved"], s["shards"]) for s in index.stats()] == [(False, SHARDS)]
    with ShardedIndex(index_uri, nprobe=4, searchers=SearcherConfig(searchers=3)) as index:
        assert [s["shards"] for s in index.stats()] == [4, 4, 4]
        assert np.array_equal(index.search(queries, 10)[1], ref_rows)


def test_searchers_follow_the_configuration_not_the_shards_when_no_gpu_is_up():
    """An autoscaling cluster with no GPU node up yet: the searchers asked for each request
    one GPU (the autoscaler adds that many), never one per shard; on CPUs, as many as the
    memory per searcher needs, never more than the shards."""
    manifest = {"factory": "Flat", "dim": 768, "metric": "ip", "shards": [{"vectors": 100_000}] * 88}
    plan = plan_searchers(manifest, SearcherConfig(use_gpu=True), cluster={"CPU": 8})
    assert [opts["num_gpus"] for _, opts in plan] == [1.0] and len(plan[0][0]) == 88
    plan = plan_searchers(manifest, SearcherConfig(use_gpu=True, searchers=4), cluster={"CPU": 8})
    assert [opts["num_gpus"] for _, opts in plan] == [1.0] * 4 and [len(e) for e, _ in plan] == [22] * 4
    plan = plan_searchers(manifest, SearcherConfig(use_gpu=True, searchers=4), cluster={"GPU": 2})
    assert [opts["num_gpus"] for _, opts in plan] == [0.5] * 4  # all four up at once on 2 GPUs
    shard_bytes = plan_memory("Flat", 768, [100_000])[0]["bytes"]
    plan = plan_searchers(manifest, SearcherConfig(memory_gb=10 * shard_bytes / 2**30), cluster={"CPU": 8})
    assert [len(e) for e, _ in plan] == [10] * 7 + [9] * 2 and all(o["num_gpus"] == 0 for _, o in plan)
    assert len(plan_searchers(manifest, SearcherConfig(searchers=500), cluster={})) == 88


def test_index_builds_reserve_the_gpu_they_may_use_or_see_none(index_of_shards, tmp_path):
    """An IVF index trains (k-means): on a cluster with GPUs its build tasks reserve one
    each and see just that one. A Flat index only copies vectors: its tasks reserve no GPU
    and see none (Ray 2.60 would leave them every GPU of the node)."""
    index_uri, vectors, rows = index_of_shards

    def visible_devices(index: str) -> list[str]:  # each shard's build record says what its task saw
        shards = load_index_manifest(index)["shards"]
        return [storage.read_json(storage.join(index, s["path"] + ".json"))["cuda_visible_devices"] for s in shards]

    assert len(visible_devices(index_uri)) == SHARDS and set(visible_devices(index_uri)) <= {"0", "1"}
    flat = run_indexing(
        IndexJobConfig(
            embeddings=load_index_manifest(index_uri)["embeddings"],
            output=str(tmp_path / "flat"),
            index=IndexConfig(factory="Flat"),
        )
    )
    assert visible_devices(flat["output"]) == [""] * SHARDS
    with ShardedIndex(flat["output"]) as index:
        scores, found = index.search(vectors[:5] + 0.01, 10)
    ref_scores, ref_rows = brute_force_topk(vectors[:5] + 0.01, vectors, 10, rows=rows)
    assert np.allclose(scores, ref_scores, atol=1e-4) and (found == ref_rows).all()


def test_an_encoder_pool_asks_for_the_gpus_its_config_names(tmp_path, fake_gpu_ray):
    model = save_tiny_bert(str(tmp_path / "model"), ["a few words to train a tokenizer on"] * 4)
    pool = ActorConfig(actors=2, use_gpu=True, gpus_per_actor=1)
    stored = StoredQueryVectors(lambda b: str(tmp_path / f"queries-{b}.npy"), 3, 3)
    with pytest.raises(Exception, match=r"reserved GPU \[.\d.\] \(pool.use_gpu\) but torch sees no CUDA device"):
        store_query_vectors(EncoderSettings(model=model), lambda b: ["a query"] * 3, [0], pool, stored)
