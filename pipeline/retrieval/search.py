"""Search on Ray: searcher actors sized by the hardware, queries fanned out, top-k merged.

Index shards are built by ``pipeline.retrieval.index_build``. A :class:`IndexSearcher`
actor loads a contiguous run of them (one searcher per GPU, or as many as the memory per
searcher needs on CPUs, whatever the number of shards), with the doc ids of their rows,
and answers top-k for a block of query vectors as (scores, rows, ids); the driver merges
the searchers' top-k into the exact global top-k (``pipeline.retrieval.fanout``). With
exact (Flat) shards the result is the brute-force one. The driver never holds the corpus's
ids: a query block's results arrive as ids, and "is this id in the corpus" (a qrels check)
is asked of the searchers.
"""

from __future__ import annotations

import functools
import math
import os
import resource
from dataclasses import dataclass, field

import faiss
import numpy as np
import ray

from pipeline.core import storage
from pipeline.core.errors import ArtifactError
from pipeline.data.corpus_ids import CorpusIds
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval import faiss_index
from pipeline.retrieval.fanout import BLOCKS_IN_FLIGHT, SERVER_RESTARTS, ShardFanout, merge_topk
from pipeline.retrieval.query_vectors import StoredQueryVectors

SEARCHER_CPUS = 0.01  # see plan_searchers
PROCESS_BYTES = 512 * 2**20  # a searcher's own footprint besides its index (Python, FAISS, Ray)
# A searcher's FAISS threads sleep between calls instead of spinning (OpenMP's default spins
# for a while), which took cores from the encoders, block tasks and trainers beside it.
# Read when OpenMP loads, so it goes in the process's environment.
SEARCHER_ENV = {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}


@dataclass
class SearcherConfig:
    """The processes that hold a stage's index, sized by the hardware, not by the index's
    shards (88 of them at 8.8M passages): one per GPU with ``use_gpu``, else as many as the
    memory per searcher needs. Each holds a contiguous run of index shards."""

    use_gpu: bool = field(
        default=False,
        metadata={"help": "searchers hold their shards on GPUs, one searcher per GPU (encoders have their own pool)"},
    )
    searchers: int = field(
        default=0,
        metadata={
            "help": "searcher processes; 0 = one per GPU of the cluster with use_gpu (1 while none is up), else as many as memory_gb asks"
        },
    )
    memory_gb: float = field(
        default=0, metadata={"help": "index memory per CPU searcher; 0 = half of the largest node's memory"}
    )
    blocks_in_flight: int = field(
        default=BLOCKS_IN_FLIGHT,
        metadata={"help": "query blocks asked of the searchers ahead of the one the driver merges; 1 = none ahead"},
    )

    def __post_init__(self):
        if self.searchers < 0 or self.memory_gb < 0:
            raise ValueError(f"searchers and memory_gb must be >= 0, got {self.searchers}, {self.memory_gb}")
        if self.blocks_in_flight < 1:
            raise ValueError(f"blocks_in_flight must be >= 1, got {self.blocks_in_flight}")


