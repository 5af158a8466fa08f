"""Searching on GPUs: what a searcher's GPU can hold, a canary that proves FAISS's GPU path
on a node before any searcher is built, and exact search with torch as its fallback.

A FAISS GPU build can fail in ways no Python code catches: a missing kernel for the chip, a
CUDA or cuBLAS clash, an abort in the C++ code. Each takes the whole process down, and a
server that Ray restarts for ever hangs the stage. So :func:`gpu_canary` (run as a Ray task
with no retries, on a GPU node) moves a tiny Flat and a tiny IVF-PQ index to the GPU and
searches them first. When it or a GPU searcher fails, the search falls back (a setting):
``torch``, an exact search held in fp16 on the searcher's GPU (matrix product and top-k, for
Flat indexes), or ``cpu``, FAISS on the host; or ``fail`` ends the stage with one line.

``RAYDENSE_TEST_GPU_FAULT`` (tests only) stands in for a FAISS GPU build on a machine with
none: set, FAISS's GPU moves are no-ops, and its value names the step that aborts the
process as a broken build would: ``canary``, ``load`` (a searcher moving its shards) or
``search``; ``load-oom`` raises FAISS's out-of-memory error at the load instead, as a GPU
smaller than the plan's does. Unset, nothing of it runs.
"""

from __future__ import annotations

import os

import faiss
import numpy as np

from pipeline.core.errors import ConfigError
from pipeline.retrieval import faiss_index

FAULT_VAR = "RAYDENSE_TEST_GPU_FAULT"
FAULT_MARKS_VAR = "RAYDENSE_TEST_GPU_FAULT_MARKS"  # a folder: each abort leaves a file there first
SEARCH_MODES = ("faiss-gpu", "torch", "faiss-cpu")
FALLBACKS = ("fail", "torch", "cpu")

# Datasheet memory of the GPUs Ray names in its ``accelerator_type:<name>`` resources.
GPU_MEMORY_GB = {
    "H200": 141,
    "H100": 80,
    "A100-80G": 80,
    "A100-40G": 40,
    "A100": 40,
    "L40S": 48,
    "L40": 48,
    "A10G": 24,
    "A10": 24,
    "L4": 24,
    "T4": 16,
    "V100": 16,
}
# What a searcher's GPU keeps besides the index: the CUDA context and FAISS's scratch space,
# and a tenth of the card for the allocator's fragmentation and the query blocks.
GPU_RESERVED_BYTES = 2**30 + faiss_index.SEARCH_TEMP_BYTES
GPU_USABLE_SHARE = 0.9


def fault(step: str) -> None:
    """Abort this process at ``step`` when a test asks for it (see the module's doc)."""
    if os.environ.get(FAULT_VAR) == f"{step}-oom":
        raise RuntimeError(
            "Error in virtual void* faiss::gpu::StandardGpuResourcesImpl::allocMemory(const faiss::gpu::AllocRequest&) "
            "at StandardGpuResources.cpp:530: Error: 'err == cudaSuccess' failed: cudaMalloc error 2 [out of memory]"
        )
    if os.environ.get(FAULT_VAR) == step:
        marks = os.environ.get(FAULT_MARKS_VAR)
        if marks:  # a test counts the processes that got this far (a restart is one more)
            os.makedirs(marks, exist_ok=True)
            open(os.path.join(marks, f"{step}-{os.getpid()}"), "w").close()
        os.abort()


def fault_env() -> dict:
    """A test's fault variable, for the runtime environment of the processes it must reach."""
    return {name: os.environ[name] for name in (FAULT_VAR, FAULT_MARKS_VAR) if name in os.environ}


def gpu_memory_bytes(gpu_memory_gb: float, cluster: dict, accelerator_type: str = "") -> int:
    """One GPU's memory: ``gpu_memory_gb`` when set, else the datasheet's for
    ``accelerator_type`` (the type searchers are pinned to), else for the accelerator type
    the cluster's resources name (the smallest, when several are up)."""
    if gpu_memory_gb > 0:
        return int(gpu_memory_gb * 2**30)
    if accelerator_type:
        return int(GPU_MEMORY_GB[accelerator_type] * 2**30)
    known = [
        GPU_MEMORY_GB[k.split(":", 1)[1]]
        for k in cluster
        if k.startswith("accelerator_type:") and k.split(":", 1)[1] in GPU_MEMORY_GB
    ]
    if not known:
        raise ConfigError(
            "--searchers.use_gpu needs the GPUs' memory to size its searchers: set --searchers.accelerator_type "
            "(or --searchers.gpu_memory_gb) "
            f"(no GPU node of a known type is up; known: {', '.join(GPU_MEMORY_GB)})"
        )
    return int(min(known) * 2**30)


