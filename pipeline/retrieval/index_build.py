"""Index building on Ray: embedding shards -> FAISS index shards + manifest.

Embedding shards are grouped into index shards (``embedding_shards_per_index`` at a time);
a memory plan is printed and checked before anything is built; each index shard is built
by its own Ray task from one quantiser, trained once (in a task) on a seeded sample drawn
across a spread of the shards (sized by the factory), and persisted with a manifest. A task reserves the GPU it builds on, or sees
none.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import faiss
import numpy as np
import ray

from pipeline.core import parts, storage
from pipeline.core.progress import get_counted
from pipeline.core.runtime import RayConfig
from pipeline.core.sections import Output
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval import faiss_index, index_memory
from pipeline.retrieval.faiss_index import IndexConfig


@dataclass
class IndexJobConfig(
    Output.with_defaults(output="runs/index", notes={"output": "the index shards and their manifest"})
):
    embeddings: str = field(
        default="runs/encode", metadata={"help": "embedding shards + manifest (jobs/encode.py output)"}
    )
    embedding_shards_per_index: int = field(default=1, metadata={"min": 1, "help": "embedding shards per index shard"})
    cpus_per_task: float = field(default=1.0, metadata={"above": 0, "help": "CPUs per index-building task"})
    index: IndexConfig = field(default_factory=IndexConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def check_inputs(self, prefix: str) -> None:
        storage.must_exist(self.embeddings, f"{prefix}embeddings")


def _groups(n_shards: int, per_index: int) -> list[list[int]]:
    return [list(range(i, min(n_shards, i + per_index))) for i in range(0, n_shards, max(1, per_index))]


SAMPLED_SHARDS_MIN = 8  # shards a training sample is drawn from, at the least (all, when fewer)
SAMPLE_SPREAD = 4  # the shards read hold this many times the sample


def training_size(factory: str, train_sample: int) -> int:
    """Vectors to train ``factory`` on: ``train_sample``, or 64 a centroid of an IVF's
    coarse quantiser when that is more (FAISS warns below 39; IVF65536 takes 4.2M)."""
    nlist = faiss_index.ivf_lists(factory)
    return max(train_sample, 64 * nlist)


def _train_sample(folder: str, manifest: dict, n: int, seed: int) -> np.ndarray:
    """A seeded sample of ~n vectors drawn across a seeded spread of the shards: as few as
    hold ``SAMPLE_SPREAD`` x n vectors, at least ``SAMPLED_SHARDS_MIN``, each in proportion
    to its rows. Reading every shard would be the whole corpus (154 GB at 50M x 768)."""
    rng = np.random.default_rng(seed)
    shards = manifest["shards"]
    mean_rows = max(1, manifest["count"] // max(len(shards), 1))
    wanted = max(SAMPLED_SHARDS_MIN, -(-SAMPLE_SPREAD * n // mean_rows))
    chosen = sorted(rng.permutation(len(shards))[:wanted]) if wanted < len(shards) else range(len(shards))
    total = sum(shards[i]["rows"] for i in chosen)
    parts = []
    for i in chosen:
        entry = shards[i]
        take = min(entry["rows"], int(np.ceil(n * entry["rows"] / max(total, 1))))
        if take:
            _, _, vectors = emb.read_shard(folder, entry)
            parts.append(vectors[np.sort(rng.choice(len(vectors), take, replace=False))])
    return np.concatenate(parts) if parts else np.zeros((0, manifest["dim"]), np.float32)


# A build task that reserves no GPU must not use one: Ray 2.60 leaves CUDA_VISIBLE_DEVICES
# as the node has it for such tasks, and FAISS would take every GPU of the node.
NO_GPU = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}


def _train_quantizer(folder: str, manifest: dict, cfg: IndexConfig) -> np.ndarray:
    """The empty index trained once, in a task, on a seeded sample of the whole corpus, as
    FAISS serializes it: every shard's build starts from it (one quantiser for all)."""
    sample = _train_sample(folder, manifest, training_size(cfg.factory, cfg.train_sample), cfg.seed)
    trained = faiss_index.trained_index(cfg.factory, manifest["dim"], cfg.metric, sample, cfg.use_gpu)
    return faiss.serialize_index(trained)


def _build_one(
    folder: str, entries: list[dict], shard_index: int, output: str, cfg: IndexConfig, trained: np.ndarray | None
) -> dict:
    rows, vectors = [], []
    for entry in entries:
        r, _, v = emb.read_shard(folder, entry)
        rows.append(r)
        vectors.append(v)
    index = faiss_index.build_index_shard(
        np.concatenate(vectors),
        np.concatenate(rows),
        cfg.factory,
        cfg.metric,
        trained=None if trained is None else faiss.deserialize_index(trained),
        nprobe=cfg.nprobe,
        use_gpu=cfg.use_gpu,
    )
    path = faiss_index.index_shard_path(shard_index)
    faiss_index.save_index(index, storage.join(output, path))
    # The searcher of this shard reads its doc ids from these: search results leave it as ids.
    embedding_shards = [int(entry["index"]) for entry in entries]
    record = {
        "index": shard_index,
        "path": path,
        "vectors": int(index.ntotal),
        "embedding_shards": embedding_shards,
        # A searcher merges the shards with one key into one index, sized by their list sizes.
        "trained": None if trained is None else faiss_index.trained_key(trained),
        "list_sizes": None if trained is None else faiss_index.list_sizes(index),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # what the build could use
    }
    storage.write_json(storage.join(output, path + ".json"), record)  # after the shard: it is done
    return record


