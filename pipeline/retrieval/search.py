"""Index building and search on Ray: one actor per index shard, queries fanned out, top-k merged.

Building: embedding shards are grouped into index shards (``embedding_shards_per_index``
at a time); a memory plan is printed and checked before anything is built; each index
shard is built by its own Ray task, trained on one seeded sample of the whole corpus so
every shard shares the same quantiser statistics, and persisted with a manifest.

Searching: each :class:`ShardSearcher` actor loads one index shard, and the doc ids of its
rows, and answers top-k for a block of query vectors as (scores, rows, ids); the driver
merges the per-shard top-k into the exact global top-k (``pipeline.retrieval.fanout``). With
exact (Flat) shards the result is the brute-force one. The driver never holds the corpus's
ids: a query block's results arrive as ids, and "is this id in the corpus" (a qrels check)
is asked of the searchers.
"""

from __future__ import annotations

import math
import resource

import faiss
import numpy as np
import ray

from pipeline.core import storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.errors import ArtifactError
from pipeline.data.corpus_ids import CorpusIds
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval import faiss_index
from pipeline.retrieval.fanout import SERVER_RESTARTS, ShardFanout

SEARCHER_CPUS = 0.01  # see searcher_options
PROCESS_BYTES = 512 * 2**20  # a searcher's own footprint besides its index (Python, FAISS, Ray)


class ShardSearcher:
    """A Ray actor serving one index shard, from host memory or from its GPU."""

    def __init__(self, index_uri: str, embeddings: str, entry: dict, nprobe: int, threads: int, use_gpu: bool):
        faiss.omp_set_num_threads(max(1, threads))
        self.index = faiss_index.load_index(storage.join(index_uri, entry["path"]))
        shards = emb.load_manifest(embeddings)["shards"]
        self.ids = CorpusIds.read(embeddings, [shards[i] for i in entry["embedding_shards"]])
        self._gpu = None  # FAISS's GPU resources live as long as the index on the GPU
        if use_gpu:
            self.index, self._gpu = faiss_index.searcher_to_gpu(self.index)
        self.nprobe = nprobe

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores, corpus rows, doc ids as bytes; b"" for padding), each (queries, k)."""
        scores, rows = faiss_index.search_shard(self.index, queries, min(k, self.index.ntotal), self.nprobe)
        return scores, rows, self.ids.id_bytes(rows)

    def holds(self, doc_ids: np.ndarray) -> np.ndarray:
        return self.ids.holds(doc_ids)

    def stats(self) -> dict:
        """What this shard holds, where, what Ray reserved for it, and the peak memory of
        its process (for sizing)."""

        return {
            "vectors": int(self.index.ntotal),
            "id_bytes": int(self.ids.nbytes),
            "on_gpu": self._gpu is not None,
            "reserved": ray.get_runtime_context().get_assigned_resources(),
            "node": ray.get_runtime_context().get_node_id(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


def searcher_options(manifest: dict, pool: ActorConfig | None) -> list[dict]:
    """What each shard's searcher reserves from Ray.

    - Memory: the index planner's estimate of the shard, plus the process. Ray then places
      searchers only where their shards fit, never piling a 25 GiB index on the head.
    - CPU: a token share. Any CPU keeps a searcher off a node that advertises none (the
      head, on our clusters); a whole CPU each would leave shards unscheduled, and every
      search hanging, whenever shards outnumber free CPUs.
    - GPU, with ``pool.use_gpu``: ``pool.gpus_per_actor``, shared out when the cluster has
      fewer GPUs than shards (every shard must be up for a search to finish).
    """
    shards = manifest["shards"]
    plan = faiss_index.plan_memory(
        manifest["factory"], manifest["dim"], [s["vectors"] for s in shards], manifest["metric"]
    )
    gpus = 0.0
    if pool is not None and pool.use_gpu:
        gpus = pool.gpus_per_actor
        available = ray.cluster_resources().get("GPU", 0)
        if available:  # none yet: an autoscaler adds GPU nodes for the request as it stands
            gpus = min(gpus, math.floor(available / len(shards) * 1e4) / 1e4)
    return [{"num_cpus": SEARCHER_CPUS, "num_gpus": gpus, "memory": row["bytes"] + PROCESS_BYTES} for row in plan]


class ShardedIndex(ShardFanout):
    """The driver's handle on a persisted sharded index: one searcher actor per shard,
    each reserving what it holds (:func:`searcher_options`)."""

    def __init__(self, index_uri: str, nprobe: int = 32, pool: ActorConfig | None = None, threads: int = 1):
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
        self.options = searcher_options(self.manifest, pool)
        searcher = ray.remote(ShardSearcher)
        self.actors = [
            searcher.options(**options, **SERVER_RESTARTS).remote(
                self.uri, self.manifest["embeddings"], s, nprobe, threads, options["num_gpus"] > 0
            )
            for s, options in zip(self.manifest["shards"], self.options)
        ]

    def search_blocks(self, queries: np.ndarray, k: int, **kwargs):
        """:meth:`ShardFanout.search_blocks` over query vectors."""
        return super().search_blocks(np.ascontiguousarray(queries, dtype=np.float32), k, **kwargs)

    def search(self, queries: np.ndarray, k: int, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact merge of every shard's top-k: (scores (q, k), corpus rows (q, k)), all
        queries at once (for tests and benchmarks; jobs stream :meth:`search_blocks`)."""

        blocks = [(scores, rows) for _, scores, rows, _ in self.search_blocks(queries, k, block=block)]
        if not blocks:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate([s for s, _ in blocks]), np.concatenate([r for _, r in blocks])

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors])
