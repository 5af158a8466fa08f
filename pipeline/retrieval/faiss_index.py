"""FAISS index shards over an embeddings folder: planning, building, saving and search.

Layout under the index URI (local or s3://)::

    manifest.json                 factory, metric, dim, shards, source embeddings; written last
    shards/index-00000.faiss      one serialized FAISS index per embedding shard group

Every index returns global corpus rows (int64) as ids, so per-shard results merge into
the global top-k without any offset bookkeeping. Memory is planned before anything is
built (pipeline/retrieval/index_memory.py).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal

import faiss
import numpy as np

from pipeline.core import storage
from pipeline.core.errors import ArtifactError, ConfigError
from pipeline.retrieval.fanout import check_k, check_metric, merge_topk, smallest

MANIFEST = "manifest.json"
FORMAT = "raydense-index-v1"
_FAISS_CONTEXT = re.compile(r"^Error in .*? at \S+:\d+: (?:Error: '.*?' failed: )?", re.S)


@dataclass
class IndexConfig:
    factory: str = field(
        default="Flat", metadata={"help": "FAISS index_factory string: Flat, IVF4096,Flat, IVF4096,PQ64, HNSW32, ..."}
    )
    metric: Literal["ip", "l2"] = field(default="ip", metadata={"help": "ip (inner product) or l2"})
    train_sample: int = field(
        default=100_000,
        metadata={
            "min": 1,
            "help": "vectors sampled (seeded, from a spread of the shards) to train indexes that need training; at least 64 per IVF list",
        },
    )
    nprobe: int = field(default=32, metadata={"min": 1, "help": "IVF lists searched per query"})
    memory_limit_gb: float = field(
        default=0, metadata={"min": 0, "help": "memory one index shard may use; 0 = the machine's available memory"}
    )
    use_gpu: Literal["auto", "never", "always"] = field(
        default="auto", metadata={"help": "auto (when FAISS sees a GPU), never or always"}
    )
    seed: int = field(default=0, metadata={"min": 0, "help": "seed of the training sample"})


def faiss_reason(exc: Exception) -> str:
    """FAISS's own reason, without the C++ function signature and source line around it."""
    return _FAISS_CONTEXT.sub("", str(exc)).strip()


def _metric(metric: str) -> int:
    check_metric(metric)
    return faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def new_index(factory: str, dim: int, metric: str):
    try:
        index = faiss.index_factory(int(dim), factory, _metric(metric))
    except RuntimeError as exc:
        raise ConfigError(f"FAISS rejects the index factory {factory!r} for dim {dim}: {faiss_reason(exc)}") from exc
    _skip_polysemous_training(index)
    # IVF indexes store ids in their lists; the others need a map (IndexIDMap, not IDMap2:
    # we never reconstruct by id, so its reverse hash map would be RAM for nothing).
    if faiss.try_extract_index_ivf(index) is None and not isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        index = faiss.IndexIDMap(index)
    return index


def index_parts(index):
    """``index`` and the indexes inside it, outermost first, each downcast to its own type.
    ``index`` must outlive them: FAISS's wrappers own what they wrap."""
    part = index
    while part is not None:
        part = faiss.downcast_index(part)
        yield part
        # A transform's or an ID map's index, a refinement's base, an HNSW's storage.
        part = next((getattr(part, a) for a in ("index", "base_index", "storage") if getattr(part, a, None)), None)


def _skip_polysemous_training(index) -> None:
    """PQ indexes train a polysemous code order by default (what the factory's ``np`` suffix
    turns off): ~1.5 s a sub-quantiser on one core, whatever the training set, so a minute or
    more for PQ64. Only a polysemous search (``polysemous_ht``) reads that order, and none
    here sets it: a search gives the same answers without it."""
    for part in index_parts(index):
        if hasattr(part, "do_polysemous_training"):
            part.do_polysemous_training = False


