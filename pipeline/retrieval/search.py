"""Index building and search on Ray: one actor per index shard, queries fanned out, top-k merged.

Building: embedding shards are grouped into index shards (``embedding_shards_per_index``
at a time); a memory plan is printed and checked before anything is built; each index
shard is built by its own Ray task, trained on one seeded sample of the whole corpus so
every shard shares the same quantiser statistics, and persisted with a manifest.

Searching: each :class:`ShardSearcher` actor loads one index shard and answers top-k for a
block of query vectors; the driver merges the per-shard top-k into the exact global top-k
(``pipeline.index.merge_topk``). With exact (Flat) shards the result is the brute-force one.
"""

from __future__ import annotations

import resource

import faiss
import numpy as np
import ray

from pipeline.core import storage
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval import index as faiss_index


class ShardSearcher:
    """A Ray actor serving one index shard."""

    def __init__(self, index_uri: str, entry: dict, nprobe: int, threads: int):
        faiss.omp_set_num_threads(max(1, threads))
        self.index = faiss_index.load_index(storage.join(index_uri, entry["path"]))
        self.nprobe = nprobe

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return faiss_index.search_shard(self.index, queries, min(k, self.index.ntotal), self.nprobe)

    def stats(self) -> dict:
        """What this shard holds, and the peak memory of its process (for sizing)."""

        return {
            "vectors": int(self.index.ntotal),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


class ShardedIndex:
    """The driver's handle on a persisted sharded index: one searcher actor per shard."""

    def __init__(self, index_uri: str, nprobe: int = 32, cpus_per_actor: float = 0.0, threads: int = 1):
        self.uri = storage.resolve(index_uri).uri
        self.manifest = faiss_index.load_index_manifest(self.uri)
        self.metric = self.manifest["metric"]
        self.total = sum(s["vectors"] for s in self.manifest["shards"])
        # No CPU reservation by default: every shard's actor must be up for a search to
        # finish, and reserving a CPU each would leave a shard unscheduled (a hang) whenever
        # shards outnumber free CPUs. Memory, not CPU, is what a shard holds.
        remote = ray.remote(ShardSearcher).options(num_cpus=cpus_per_actor)
        self.actors = [remote.remote(self.uri, s, nprobe, threads) for s in self.manifest["shards"]]

    def __enter__(self) -> "ShardedIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def search(self, queries: np.ndarray, k: int, block: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """Exact merge of every shard's top-k: (scores (q, k), corpus rows (q, k))."""

        faiss_index._check_k(k, self.total)
        scores, rows = [], []
        for start in range(0, len(queries), block):
            part = np.ascontiguousarray(queries[start : start + block], dtype=np.float32)
            results = ray.get([a.search.remote(part, k) for a in self.actors])
            s, r = faiss_index.merge_topk(results, k, self.metric, self.total)
            scores.append(s)
            rows.append(r)
        if not scores:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate(scores), np.concatenate(rows)

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors])

    def doc_ids(self) -> dict[int, str]:
        """corpus row -> doc id, from the embedding shards' id columns (no vectors read)."""
        folder = self.manifest["embeddings"]
        out: dict[int, str] = {}
        for entry in emb.load_manifest(folder)["shards"]:
            table = storage.read_parquet(storage.join(folder, entry["path"]), columns=["row", "doc_id"])
            out.update(zip(table.column("row").to_pylist(), table.column("doc_id").to_pylist()))
        return out

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
