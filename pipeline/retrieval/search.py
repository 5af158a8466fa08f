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
import sys
from dataclasses import dataclass, field
from typing import Literal

import faiss
import numpy as np
import ray

from pipeline.core import storage
from pipeline.core.errors import ArtifactError, ConfigError, ServerError
from pipeline.data.corpus_ids import CorpusIds
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval import faiss_index, gpu_search, index_memory, loading
from pipeline.retrieval.fanout import (
    BLOCKS_IN_FLIGHT,
    ServerLimits,
    ShardFanout,
    death_cause,
    merge_topk,
    query_block,
)
from pipeline.retrieval.gpu_search import FALLBACKS
from pipeline.retrieval.query_vectors import StoredQueryVectors, StoredRows

SEARCHER_CPUS = 0.01  # see plan_searchers
PROCESS_BYTES = 512 * 2**20  # a searcher's own footprint besides its index (Python, FAISS, Ray)
# A searcher's FAISS threads sleep between calls instead of spinning (OpenMP's default spins
# for a while), which took cores from the encoders, block tasks and trainers beside it.
# Read when OpenMP loads, so it goes in the process's environment.
SEARCHER_ENV = {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}


def _searcher_env() -> dict:
    """The runtime env of a searcher and of FAISS's GPU canary: passive OpenMP threads, and
    the test fault (if any) passed on."""
    return {"env_vars": SEARCHER_ENV["env_vars"] | gpu_search.fault_env()}