def ivf_lists(factory: str) -> int:
    """The coarse quantiser's lists of an IVF factory (0 for others)."""
    m = re.search(r"(?:^|,)IVF(\d+)", factory.strip())
    return int(m.group(1)) if m else 0


def needs_training(factory: str, dim: int, metric: str = "ip") -> bool:
    """Whether ``factory`` learns from data (IVF centroids, PQ codebooks) before vectors go in."""
    return not new_index(factory, dim, metric).is_trained


def validate_factory(factory: str, dim: int, metric: str = "ip") -> None:
    """Fail with FAISS's own reason (not its C++ stack) before any data is read."""
    new_index(factory, dim, metric)


# --- building ----------------------------------------------------------------------------


def resolve_gpu(use_gpu: str) -> bool:
    if use_gpu not in ("auto", "never", "always"):
        raise ConfigError(f"use_gpu={use_gpu!r} is not one of auto, never, always")
    if use_gpu == "never":
        return False
    available = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    if use_gpu == "always" and not available:
        raise ConfigError(
            "use_gpu='always' but FAISS sees no GPU (faiss-cpu is installed, or no CUDA "
            "device is visible): install the gpu extra (faiss-gpu), or use auto/never"
        )
    return available


def to_gpu(index):
    """The index on every visible GPU (replicated), for building or searching."""
    try:
        return faiss.index_cpu_to_all_gpus(index)
    except RuntimeError as exc:
        raise ValueError(f"FAISS cannot move {type(index).__name__} to the GPU: {exc}") from exc


SEARCH_TEMP_BYTES = 256 * 2**20  # FAISS's GPU scratch per searcher (its default is 1.5 GiB)


def searcher_to_gpu(index, resources=None, fp16: bool = False):
    """(index, gpu resources) with the index on this process's first visible GPU, for
    searching: Flat, IVF-Flat, IVF-SQ and IVF-PQ all move (PQ lookup tables in fp16, which
    lets codes of up to 96 bytes fit in shared memory; with ``fp16``, flat vectors too, at
    half the memory). ``resources``: the ones a searcher's other shards already use (one
    scratch space per process). A clear error when FAISS has no GPU build or sees no
    CUDA device: a searcher that reserved a GPU never searches on the CPU unsaid."""
    if not (hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0):
        raise ConfigError(
            "this searcher reserved a GPU but FAISS sees none (faiss-cpu is installed, or no CUDA device is "
            "visible): install the gpu extra (faiss-gpu) on the GPU nodes, or set --searchers.gpu_fallback"
        )
    if resources is None:
        resources = faiss.StandardGpuResources()
        resources.setTempMemory(SEARCH_TEMP_BYTES)
    options = faiss.GpuClonerOptions()
    options.useFloat16LookupTables = True
    options.useFloat16 = fp16
    try:
        return faiss.index_cpu_to_gpu(resources, 0, index, options), resources
    except RuntimeError as exc:
        raise ValueError(f"FAISS cannot move {type(index).__name__} to the GPU: {faiss_reason(exc)}") from exc


def _on_gpu(index) -> bool:
    if not hasattr(faiss, "GpuIndex"):
        return False
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.GpuIndex, faiss.IndexReplicas, faiss.IndexShards)):
        return True
    inner = getattr(index, "index", None)
    return inner is not None and _on_gpu(inner)


def set_nprobe(index, nprobe: int) -> None:
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = max(1, min(int(nprobe), ivf.nlist))
    elif _on_gpu(index):
        try:
            faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", int(nprobe))
        except RuntimeError:
            pass  # not an IVF index: nothing to set


