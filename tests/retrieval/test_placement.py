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
from pipeline.core.errors import ConfigError
from pipeline.retrieval.encode import EncoderSettings, store_query_vectors
from pipeline.retrieval.faiss_index import READ_AHEAD, IndexConfig, brute_force_topk, load_index_manifest
from pipeline.retrieval.fanout import query_block
from pipeline.retrieval.gpu_search import FAULT_VAR
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.index_memory import plan_memory
from pipeline.retrieval.query_vectors import StoredQueryVectors
from pipeline.retrieval.search import PROCESS_BYTES, SEARCHER_CPUS, SearcherConfig, ShardedIndex, plan_searchers
from tests.helpers import index_of_random_vectors, save_tiny_bert

pytestmark = pytest.mark.ray

DIM, SHARDS, PER_SHARD = 16, 12, 20


@pytest.fixture(scope="module")
def index_of_shards(tmp_path_factory, fake_gpu_ray):
    return index_of_random_vectors(tmp_path_factory.mktemp("placement"), SHARDS, PER_SHARD, DIM, "IVF4,Flat")


def test_gpu_searchers_hold_a_run_of_shards_one_gpu_each_and_reserve_their_memory(index_of_shards, monkeypatch):
    """12 index shards, 2 GPU searchers: one GPU each, 6 shards each, reserving their
    shards' planned memory and a token CPU; the merged top-k is the brute-force one (IVF
    with every list probed). FAISS's GPU path is the tests' stand-in (no CUDA here)."""
    index_uri, vectors, rows = index_of_shards
    monkeypatch.setenv(FAULT_VAR, "none")
    searchers = SearcherConfig(use_gpu=True, gpu_memory_gb=16, searchers=2)
    with ShardedIndex(index_uri, nprobe=4, searchers=searchers) as index:
        stats = index.stats()
        queries = vectors[:5] + 0.01
        scores, found = index.search(queries, 10)
    # The quantiser once a searcher (its shards merge into one index), each shard's lists,
    # and the shards read ahead of the merge (each a whole shard: its quantiser copy too).
    quantiser, shard = (p["bytes"] for p in plan_memory("IVF4,Flat", DIM, [0, PER_SHARD]))
    ahead = min(SHARDS // 2, READ_AHEAD + 1) * shard
    assert [s["shards"] for s in stats] == [SHARDS // 2] * 2
    assert sum(s["vectors"] for s in stats) == len(vectors)
    for searcher in stats:
        reserved = searcher["reserved"]
        assert reserved["GPU"] == 1 and reserved["CPU"] == pytest.approx(SEARCHER_CPUS)
        assert reserved["memory"] == quantiser + 6 * (shard - quantiser) + ahead + PROCESS_BYTES
        assert searcher["indexes"] == 1
        assert searcher["search"] == "faiss-gpu"
    ref_scores, ref_rows = brute_force_topk(queries, vectors, 10, rows=rows)
    assert np.allclose(scores, ref_scores, atol=1e-4) and (found == ref_rows).all()

    # (CPU searchers reserve no GPU: tests/retrieval/test_search_failures.py's cpu fallback; how many
    # hold an index by memory: test_cpu_searchers_follow_the_memory_per_searcher below.)


def _manifest(shard_vectors: list[int], factory: str = "Flat") -> dict:
    return {"factory": factory, "dim": 768, "metric": "ip", "shards": [{"vectors": n} for n in shard_vectors]}


GIB = 2**30
MSMARCO, CORPUS_50M = _manifest([100_000] * 88), _manifest([100_000] * 500)


@pytest.mark.parametrize(
    "manifest,gpu_gb,searchers",
    # A 768-d Flat vector on a GPU: 1,536 bytes in fp16 + an 8-byte id = 1,544 (3,080 in fp32
    # on the host). A searcher may use 0.9 of its card less 1.25 GiB (CUDA context, scratch):
    # 20.35 GiB of 24, 34.75 of 40, 70.75 of 80. MS MARCO (12.65 GiB) fits one of each;
    # 50M (71.9 GiB) needs 4 of 24 GiB (18.0 each), 3 of 40 (24.0), 2 of 80 (36.0).
    [
        (MSMARCO, 24, 1),
        (MSMARCO, 40, 1),
        (MSMARCO, 80, 1),
        (CORPUS_50M, 24, 4),
        (CORPUS_50M, 40, 3),
        (CORPUS_50M, 80, 2),
    ],
)
def test_gpu_searchers_are_as_few_as_hold_the_index_whatever_gpus_are_up(manifest, gpu_gb, searchers):
    """The plan comes from the index's bytes against one GPU's memory, the same with 0, 1,
    4, 8 or 128 GPUs up (an autoscaler is asked for what it needs); one GPU a searcher,
    never more searchers than the memory asks (88 of 0.3 GB each, before). Mutation: the
    count from the GPUs up (``max(1, int(gpus))``) gives 1, 4, 8 and 88 searchers."""
    plans = [
        plan_searchers(manifest, SearcherConfig(use_gpu=True, gpu_memory_gb=gpu_gb), cluster={"GPU": gpus, "CPU": 64})
        for gpus in (0, 1, 4, 8, 128)
    ]
    assert all(plan == plans[0] for plan in plans)
    plan = plans[0]
    assert len(plan) == searchers and all(opts["num_gpus"] == 1.0 for _, opts in plan)
    shards = len(manifest["shards"])
    assert [len(entries) for entries, _ in plan] == [len(run) for run in np.array_split(range(shards), searchers)]
    budget = 0.9 * gpu_gb * GIB - 1.25 * GIB
    assert max(len(entries) for entries, _ in plan) * 100_000 * 1544 <= budget
    if searchers > 1:  # one searcher fewer would not hold its share
        assert -(-shards // (searchers - 1)) * 100_000 * 1544 > budget
    for entries, opts in plan:  # host memory: the fp32 shards the searcher reads, and the process
        assert opts["memory"] == pytest.approx(len(entries) * 100_000 * 3080 + PROCESS_BYTES, rel=1e-4)
    # A query block's answers stay near 256 MiB: thousands of queries, at most 500 blocks for
    # MS MARCO's 502k training queries at depth 200.
    block = query_block(searchers, 200, 768)
    assert 1000 <= block <= 16384 and -(-502_000 // block) <= 500


def test_gpu_memory_comes_from_the_accelerator_type_and_an_index_no_gpu_holds_is_refused():
    """Without gpu_memory_gb, an L4 node up (Ray's ``accelerator_type:L4``) sizes the plan
    as 24 GB does; with no GPU node of a known type up, the setting is asked for. A shard
    larger than a GPU fails before any work, with the sizes and factories that fit."""
    by_type = plan_searchers(CORPUS_50M, SearcherConfig(use_gpu=True), cluster={"GPU": 8, "accelerator_type:L4": 1})
    assert by_type == plan_searchers(CORPUS_50M, SearcherConfig(use_gpu=True, gpu_memory_gb=24), cluster={})
    with pytest.raises(
        ConfigError,
        match=r"set --searchers.accelerator_type \(or --searchers.gpu_memory_gb\) \(no GPU node of a known type is up",
    ):
        plan_searchers(CORPUS_50M, SearcherConfig(use_gpu=True), cluster={"GPU": 8})
    big = _manifest([20_000_000, 20_000_000, 10_000_000])  # 28.8 GiB a shard in fp16
    with pytest.raises(
        ConfigError,
        match=r"index shard 0 needs 28\.8 GiB on a GPU \(SQfp16\), more than the 20\.3 GiB a searcher has of a "
        r"24\.0 GiB GPU: .* such as IVF16384,SQ8 or IVF16384,PQ64",
    ):
        plan_searchers(big, SearcherConfig(use_gpu=True, gpu_memory_gb=24), cluster={})
    assert len(plan_searchers(big, SearcherConfig(use_gpu=True, gpu_memory_gb=40), cluster={})) == 3
    with pytest.raises(ConfigError, match=r"1 searchers hold 71\.9 GiB each on a GPU, more than the 70\.8 GiB"):
        plan_searchers(CORPUS_50M, SearcherConfig(use_gpu=True, gpu_memory_gb=80, searchers=1), cluster={})
    # IVF-PQ codes stay as they are on a GPU: 50M at PQ64 fit one 24 GB card.
    assert (
        len(
            plan_searchers(
                _manifest([100_000] * 500, "IVF65536,PQ64"), SearcherConfig(use_gpu=True, gpu_memory_gb=24), cluster={}
            )
        )
        == 1
    )


def test_cpu_searchers_follow_the_memory_per_searcher_never_more_than_the_shards():
    shard_bytes = plan_memory("Flat", 768, [100_000])[0]["bytes"]
    plan = plan_searchers(MSMARCO, SearcherConfig(memory_gb=10 * shard_bytes / 2**30), cluster={"CPU": 8})
    assert [len(e) for e, _ in plan] == [10] * 7 + [9] * 2 and all(o["num_gpus"] == 0 for _, o in plan)
    assert len(plan_searchers(MSMARCO, SearcherConfig(searchers=500), cluster={})) == 88


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


def test_searchers_pinned_to_a_gpu_type_are_sized_by_it_with_no_gpu_node_up():
    """An autoscaling cluster at zero GPU nodes: searchers pinned to the L4 (the kit's gpu1
    nodes) are planned as 24 GB cards and ask Ray for that type; with an H100 and an L4 node
    up, the pin still plans for the L4, where the searchers will run. Mutation: the plan
    ignoring accelerator_type: refused (no GPU node up), and the options carry no pin."""
    pinned = SearcherConfig(use_gpu=True, accelerator_type="L4")
    plan = plan_searchers(CORPUS_50M, pinned, cluster={"CPU": 8})
    assert [entries for entries, _ in plan] == [
        entries for entries, _ in plan_searchers(CORPUS_50M, SearcherConfig(use_gpu=True, gpu_memory_gb=24), cluster={})
    ]
    assert {options["accelerator_type"] for _, options in plan} == {"L4"}
    mixed = {"GPU": 9, "accelerator_type:H100": 1, "accelerator_type:L4": 1}
    assert len(plan_searchers(CORPUS_50M, pinned, cluster=mixed)) == len(plan)
    on_h100 = plan_searchers(CORPUS_50M, SearcherConfig(use_gpu=True, accelerator_type="H100"), cluster=mixed)
    assert len(on_h100) < len(plan)
    unpinned = plan_searchers(CORPUS_50M, SearcherConfig(use_gpu=True, gpu_memory_gb=24), cluster={})
    assert all("accelerator_type" not in options for _, options in unpinned)
    with pytest.raises(ValueError, match="accelerator_type 'B300' is not one the searcher planner knows"):
        SearcherConfig(use_gpu=True, accelerator_type="B300")