def usable_bytes(gpu_bytes: int) -> int:
    """What one searcher's index may take of a GPU of ``gpu_bytes``."""
    return int(gpu_bytes * GPU_USABLE_SHARE) - GPU_RESERVED_BYTES


def gpu_factory(factory: str) -> str:
    """The factory whose memory an index of ``factory`` takes on a GPU: flat vectors (Flat,
    IVF-Flat) are held in fp16 there."""
    head, _, payload = factory.strip().rpartition(",")
    if payload == "Flat" and (not head or head.startswith("IVF")):
        return f"{head},SQfp16" if head else "SQfp16"
    return factory


def is_flat(factory: str) -> bool:
    return factory.strip() == "Flat"


def searcher_to_gpu(index, resources=None):
    """:func:`faiss_index.searcher_to_gpu` with flat vectors held in fp16, or the test
    stand-in (see the module's doc)."""
    if FAULT_VAR in os.environ:
        return index, "stand-in"
    return faiss_index.searcher_to_gpu(index, resources, fp16=True)


def gpu_canary() -> dict:
    """Move a tiny Flat and a tiny IVF-PQ index to this process's GPU and search them;
    Flat's answer must be the CPU's. Raises (or, with a broken build, aborts) otherwise.
    Returns what ran, for the run's record."""
    fault("canary")
    if FAULT_VAR not in os.environ and not (hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0):
        raise ConfigError(
            "FAISS sees no GPU here (faiss-cpu is installed, or no CUDA device is visible): install the gpu extra "
            "(faiss-gpu) on the GPU nodes"
        )
    # One FAISS thread for the IVF-PQ's training on the CPU (a fraction of a second): the
    # canary reserves next to no CPU, and the cores may be busy. Put back after, for
    # whatever task this Ray worker process runs next.
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        _canary_search()
    finally:
        faiss.omp_set_num_threads(threads)
    return {"faiss": faiss.__version__, "gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0}


def _canary_search() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((2048, 64), dtype=np.float32)
    queries = vectors[:16] + 0.01
    resources = None
    for factory in ("Flat", "IVF16,PQ8"):
        index = faiss_index.build_index_shard(vectors, np.arange(len(vectors)), factory, use_gpu="never")
        expected = faiss_index.search_shard(index, queries, 10, nprobe=16)
        on_gpu, resources = searcher_to_gpu(index, resources)
        found = faiss_index.search_shard(on_gpu, queries, 10, nprobe=16)
        if factory == "Flat" and not np.array_equal(found[1], expected[1]):
            raise RuntimeError("FAISS's GPU Flat search differs from the CPU's on the canary's vectors")
        if found[1].shape != (16, 10) or (found[1] < 0).any():
            raise RuntimeError(f"FAISS's GPU {factory} search returned no hits on the canary's vectors")


class TorchExactSearch:
    """Exact search over a Flat index's vectors with torch: held in fp16 on the GPU (fp32
    on a CPU), scored by one matrix product a query block, then top-k. The fallback when
    FAISS's GPU path fails; the answers are the brute-force ones up to fp16 rounding."""

    def __init__(self, index, metric: str):
        import torch  # only the fallback needs it in a searcher

        flat = faiss.downcast_index(index.index if isinstance(index, faiss.IndexIDMap) else index)
        if not isinstance(flat, faiss.IndexFlat):
            raise ConfigError(f"the torch fallback searches Flat indexes only, not {type(flat).__name__}")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.float16 if self.device == "cuda" else torch.float32
        self.vectors = torch.from_numpy(flat.reconstruct_n(0, flat.ntotal)).to(self.device, dtype)
        ids = faiss.vector_to_array(index.id_map) if isinstance(index, faiss.IndexIDMap) else np.arange(flat.ntotal)
        self.ids = torch.from_numpy(ids.astype(np.int64)).to(self.device)
        self.norms = (self.vectors.float() ** 2).sum(1) if metric == "l2" else None
        self.ntotal, self.metric = int(flat.ntotal), metric

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.inference_mode():
            # A copy: Ray hands the block read-only, which torch warns about.
            q = torch.from_numpy(np.array(queries, dtype=np.float32)).to(self.device)
            dots = (q.to(self.vectors.dtype) @ self.vectors.T).float()
            if self.metric == "ip":
                scores, top = torch.topk(dots, min(k, self.ntotal), dim=1)
            else:  # squared L2, ascending, as FAISS gives it
                scores, top = torch.topk(
                    (q**2).sum(1, keepdim=True) + self.norms - 2 * dots, min(k, self.ntotal), 1, largest=False
                )
            return scores.cpu().numpy(), self.ids[top].cpu().numpy()
