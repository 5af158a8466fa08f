"""How much memory a FAISS index shard takes, planned before anything is built: a shard that
cannot fit fails up front, by number and with a factory that would fit, instead of an OOM
kill hours into a build. Searchers are sized from the same plan
(pipeline/retrieval/search.py)."""

from __future__ import annotations

import math
import re

import faiss
import numpy as np
import psutil

from pipeline.core.errors import ConfigError
from pipeline.retrieval.faiss_index import faiss_reason, new_index

_TRANSFORM = re.compile(r"^(?:OPQ(\d+)(?:_(\d+))?|PCAR?(\d+)),(.+)$")
_IVF = re.compile(r"^IVF(\d+)(?:_HNSW(\d+))?,(.+)$")
_PQ = re.compile(r"^PQ(\d+)(?:x(\d+))?$")
_SQ_BYTES = {"SQ4": 0.5, "SQ6": 0.75, "SQ8": 1.0, "SQfp16": 2.0}


def _codes(payload: str, dim: int) -> tuple[float, int] | None:
    """(bytes per vector, fixed bytes) of a flat/PQ/SQ payload, or None if not recognised."""
    if payload == "Flat":
        return dim * 4, 0
    if payload in _SQ_BYTES:
        return _SQ_BYTES[payload] * dim, 2 * dim * 4
    m = _PQ.match(payload)
    if m:
        sub, nbits = int(m.group(1)), int(m.group(2) or 8)
        return math.ceil(sub * nbits / 8), (1 << nbits) * dim * 4  # codebook: M * 2^nbits * (dim/M) floats
    return None


def _formula(factory: str, dim: int) -> tuple[float, int] | None:
    """(bytes per vector, fixed bytes) of a recognised factory, ids included."""
    m = _TRANSFORM.match(factory)
    if m:  # OPQ stores a d_out x d_in rotation; PCA also keeps the full d_in x d_in eigenvector matrix
        out = int(m.group(2) or m.group(3) or dim)
        inner = _formula(m.group(4), out)
        return inner and (inner[0], inner[1] + (out + (dim if m.group(3) else 0)) * dim * 4)
    m = _IVF.match(factory)
    if m:
        nlist, hnsw, codes = int(m.group(1)), int(m.group(2) or 0), _codes(m.group(3), dim)
        if codes is None:
            return None
        return codes[0] + 8, codes[1] + nlist * (dim * 4 + hnsw * 2 * 4)
    m = re.match(r"^HNSW(\d+)(?:,Flat)?$", factory)
    if m:  # level 0 has 2*M links of 4 bytes; upper levels, levels and offsets add ~16
        return dim * 4 + int(m.group(1)) * 2 * 4 + 16 + 8, 0
    codes = _codes(factory, dim)
    return None if codes is None else (codes[0] + 8, codes[1])


def _measured(factory: str, dim: int, metric: str, seed: int = 0) -> tuple[float, int]:
    """Build the index on a small random sample and extrapolate from its serialized size."""
    # Enough points to train the largest number in the string (usually nlist), within reason.
    n = min(max(2048, 2 * max(map(int, re.findall(r"\d+", factory)), default=0)), 20_000)
    train = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    index = new_index(factory, dim, metric)
    try:
        index.train(train)
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot estimate the memory of {factory!r} from a {n}-vector sample "
            f"({faiss_reason(exc)}); use a factory the planner "
            "knows: [OPQ../PCA..,]Flat, PQ.., SQ.., HNSW.., IVF..,Flat|PQ..|SQ.."
        ) from exc
    step, measured = 2048, []
    for i in range(2):
        index.add_with_ids(train[:step], np.arange(i * step, (i + 1) * step, dtype=np.int64))
        measured.append(len(faiss.serialize_index(index)))
    per_vector = (measured[1] - measured[0]) / step
    return per_vector, max(0, int(measured[0] - per_vector * step))


def plan_memory(factory: str, dim: int, n_vectors_per_shard: list[int], metric: str = "ip") -> list[dict]:
    """Estimated bytes of each index shard: a formula for the common factories, otherwise a
    measurement on a tiny sample. These are serialized sizes; an index being filled can
    briefly hold up to twice its inverted lists while they grow."""
    formula = _formula(factory.strip(), dim)
    per_vector, fixed = formula if formula else _measured(factory, dim, metric)
    return [
        {
            "shard": i,
            "vectors": int(n),
            "dim": int(dim),
            "bytes": int(fixed + per_vector * n),
            "estimate": "formula" if formula else "measured",
        }
        for i, n in enumerate(n_vectors_per_shard)
    ]


def memory_limit_bytes(limit_gb: float = 0) -> int:
    """``limit_gb`` in bytes, or the memory available now when it is 0."""
    if limit_gb > 0:
        return int(limit_gb * 2**30)

    return int(psutil.virtual_memory().available)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def compressed_factory(vectors: int, dim: int) -> str:
    """A factory that holds ``vectors`` in a fraction of Flat's memory: IVF-SQ8 (a quarter)
    with about 4 sqrt(n) lists, or IVF-PQ (a 48th at 768-d) for the largest."""
    nlist = min(65536, max(16, 2 ** round(math.log2(4 * math.sqrt(max(vectors, 1))))))
    m = next(m for m in (64, 48, 32, 16, 8, 4, 2, 1) if dim % m == 0)
    return f"IVF{nlist},SQ8 or IVF{nlist},PQ{m}"


def check_plan(plan: list[dict], limit_bytes: int) -> None:
    """Refuse, before anything is built, a shard that would not fit in ``limit_bytes``."""
    for row in plan:
        if row["bytes"] > limit_bytes:
            raise ConfigError(
                f"index shard {row['shard']} needs {gib(row['bytes'])}, more than the "
                f"{gib(limit_bytes)} limit: use more shards or a compressed factory "
                f"such as {compressed_factory(row['vectors'], row['dim'])}"
            )


def format_plan(plan: list[dict]) -> str:
    lines = [f"{'shard':>5}  {'vectors':>12}  {'size':>11}  estimate"]
    for row in plan:
        lines.append(f"{row['shard']:>5}  {row['vectors']:>12,}  {row['bytes'] / 2**20:>7.1f} MiB  {row['estimate']}")
    total = sum(r["bytes"] for r in plan)
    lines.append(f"{'total':>5}  {sum(r['vectors'] for r in plan):>12,}  {total / 2**20:>7.1f} MiB")
    return "\n".join(lines)