class IndexSearcher:
    """A Ray actor serving a contiguous run of index shards, from host memory or from its
    GPU, answering for them as one: the exact top-k over its shards."""

    def __init__(
        self,
        index_uri: str,
        embeddings: str,
        entries: list[dict],
        nprobe: int,
        threads: int,
        use_gpu: bool,
        metric: str,
    ):
        # A searcher holds a share of the corpus that memory sized, not a core's worth: its
        # FAISS threads are the node's cores unless told (one thread made a single CPU
        # searcher of 88 shards search at 41 queries/s on 2 cores, one core idle).
        faiss.omp_set_num_threads(max(1, threads or os.cpu_count() or 1))
        self.indexes = faiss_index.load_merged_shards(index_uri, entries)
        self.shards = len(entries)
        shards = emb.load_manifest(embeddings)["shards"]
        # The run's embedding shards follow on without a gap: one id table for all.
        self.ids = CorpusIds.read(embeddings, [shards[i] for entry in entries for i in entry["embedding_shards"]])
        self._gpu = None  # FAISS's GPU resources (one scratch space) live as long as the indexes
        if use_gpu:
            for i, index in enumerate(self.indexes):
                self.indexes[i], self._gpu = faiss_index.searcher_to_gpu(index, self._gpu)
        self.nprobe, self.metric = nprobe, metric
        self.total = sum(int(index.ntotal) for index in self.indexes)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores, corpus rows, doc ids as bytes; b"" for padding), each (queries, k)."""
        found = [faiss_index.search_shard(index, queries, min(k, index.ntotal), self.nprobe) for index in self.indexes]
        scores, rows = found[0] if len(found) == 1 else merge_topk(found, min(k, self.total), self.metric)
        return scores, rows, self.ids.id_bytes(rows)

    def holds(self, doc_ids: np.ndarray) -> np.ndarray:
        return self.ids.holds(doc_ids)

    def stats(self) -> dict:
        """What this searcher holds, where, what Ray reserved for it, and the peak memory of
        its process (for sizing)."""

        return {
            "shards": self.shards,
            "indexes": len(self.indexes),  # after merging the shards that share a quantiser
            "vectors": self.total,
            "id_bytes": int(self.ids.nbytes),
            "on_gpu": self._gpu is not None,
            "reserved": ray.get_runtime_context().get_assigned_resources(),
            "node": ray.get_runtime_context().get_node_id(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


def _largest_node_memory() -> float:
    """Ray's memory resource of the largest alive node (what one process could be given)."""
    return max((n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"]), default=0)


def plan_searchers(manifest: dict, cfg: SearcherConfig, cluster: dict | None = None) -> list[tuple[list[dict], dict]]:
    """The searchers of an index: for each, its contiguous run of index shards and what it
    reserves from Ray. How many: ``cfg.searchers``; else one per GPU of the cluster with
    ``use_gpu`` (one while no GPU is up: the autoscaler adds GPUs for the searchers asked
    for, not a GPU per shard); else as many as hold the index at ``cfg.memory_gb`` each.
    Never more than the shards.

    - Memory: the index planner's estimate of its shards, plus the process. Ray then places
      a searcher only where its shards fit, never piling a 25 GiB index on the head.
    - CPU: a token share. Any CPU keeps a searcher off a node that advertises none (the
      head, on our clusters); a whole CPU each could leave searchers unscheduled, and every
      search hanging, on a node whose CPUs the encoders or trainers hold.
    - GPU, with ``use_gpu``: one each, shared out when more searchers are asked for than
      the cluster has GPUs (every searcher must be up for a search to finish).
    """
    shards = manifest["shards"]
    sizes = [
        row["bytes"]
        for row in faiss_index.plan_memory(
            manifest["factory"], manifest["dim"], [s["vectors"] for s in shards], manifest["metric"]
        )
    ]
    cluster = ray.cluster_resources() if cluster is None else cluster
    gpus = cluster.get("GPU", 0)
    if cfg.searchers:
        count = cfg.searchers
    elif cfg.use_gpu:
        count = max(1, int(gpus))
    else:
        budget = cfg.memory_gb * 2**30 or _largest_node_memory() / 2
        count = math.ceil(sum(sizes) / budget) if budget else 1
    count = max(1, min(count, len(shards)))
    share = 0.0
    if cfg.use_gpu:
        share = min(1.0, math.floor(gpus / count * 1e4) / 1e4) if gpus else 1.0
    plan = []
    for run in np.array_split(np.arange(len(shards)), count):
        memory = sum(sizes[i] for i in run) + PROCESS_BYTES
        plan.append(([shards[i] for i in run], {"num_cpus": SEARCHER_CPUS, "num_gpus": share, "memory": memory}))
    return plan


class ShardedIndex(ShardFanout):
    """The driver's handle on a persisted sharded index: its searcher actors, each holding
    a run of shards and reserving what it holds (:func:`plan_searchers`), searching with
    ``threads`` FAISS threads (0: its node's cores)."""

    def __init__(self, index_uri: str, nprobe: int = 32, searchers: SearcherConfig | None = None, threads: int = 0):
        self.uri = storage.resolve(index_uri).uri
        self.manifest = faiss_index.load_index_manifest(self.uri)
        self.metric = self.manifest["metric"]
        self.total = sum(s["vectors"] for s in self.manifest["shards"])
        stale = [s["path"] for s in self.manifest["shards"] if "embedding_shards" not in s]
        if stale:
            raise ArtifactError(
                f"{storage.join(self.uri, stale[0])}: built before index shards recorded their embedding shards; "
                "rebuild the index (jobs/index.py)"
            )
        searchers = searchers or SearcherConfig()
        self.in_flight = searchers.blocks_in_flight
        plan = plan_searchers(self.manifest, searchers)
        self.options = [options for _, options in plan]
        searcher = ray.remote(IndexSearcher)
        self._serve(
            [
                functools.partial(
                    searcher.options(**options, **SERVER_RESTARTS, runtime_env=SEARCHER_ENV).remote,
                    self.uri,
                    self.manifest["embeddings"],
                    entries,
                    nprobe,
                    threads,
                    options["num_gpus"] > 0,
                    self.metric,
                )
                for entries, options in plan
            ]
        )

    def search_blocks(self, queries: np.ndarray | StoredQueryVectors, k: int, **kwargs):
        """:meth:`ShardFanout.search_blocks` over query vectors (an array, or stored by block:
        read a block at a time)."""
        if not isinstance(queries, StoredQueryVectors):
            queries = np.ascontiguousarray(queries, dtype=np.float32)
        return super().search_blocks(queries, k, **kwargs)

    def search(self, queries: np.ndarray, k: int, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact merge of every shard's top-k: (scores (q, k), corpus rows (q, k)), all
        queries at once (for tests and benchmarks; jobs stream :meth:`search_blocks`)."""

        blocks = [(scores, rows) for _, scores, rows, _ in self.search_blocks(queries, k, block=block)]
        if not blocks:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate([s for s, _ in blocks]), np.concatenate([r for _, r in blocks])

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors])
