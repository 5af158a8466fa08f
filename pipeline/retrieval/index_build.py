"""Index building on Ray: embedding shards -> FAISS index shards + manifest.

Embedding shards are grouped into index shards (``embedding_shards_per_index`` at a time);
a memory plan is printed and checked before anything is built; each index shard is built
by its own Ray task, trained on one seeded sample of the whole corpus so every shard
shares the same quantiser statistics, and persisted with a manifest.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import ray

from pipeline.core import parts, storage
from pipeline.core.progress import get_counted
from pipeline.core.runtime import RayConfig
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval import faiss_index
from pipeline.retrieval.faiss_index import IndexConfig


@dataclass
class IndexJobConfig:
    embeddings: str = field(
        default="runs/encode", metadata={"help": "embedding shards + manifest (jobs/encode.py output)"}
    )
    output: str = field(default="runs/index", metadata={"help": "index shards + manifest (local or s3://)"})
    embedding_shards_per_index: int = field(default=1, metadata={"help": "embedding shards per index shard"})
    cpus_per_task: float = field(default=1.0, metadata={"help": "CPUs per index-building task"})
    index: IndexConfig = field(default_factory=IndexConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def _groups(n_shards: int, per_index: int) -> list[list[int]]:
    return [list(range(i, min(n_shards, i + per_index))) for i in range(0, n_shards, max(1, per_index))]


def _train_sample(folder: str, manifest: dict, n: int, seed: int) -> np.ndarray:
    """A seeded sample of ~n vectors drawn across all shards (each shard in proportion)."""
    total = manifest["count"]
    rng = np.random.default_rng(seed)
    parts = []
    for entry in manifest["shards"]:
        take = min(entry["rows"], int(np.ceil(n * entry["rows"] / max(total, 1))))
        if take:
            _, _, vectors = emb.read_shard(folder, entry)
            parts.append(vectors[np.sort(rng.choice(len(vectors), take, replace=False))])
    return np.concatenate(parts) if parts else np.zeros((0, manifest["dim"]), np.float32)


def _build_one(folder: str, entries: list[dict], shard_index: int, output: str, cfg: IndexConfig, train_ref) -> dict:
    train = ray.get(train_ref) if isinstance(train_ref, ray.ObjectRef) else train_ref
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
        train_vectors=train,
        nprobe=cfg.nprobe,
        use_gpu=cfg.use_gpu,
    )
    path = faiss_index.index_shard_path(shard_index)
    faiss_index.save_index(index, storage.join(output, path))
    # The searcher of this shard reads its doc ids from these: search results leave it as ids.
    embedding_shards = [int(entry["index"]) for entry in entries]
    record = {"index": shard_index, "path": path, "vectors": int(index.ntotal), "embedding_shards": embedding_shards}
    storage.write_json(storage.join(output, path + ".json"), record)  # after the shard: it is done
    return record


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
    plan = faiss_index.plan_memory(cfg.index.factory, dim, sizes, cfg.index.metric)
    sys.stderr.write(faiss_index.format_plan(plan) + "\n")
    faiss_index.check_plan(plan, faiss_index.memory_limit_bytes(cfg.index.memory_limit_gb))

    made_by = _made_by(cfg, folder)
    parts.claim(output, made_by, ("shards", faiss_index.MANIFEST), "index shard files")
    built = _built(output)  # a rerun builds only the shards it lacks
    todo = [j for j in range(len(groups)) if j not in built]
    probe = faiss_index._new_index(cfg.index.factory, dim, cfg.index.metric)
    needs_training = todo and not probe.is_trained  # the seeded sample: the same quantiser as the built shards
    train = _train_sample(folder, manifest, cfg.index.train_sample, cfg.index.seed) if needs_training else None
    train_ref = ray.put(train) if train is not None else None
    on_gpu = cfg.index.use_gpu == "always"
    build = ray.remote(_build_one).options(
        num_cpus=1 if on_gpu else cfg.cpus_per_task, num_gpus=1 if on_gpu else 0, max_retries=3
    )
    new = get_counted(
        [
            build.remote(folder, [manifest["shards"][i] for i in groups[j]], j, output, cfg.index, train_ref)
            for j in todo
        ],
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
        "version": storage.version(storage.join(output, faiss_index.MANIFEST)),
        "vectors": sum(s["vectors"] for s in shards),
        "dim": dim,
        "planned_bytes": [p["bytes"] for p in plan],
        "seconds": round(time.perf_counter() - started, 2),
    }