def sample_vectors(vectors: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """A seeded sample of ``n`` rows (all of them when there are fewer), in their original order."""
    if len(vectors) <= n:
        return vectors
    return vectors[np.sort(np.random.default_rng(seed).choice(len(vectors), n, replace=False))]


def _onto_gpu(index, use_gpu: str) -> tuple[object, bool]:
    """(index, on GPU): moved when ``use_gpu`` allows and FAISS can; ``auto`` keeps an index
    that has no GPU version (e.g. HNSW) on the CPU, ``always`` fails on it."""
    if not resolve_gpu(use_gpu):
        return index, False
    try:
        return to_gpu(index), True
    except ValueError:
        if use_gpu == "always":
            raise
        return index, False


def trained_index(factory: str, dim: int, metric: str, train_vectors: np.ndarray, use_gpu: str = "auto"):
    """An empty CPU index of ``factory`` trained on ``train_vectors`` (the quantiser every
    shard then fills); an index that needs no training comes back as it is made."""
    index, gpu = _onto_gpu(new_index(factory, dim, metric), use_gpu)
    if not index.is_trained:
        train = _f32(train_vectors)
        try:
            index.train(train)
        except RuntimeError as exc:
            raise ConfigError(f"cannot train {factory!r} on {len(train)} vectors: {faiss_reason(exc)}") from exc
    return faiss.index_gpu_to_cpu(index) if gpu else index


def build_index_shard(
    embeddings: np.ndarray,
    rows: np.ndarray,
    factory: str = "Flat",
    metric: str = "ip",
    *,
    trained=None,
    train_vectors: np.ndarray | None = None,
    nprobe: int = 32,
    use_gpu: str = "auto",
):
    """A CPU FAISS index of ``embeddings`` whose ids are the corpus ``rows``.

    It starts from ``trained`` (an empty index from :func:`trained_index`, shared by every
    shard of a corpus, so all have one quantiser), or else is trained on ``train_vectors``
    (else on the shard itself). With a GPU the index is filled there and brought back to
    the CPU, ready to save.
    """
    x, ids = _f32(embeddings), np.ascontiguousarray(rows, dtype=np.int64)
    if x.ndim != 2 or len(ids) != len(x):
        raise ValueError(f"{len(ids)} rows for embeddings of shape {x.shape}")
    if trained is None:
        trained = trained_index(factory, x.shape[1], metric, x if train_vectors is None else train_vectors, use_gpu)
    index, gpu = _onto_gpu(faiss.clone_index(trained), use_gpu)
    index.add_with_ids(x, ids)
    if gpu:
        index = faiss.index_gpu_to_cpu(index)
    set_nprobe(index, nprobe)
    return index


# --- persistence -------------------------------------------------------------------------


def index_shard_path(index: int) -> str:
    return f"shards/index-{index:05d}.faiss"


def save_index(index, uri: str) -> None:
    """Stream the index to ``uri`` (local or S3) without a second in-memory copy; it appears
    under its final name only once complete."""
    if _on_gpu(index):
        index = faiss.index_gpu_to_cpu(index)
    with storage.open_output(uri) as f:
        writer = faiss.PyCallbackIOWriter(f.write)
        try:
            faiss.write_index(index, writer)
        finally:
            del writer  # flushes the writer's buffer into f before f closes


def load_index(uri: str):
    with storage.open_input(uri) as f:
        reader = faiss.PyCallbackIOReader(f.read)
        try:
            return faiss.read_index(reader)
        except RuntimeError as exc:
            raise ArtifactError(f"{uri} is not a readable FAISS index: {faiss_reason(exc)}") from exc
        finally:
            del reader


def write_index_manifest(
    index_uri: str,
    *,
    factory: str,
    metric: str,
    dim: int,
    shards: list[dict],
    embeddings: str,
    made_by: dict | None = None,
) -> dict:
    manifest = {
        "format": FORMAT,
        "factory": factory,
        "metric": metric,
        "dim": int(dim),
        "shards": sorted(
            (
                {
                    "index": int(s["index"]),
                    "path": s["path"],
                    "vectors": int(s["vectors"]),
                    "embedding_shards": [int(i) for i in s["embedding_shards"]],
                    "trained": s.get("trained"),  # see trained_key
                }
                for s in shards
            ),
            key=lambda s: s["index"],
        ),
        "embeddings": embeddings,
        "made_by": made_by or {},
        "completed": True,
    }
    storage.write_json(storage.join(index_uri, MANIFEST), manifest, keep_same=True)
    return manifest


def load_index_manifest(index_uri: str, *, check: bool = True) -> dict:
    """Read an index folder's manifest; with ``check``, every shard file must exist."""
    manifest = storage.read_manifest(
        index_uri,
        FORMAT,
        ArtifactError,
        "build the index first (or the build did not finish)",
        "the index build did not finish",
    )
    for shard in manifest["shards"] if check else []:
        shard_uri = storage.join(index_uri, shard["path"])
        if not storage.exists(shard_uri):
            raise ArtifactError(f"index shard {storage.resolve(shard_uri).describe()} is missing")
    return manifest


def load_index_shards(index_uri: str, manifest: dict) -> list:
    return [load_index(storage.join(index_uri, s["path"])) for s in manifest["shards"]]


# --- search ------------------------------------------------------------------------------


def trained_key(trained: np.ndarray) -> str:
    """A fingerprint of a serialized trained (empty) index: shards filled from the same one
    share their quantiser and codec, and only such shards may be merged."""
    return hashlib.sha256(np.ascontiguousarray(trained).tobytes()).hexdigest()[:16]


def list_sizes(index) -> list[int] | None:
    """The number of entries in each inverted list of an IVF index (None for any other):
    kept in each shard's record, so that a searcher can merge shards at their exact size."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None:
        return None
    return [int(ivf.invlists.list_size(i)) for i in range(ivf.nlist)]


def _mergeable_sizes(index_uri: str, entry: dict) -> list[int] | None:
    """The list sizes the shard's record keeps, when the shard has a trained key (an IVF
    shard built from the corpus's one trained index); None otherwise (nothing to merge by,
    or built before sizes were recorded)."""
    if not entry.get("trained"):
        return None
    record = storage.join(index_uri, entry["path"] + ".json")
    return storage.read_json(record).get("list_sizes") if storage.exists(record) else None


# Index shards a searcher reads side by side: their GETs (or file reads) and FAISS's parse
# overlap, where one at a time left a searcher of 500M passages hours from ready. An IVF
# run's shards are merged one after another as they arrive, so at most this many more are
# held at once besides the merged index.
READ_AHEAD = 4


def load_merged_shards(index_uri: str, entries: list[dict], on_read: Callable[[], None] | None = None) -> list:
    """The index shards of ``entries``, read ``READ_AHEAD`` at a time in threads, with each
    run of consecutive IVF shards filled from one trained index (the same ``trained`` key)
    merged into one index; ``on_read()`` after each shard is read.

    A query then ranks the quantiser's centroids once instead of once per shard (88 times at
    8.8M passages in shards of 100k, most of a CPU searcher's time) and probes the same
    lists, so the results are the per-shard top-k merged, ties aside. Each merged list is
    sized once, from the sizes the shards' records keep, and each shard's lists are merged in
    by FAISS's C++ (``InvertedLists.merge_from``) as the shard is read, then the shard is
    freed. (Appending shard after shard into unsized lists would grow every list by
    doubling: twice the memory.)
    """
    with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="read-index") as pool:
        sizes = list(pool.map(functools.partial(_mergeable_sizes, index_uri), entries))
        groups: list[list[tuple[dict, list[int] | None]]] = []
        for entry, entry_sizes in zip(entries, sizes):
            last = groups[-1][0] if groups else None
            mergeable = entry_sizes is not None and last is not None and last[1] is not None
            if mergeable and last[0]["trained"] == entry["trained"]:
                groups[-1].append((entry, entry_sizes))
            else:
                groups.append([(entry, entry_sizes)])
        shards = _read_in_order(pool, index_uri, list(zip(entries, sizes)), on_read or (lambda: None))
        return [index for group in groups for index in _load_merged(group, shards)]


def _read_in_order(pool: ThreadPoolExecutor, index_uri: str, members: list, on_read: Callable[[], None]):
    """The shards of ``members`` in order, each read in ``pool`` with up to ``READ_AHEAD``
    more being read behind it."""
    ahead: deque = deque()
    for member in members:
        ahead.append(pool.submit(_read_with_sizes, index_uri, *member))
        if len(ahead) > READ_AHEAD:
            yield _arrived(ahead.popleft(), on_read)
    while ahead:
        yield _arrived(ahead.popleft(), on_read)


def _arrived(read: Future, on_read: Callable[[], None]):
    index = read.result()
    on_read()
    return index


def _read_with_sizes(index_uri: str, entry: dict, sizes: list[int] | None):
    uri = storage.join(index_uri, entry["path"])
    index = load_index(uri)
    if sizes is not None and list_sizes(index) != sizes:
        raise ArtifactError(f"index shard {uri}: its inverted lists do not match its record ({uri}.json)")
    return index


def _load_merged(group: list[tuple[dict, list[int] | None]], shards: Iterator) -> list:
    """The ``len(group)`` next of ``shards`` (read in order), merged where they can be."""
    merged = next(shards)
    ivf = faiss.try_extract_index_ivf(merged)
    lists = None if ivf is None else faiss.downcast_InvertedLists(ivf.invlists)
    if len(group) == 1 or not isinstance(lists, faiss.ArrayInvertedLists):  # (lists on disk: left apart)
        return [merged, *(next(shards) for _ in group[1:])]
    filled = np.asarray(group[0][1], dtype=np.int64)
    totals = np.sum([sizes for _, sizes in group], axis=0, dtype=np.int64)
    for i in np.flatnonzero(totals > filled):
        # Each list's room for every shard's entries, once: a vector resized down keeps its
        # capacity, so FAISS's merge below appends in place instead of growing by doubling.
        lists.resize(int(i), int(totals[i]))
        lists.resize(int(i), int(filled[i]))
    for _ in group[1:]:
        shard = next(shards)
        source = faiss.extract_index_ivf(shard).invlists
        lists.merge_from(source, 0)  # in FAISS's C++, every list at once; the ids kept as they are
        ivf.ntotal += shard.ntotal
        if int(ivf.this) != int(merged.this):  # a wrapper (e.g. a pre-transform) counts its own
            merged.ntotal += shard.ntotal
        del shard, source
    return [merged]


def search_shard(index, queries: np.ndarray, k: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(scores (q, k) float32, rows (q, k) int64)``; missing results are row -1, as FAISS pads."""
    if nprobe is not None:
        set_nprobe(index, nprobe)
    scores, rows = index.search(_f32(queries), int(k))
    return scores.astype(np.float32, copy=False), rows.astype(np.int64, copy=False)


def search_shards(
    indexes: list, queries: np.ndarray, k: int, metric: str = "ip", nprobe: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Search every shard and merge: the global top-k over the whole corpus."""
    total = sum(index.ntotal for index in indexes)
    check_k(k, total)
    results = [search_shard(index, queries, min(k, index.ntotal), nprobe) for index in indexes if index.ntotal]
    return merge_topk(results, k, metric, total)


def brute_force_topk(
    queries: np.ndarray, vectors: np.ndarray, k: int, metric: str = "ip", rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Exact numpy reference: scores (inner products, or squared L2 as FAISS reports them)
    and ``rows`` (positions when not given) of the top-k."""
    q, v = _f32(queries), _f32(vectors)
    check_metric(metric)
    check_k(k, len(v))
    scores = q @ v.T
    if metric == "l2":
        scores = (q * q).sum(1)[:, None] - 2 * scores + (v * v).sum(1)[None]
    top = smallest(-scores if metric == "ip" else scores, k)
    ids = top if rows is None else np.asarray(rows, dtype=np.int64)[top]
    return np.take_along_axis(scores, top, 1), ids.astype(np.int64)