def _builds_on_gpu(cfg: IndexConfig, dim: int, cluster_gpus: float) -> bool:
    """Whether the build tasks reserve a GPU: ``always``; or ``auto`` for an index that
    trains (IVF, PQ: k-means is where a GPU pays) on a cluster that has GPUs. A Flat index
    only copies vectors, so it is built on CPUs."""
    if cfg.use_gpu != "auto":
        return cfg.use_gpu == "always"
    return bool(cluster_gpus) and faiss_index.needs_training(cfg.factory, dim, cfg.metric)


def _made_by(cfg: IndexJobConfig, folder: str) -> dict:
    """What the index shards depend on: the index settings, the grouping, and the embeddings
    (their folder and the stored version of their manifest)."""
    settings = {k: v for k, v in asdict(cfg.index).items() if k not in ("memory_limit_gb", "use_gpu")}
    return {
        "index": settings,
        "embedding_shards_per_index": cfg.embedding_shards_per_index,
        "embeddings": folder,
        "embeddings_version": storage.version(storage.join(folder, "manifest.json")),
    }


def _built(output: str) -> dict[int, dict]:
    """The index shards already built (their records), by shard index: one listing."""
    records = [storage.read_json(uri) for uri in storage.list_files(storage.join(output, "shards"), ".faiss.json")]
    return {record["index"]: record for record in records}


def run_indexing(cfg: IndexJobConfig) -> dict:
    started = time.perf_counter()
    folder, output = storage.resolve(cfg.embeddings).uri, storage.resolve(cfg.output).uri
    manifest = emb.load_manifest(folder)
    emb.check_embedding_shards(folder, manifest)
    dim = manifest["dim"]
    faiss_index.validate_factory(cfg.index.factory, dim, cfg.index.metric)
    groups = _groups(len(manifest["shards"]), cfg.embedding_shards_per_index)
    sizes = [sum(manifest["shards"][i]["rows"] for i in g) for g in groups]
    plan = index_memory.plan_memory(cfg.index.factory, dim, sizes, cfg.index.metric)
    sys.stderr.write(index_memory.format_plan(plan) + "\n")
    index_memory.check_plan(plan, index_memory.memory_limit_bytes(cfg.index.memory_limit_gb))

    made_by = _made_by(cfg, folder)
    parts.claim(output, made_by, ("shards", faiss_index.MANIFEST), "index shard files")
    built = _built(output)  # a rerun builds only the shards it lacks
    todo = [j for j in range(len(groups)) if j not in built]
    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    gpu = _builds_on_gpu(cfg.index, dim, cluster_gpus)
    task = {"num_cpus": 1, "num_gpus": 1} if gpu else {"num_cpus": cfg.cpus_per_task}
    if not gpu and cluster_gpus:  # a cluster without GPUs has none to hide
        task["runtime_env"] = NO_GPU  # (a worker of its own: not the pool's idle ones)
    # Each task sees only what it reserved: a GPU build uses that GPU, a CPU one none.
    index_cfg = replace(cfg.index, use_gpu=cfg.index.use_gpu if gpu else "never")
    trained = None
    if todo and faiss_index.needs_training(cfg.index.factory, dim, cfg.index.metric):
        # Trained once (the same seeded sample as the shards already built), never on the driver.
        trained = ray.remote(_train_quantizer).options(**task, max_retries=3).remote(folder, manifest, index_cfg)
    build = ray.remote(_build_one).options(**task, max_retries=3)
    new = get_counted(
        [build.remote(folder, [manifest["shards"][i] for i in groups[j]], j, output, index_cfg, trained) for j in todo],
        "index",
        "vectors",
        [sizes[j] for j in todo],
    )
    shards = sorted([*built.values(), *new], key=lambda s: s["index"])
    faiss_index.write_index_manifest(
        output,
        factory=cfg.index.factory,
        metric=cfg.index.metric,
        dim=dim,
        shards=shards,
        embeddings=folder,
        made_by=made_by,
    )
    return {
        "job": "index",
        "output": output,
        "factory": cfg.index.factory,
        "shards": len(shards),
        "shards_built": len(todo),
        "quantizers_trained": int(trained is not None),  # once for all the shards built, or none
        "build_gpus": int(gpu),  # per build task
        "version": storage.version(storage.join(output, faiss_index.MANIFEST)),
        "vectors": sum(s["vectors"] for s in shards),
        "dim": dim,
        "planned_bytes": [p["bytes"] for p in plan],
        "seconds": round(time.perf_counter() - started, 2),
    }