@dataclass
class SearcherConfig(ServerLimits):
    """The processes that hold a stage's index, sized by the index's bytes against the
    memory of what holds them, not by the index's shards (88 of them at 8.8M passages):
    GPUs with ``use_gpu``, else host memory. Each holds a contiguous run of index shards."""

    use_gpu: bool = field(
        default=False,
        metadata={"help": "searchers hold their shards on GPUs, one GPU each (encoders have their own pool)"},
    )
    searchers: int = field(
        default=0,
        metadata={
            "help": "searcher processes; 0 = as few as hold the index: in gpu_memory_gb each with use_gpu, else in memory_gb each"
        },
    )
    memory_gb: float = field(
        default=0, metadata={"help": "index memory per CPU searcher; 0 = half of the largest node's memory"}
    )
    gpu_memory_gb: float = field(
        default=0,
        metadata={
            "help": "memory of one searcher's GPU, with use_gpu; 0 = the datasheet's for accelerator_type, else for the smallest accelerator type of the GPU nodes up"
        },
    )
    accelerator_type: str = field(
        default="",
        metadata={
            "help": "with use_gpu, the GPU type searchers run on, as Ray names it (L4, A100-40G, H100, ...): they are placed only there and sized by its datasheet memory (what an autoscaling cluster with no GPU node up yet needs); empty = any GPU"
        },
    )
    gpu_fallback: Literal["fail", "torch", "cpu"] = field(
        default="fail",
        metadata={
            "help": "when FAISS's GPU canary or a GPU searcher fails: fail (one line naming it), torch (exact search on the GPU in fp16; Flat indexes) or cpu (FAISS on the host)"
        },
    )
    blocks_in_flight: int = field(
        default=BLOCKS_IN_FLIGHT,
        metadata={"help": "query blocks asked of the searchers ahead of the one the driver merges; 1 = none ahead"},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.searchers < 0 or self.memory_gb < 0 or self.gpu_memory_gb < 0:
            raise ValueError(
                f"searchers, memory_gb and gpu_memory_gb must be >= 0, got {self.searchers}, {self.memory_gb}, {self.gpu_memory_gb}"
            )
        if self.blocks_in_flight < 1:
            raise ValueError(f"blocks_in_flight must be >= 1, got {self.blocks_in_flight}")
        if self.gpu_fallback not in FALLBACKS:
            raise ValueError(f"gpu_fallback must be one of {', '.join(FALLBACKS)}, got {self.gpu_fallback!r}")
        if self.accelerator_type and self.accelerator_type not in gpu_search.GPU_MEMORY_GB:
            raise ValueError(
                f"accelerator_type {self.accelerator_type!r} is not one the searcher planner knows "
                f"({', '.join(gpu_search.GPU_MEMORY_GB)}); set gpu_memory_gb with it left empty"
            )


class IndexSearcher:
    """A Ray actor serving a contiguous run of index shards, from host memory or from its
    GPU, answering for them as one: the exact top-k over its shards. ``mode``: faiss-gpu,
    torch (exact, on its GPU when it has one) or faiss-cpu (see ``gpu_search``)."""

    def __init__(
        self,
        index_uri: str,
        embeddings: str,
        entries: list[dict],
        nprobe: int,
        threads: int,
        mode: str,
        metric: str,
        load_key: str = "",
    ):
        # A searcher holds a share of the corpus that memory sized, not a core's worth: its
        # FAISS threads are the node's cores unless told (one thread made a single CPU
        # searcher of 88 shards search at 41 queries/s on 2 cores, one core idle).
        faiss.omp_set_num_threads(max(1, threads or os.cpu_count() or 1))
        own = [i for entry in entries for i in entry["embedding_shards"]]
        report = loading.LoadReport(load_key, planned=len(entries) + len(own))
        report.add(0)  # up: the process's start (imports, Ray's worker) is behind it
        self.indexes = faiss_index.load_merged_shards(index_uri, entries, on_read=report.add)
        self.shards = len(entries)
        shards = emb.load_manifest(embeddings)["shards"]
        # The run's embedding shards follow on without a gap: one id table for all.
        self.ids = CorpusIds.read(embeddings, [shards[i] for i in own], on_read=report.add)
        self._gpu = None  # FAISS's GPU resources (one scratch space) live as long as the indexes
        if mode == "faiss-gpu":
            for i, index in enumerate(self.indexes):
                self.indexes[i], self._gpu = gpu_search.searcher_to_gpu(index, self._gpu)
            gpu_search.fault("load")
        elif mode == "torch":
            self.indexes = [gpu_search.TorchExactSearch(index, metric) for index in self.indexes]
        self.mode, self.nprobe, self.metric = mode, nprobe, metric
        self.total = sum(int(index.ntotal) for index in self.indexes)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores, corpus rows, doc ids as bytes; b"" for padding), each (queries, k)."""
        if isinstance(queries, StoredRows):
            queries = queries.read()
        if self.mode == "faiss-gpu":
            gpu_search.fault("search")
        if self.mode == "torch":
            found = [index.search(queries, min(k, index.ntotal)) for index in self.indexes]
        else:
            found = [
                faiss_index.search_shard(index, queries, min(k, index.ntotal), self.nprobe) for index in self.indexes
            ]
        scores, rows = found[0] if len(found) == 1 else merge_topk(found, min(k, self.total), self.metric)
        return scores, rows, self.ids.id_bytes(rows)

    def holds(self, doc_ids: np.ndarray) -> np.ndarray:
        return self.ids.holds(doc_ids)

    def stats(self) -> dict:
        """What this searcher holds, where, how it searches, what Ray reserved for it, and
        the peak memory of its process (for sizing)."""

        return {
            "shards": self.shards,
            "indexes": len(self.indexes),  # after merging the shards that share a quantiser
            "vectors": self.total,
            "id_bytes": int(self.ids.nbytes),
            "search": self.mode if self.mode != "torch" else f"torch-{self.indexes[0].device}",
            "on_gpu": self.mode == "faiss-gpu" or (self.mode == "torch" and self.indexes[0].device == "cuda"),
            "reserved": ray.get_runtime_context().get_assigned_resources(),
            "node": ray.get_runtime_context().get_node_id(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


def _largest_node_memory() -> float:
    """Ray's memory resource of the largest alive node (what one process could be given)."""
    return max((n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"]), default=0)


def plan_searchers(
    manifest: dict, cfg: SearcherConfig, cluster: dict | None = None, mode: str | None = None
) -> list[tuple[list[dict], dict]]:
    """The searchers of an index: for each, its contiguous run of index shards and what it
    reserves from Ray. ``mode``: how they search (faiss-gpu with ``use_gpu``, else faiss-cpu).

    - How many: ``cfg.searchers``; else, on GPUs (faiss-gpu, torch), as few as hold the
      index in ``gpu_memory_gb`` each (flat vectors in fp16 there), one GPU each: the same
      plan whether or not GPUs are up, so an autoscaler is asked for what the index needs;
      on CPUs, as many as hold it at ``cfg.memory_gb`` each. Never more than the shards.
      A shard no GPU can hold fails here, before any work, with the sizes and a factory
      that fits.
    - Memory: the index planner's estimate of its shards on the host (where they are read
      and merged), plus the process. Ray then places a searcher only where its shards fit,
      never piling a 25 GiB index on the head.
    - CPU: a token share. Any CPU keeps a searcher off a node that advertises none (the
      head, on our clusters); a whole CPU each could leave searchers unscheduled, and every
      search hanging, on a node whose CPUs the encoders or trainers hold.
    """
    mode = mode or ("faiss-gpu" if cfg.use_gpu else "faiss-cpu")
    shards = manifest["shards"]
    host = _RunBytes(manifest, manifest["factory"])
    on_gpu = mode != "faiss-cpu"
    cluster = ray.cluster_resources() if cluster is None and (on_gpu or not cfg.searchers) else cluster or {}
    if on_gpu:
        held = _RunBytes(manifest, gpu_search.gpu_factory(manifest["factory"]))
        card = gpu_search.gpu_memory_bytes(cfg.gpu_memory_gb, cluster, cfg.accelerator_type)
        budget = gpu_search.usable_bytes(card)
        shard = int(np.argmax(held.per_shard))
        if held.of([shard]) > budget:
            raise ConfigError(
                f"index shard {shard} needs {index_memory.gib(held.of([shard]))} on a GPU ({held.factory}), more than the "
                f"{index_memory.gib(budget)} a searcher has of a {index_memory.gib(card)} GPU: build smaller index shards "
                "(--embedding_shards_per_index), or a compressed factory such as "
                f"{index_memory.compressed_factory(shards[shard]['vectors'], manifest['dim'])}"
            )
        count = cfg.searchers or held.fewest_runs(budget)
    elif cfg.searchers:
        count = cfg.searchers
    else:
        budget = cfg.memory_gb * 2**30 or _largest_node_memory() / 2
        count = math.ceil(host.of(range(len(shards))) / budget) if budget else 1
    runs = np.array_split(np.arange(len(shards)), max(1, min(count, len(shards))))
    if on_gpu and max(map(held.of, runs)) > budget:
        raise ConfigError(
            f"{len(runs)} searchers hold {index_memory.gib(max(map(held.of, runs)))} each on a GPU, more than the {index_memory.gib(budget)} "
            "a searcher has: ask for more (--searchers.searchers) or leave it 0 to size them by memory"
        )
    options: dict = {"num_cpus": SEARCHER_CPUS, "num_gpus": 1.0 if on_gpu else 0.0}
    if on_gpu and cfg.accelerator_type:
        options["accelerator_type"] = cfg.accelerator_type  # Ray's own pin to that GPU type's nodes
    return [
        ([shards[i] for i in run], options | {"memory": host.of(run) + host.loading(run) + PROCESS_BYTES})
        for run in runs
    ]


class _RunBytes:
    """What a searcher holding a run of an index's shards takes in ``factory``'s memory:
    each shard's vectors, and the fixed part (an IVF quantiser, PQ codebooks) once, since
    the shards of one quantiser are merged into one index as the searcher loads them."""

    def __init__(self, manifest: dict, factory: str):
        vectors = [s["vectors"] for s in manifest["shards"]]
        rows = index_memory.plan_memory(factory, manifest["dim"], [0, *vectors], manifest["metric"])
        self.factory, self.fixed = factory, rows[0]["bytes"]
        self.per_shard = [row["bytes"] - self.fixed for row in rows[1:]]

    def of(self, run) -> int:
        return self.fixed + sum(self.per_shard[i] for i in run)

    def loading(self, run) -> int:
        """What a searcher holds besides its index while it loads ``run``: the IVF shards read
        ahead of the one being merged in (each with its own copy of the quantiser); none for
        shards kept as they are read (a Flat index's)."""
        run = list(run)
        if len(run) < 2 or "IVF" not in self.factory:
            return 0
        return min(len(run), faiss_index.READ_AHEAD + 1) * (self.fixed + max(self.per_shard[i] for i in run))

    def fewest_runs(self, budget: int) -> int:
        """The fewest searchers whose even split of the shards into contiguous runs puts at
        most ``budget`` in each."""
        count = max(1, math.ceil(self.of(range(len(self.per_shard))) / budget))
        while max(map(self.of, np.array_split(np.arange(len(self.per_shard)), count))) > budget:
            count += 1
        return count


def query_block_of(index_uri: str, cfg: SearcherConfig, k: int, queries: int = 0) -> int:
    """The default query block of a search of ``queries`` queries of ``index_uri`` to depth
    ``k`` by the searchers ``cfg`` plans (:func:`pipeline.retrieval.fanout.query_block`)."""
    manifest = faiss_index.load_index_manifest(storage.resolve(index_uri).uri, check=False)
    return query_block(len(plan_searchers(manifest, cfg)), k, manifest["dim"], queries)


class ShardedIndex(ShardFanout):
    """The driver's handle on a persisted sharded index: its searcher actors, each holding
    a run of shards and reserving what it holds (:func:`plan_searchers`), searching with
    ``threads`` FAISS threads (0: its node's cores).

    With ``use_gpu``, FAISS's GPU path is proven first by a canary task on a GPU node
    (``gpu_search.gpu_canary``); when the canary or a GPU searcher fails (dead past its
    restarts), the searchers are started again as ``gpu_fallback`` says, or the stage
    fails with one line. ``search_mode`` says how the index is searched, and ``fallback``
    why, when it fell back."""

    label = "search"

    def __init__(self, index_uri: str, nprobe: int = 32, searchers: SearcherConfig | None = None, threads: int = 0):
        self.uri = storage.resolve(index_uri).uri
        self.manifest = faiss_index.load_index_manifest(self.uri)
        self.metric, self.dim = self.manifest["metric"], int(self.manifest["dim"])
        self.total = sum(s["vectors"] for s in self.manifest["shards"])
        stale = [s["path"] for s in self.manifest["shards"] if "embedding_shards" not in s]
        if stale:
            raise ArtifactError(
                f"{storage.join(self.uri, stale[0])}: built before index shards recorded their embedding shards; "
                "rebuild the index (jobs/index.py)"
            )
        self.config = searchers = searchers or SearcherConfig()
        self.limits, self.in_flight = searchers, searchers.blocks_in_flight
        self.nprobe, self.threads = nprobe, threads
        self.fallback: str | None = None
        self.search_mode = "faiss-cpu"
        if searchers.use_gpu:
            plan_searchers(self.manifest, searchers)  # an index no GPU can hold fails before the canary
            failure = self._canary()
            if failure is not None:
                self._start(self._fallback_mode(failure))
                return
            self.search_mode = "faiss-gpu"
        try:
            self._start(self.search_mode)
        except ServerError as failure:
            if self.search_mode != "faiss-gpu":
                raise
            self._start(self._fallback_mode(failure))

    def _start(self, mode: str) -> None:
        plan = plan_searchers(self.manifest, self.config, mode=mode)
        self.search_mode, self.options = mode, [options for _, options in plan]
        self.runs = [(entries[0]["index"], entries[-1]["index"]) for entries, _ in plan]
        searcher = ray.remote(IndexSearcher)
        env = _searcher_env()
        self._serve(
            [
                functools.partial(
                    searcher.options(**options, **self.limits.actor_options(), runtime_env=env).remote,
                    self.uri,
                    self.manifest["embeddings"],
                    entries,
                    self.nprobe,
                    self.threads,
                    mode,
                    self.metric,
                )
                for entries, options in plan
            ],
            reports=True,
        )

    def server_name(self, shard: int) -> str:
        first, last = self.runs[shard]
        return f"{self.search_mode} searcher {shard} of {len(self.actors)} (index shards {first}-{last})"

    def _canary(self) -> ServerError | None:
        """Run FAISS's GPU canary on a GPU node (no retries): None when it passed, else the
        failure, naming the node and the cause."""
        canary = ray.remote(gpu_search.gpu_canary).options(
            num_gpus=1,
            accelerator_type=self.config.accelerator_type or None,  # the GPU type the searchers get
            num_cpus=SEARCHER_CPUS,
            max_retries=0,
            runtime_env=_searcher_env(),
        )
        ref = canary.remote()
        try:
            ray.get(ref, timeout=self.limits.ready_timeout_s)
            return None
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            cause = f"no GPU node ran it within {self.limits.ready_timeout_s:g} s"
        except ray.exceptions.RayTaskError as exc:
            cause = str(getattr(exc, "cause", None) or exc).strip().splitlines()[-1]
        except ray.exceptions.RayError as exc:  # the process died: a FAISS/CUDA abort
            cause = death_cause(exc)
        return ServerError(f"{self.label}: FAISS's GPU canary failed: {cause}")

    def _fallback_mode(self, failure: ServerError) -> str:
        """The mode to search in after ``failure`` of FAISS's GPU path, said on stderr; or
        ``failure`` raised, when the fallback is ``fail``."""
        choice = self.config.gpu_fallback
        if choice == "fail":
            raise ServerError(f"{failure} (--searchers.gpu_fallback torch or cpu searches without FAISS's GPU path)")
        mode = "torch" if choice == "torch" and gpu_search.is_flat(self.manifest["factory"]) else "faiss-cpu"
        self.fallback = str(failure)
        note = (
            ""
            if mode != "faiss-cpu" or choice == "cpu"
            else f" (the torch fallback searches Flat indexes only, not {self.manifest['factory']})"
        )
        print(f"{failure}; searching with {mode} instead{note}", file=sys.stderr, flush=True)
        return mode

    def _recover(self, failure: BaseException) -> bool:
        """A GPU searcher dead past its restarts mid-search: every searcher is started
        again in the fallback mode, when there is one."""
        if self.search_mode != "faiss-gpu" or not isinstance(failure, ServerError):
            return False
        mode = self._fallback_mode(failure)
        self.close()
        self._start(mode)
        return True

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
