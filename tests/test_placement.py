"""What the retrieval actors reserve, on a Ray that declares GPUs it does not have
(``num_gpus=2``, as ``ray start --num-gpus`` on a CPU machine): pools ask for the GPUs their
config names, searchers for the index planner's memory, a token CPU and their share of the
GPUs. CUDA itself is not mocked: an actor given a GPU reports it, and one that would run a
model on it fails, naming the GPU, instead of silently running on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from pipeline.core import storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval.encode import EncoderSettings, encode_queries
from pipeline.retrieval.faiss_index import IndexConfig, brute_force_topk, load_index_manifest, plan_memory
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.search import PROCESS_BYTES, SEARCHER_CPUS, ShardedIndex
from tests.helpers import save_tiny_bert

pytestmark = pytest.mark.ray

DIM, SHARDS, PER_SHARD = 16, 4, 50


@pytest.fixture(scope="module")
def fake_gpu_ray():
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def index_of_four_shards(tmp_path_factory, fake_gpu_ray):
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


def test_searchers_reserve_the_planned_memory_a_token_cpu_and_a_share_of_the_gpus(index_of_four_shards):
    index_uri, vectors, rows = index_of_four_shards
    pool = ActorConfig(use_gpu=True, gpus_per_actor=1)
    with ShardedIndex(index_uri, nprobe=4, pool=pool) as index:
        stats = index.stats()
        queries = vectors[:5] + 0.01
        scores, found = index.search(queries, 10)
    planned = plan_memory("IVF4,Flat", DIM, [PER_SHARD] * SHARDS)
    for shard, plan in zip(stats, planned):
        reserved = shard["reserved"]
        # Four shards, two GPUs: half a GPU each, so every shard is up at once.
        assert reserved["GPU"] == pytest.approx(0.5) and reserved["CPU"] == pytest.approx(SEARCHER_CPUS)
        assert reserved["memory"] == plan["bytes"] + PROCESS_BYTES
        assert not shard["on_gpu"]  # faiss-cpu and no CUDA: served from host memory
    ref_scores, ref_rows = brute_force_topk(queries, vectors, 10, rows=rows)
    assert np.allclose(scores, ref_scores, atol=1e-4) and (found == ref_rows).all()

    # Without use_gpu, no GPU is reserved.
    with ShardedIndex(index_uri, nprobe=4) as index:
        assert all("GPU" not in s["reserved"] for s in index.stats())


def test_index_builds_reserve_the_gpu_they_may_use_or_see_none(index_of_four_shards, tmp_path):
    """An IVF index trains (k-means): on a cluster with GPUs its build tasks reserve one
    each and see just that one. A Flat index only copies vectors: its tasks reserve no GPU
    and see none (Ray 2.60 would leave them every GPU of the node)."""
    index_uri, vectors, rows = index_of_four_shards

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
    with pytest.raises(Exception, match=r"reserved GPU \[.\d.\] \(pool.use_gpu\) but torch sees no CUDA device"):
        encode_queries(EncoderSettings(model=model), ["a query"] * 3, pool)
