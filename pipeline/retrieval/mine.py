"""Hard-negative mining for the next fine-tuning round: dense top-depth minus judged positives.

For each training query: search the sharded index to ``depth`` (200), drop every judged
positive by id (and, with an answers file, every passage whose text contains one of the
query's answer strings: an unjudged positive), optionally skip the ``skip_top`` best-ranked
candidates (the likeliest false negatives) and those within a margin of the query's positive
score (``absolute_margin`` / ``relative_margin``, as sentence-transformers names them: a
candidate that close is likelier unjudged than negative), then keep ``count`` (30): a seeded random draw
(per query, so a query's sample does not depend on the others) or the top ones.

Outputs, under ``output``:
- ``negatives.jsonl``: ``{query_id, negatives, scores}``, what ``jobs/finetune.py --data.negatives`` reads;
- ``train.tevatron.jsonl``: the round's training file in Tevatron format, passages by id (text
  empty: the trainer joins the text from the corpus at training time);
- ``run.trec``: the full top-depth run, for ``ir_measures``.

All three are written a block of queries at a time as the searchers answer, with the
results already as doc ids: the driver holds the queries and their judgments as arrays
(:class:`pipeline.data.beir.Queries`, ``Judgments``) and the blocks in flight, never the
queries' vectors (stored by block), the corpus's ids nor the whole run. The answer
filter is the exception: it holds every candidate id (and their texts) before the first
line is written. Each block goes to part files first (:mod:`pipeline.core.parts`), so a
run killed mid-way resumes from the blocks it finished.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import ray

from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.errors import ArtifactError, ConfigError, InputError
from pipeline.core.parts import claim, finished_blocks, join_blocks, recorded_block, remove_parts, summed
from pipeline.core.runtime import RayConfig
from pipeline.core.sections import TRAINING_SPLIT, Collection, Output, Section
from pipeline.data.beir import positives, read_queries
from pipeline.data.corpus import iter_documents
from pipeline.data.groups import margin_ceiling
from pipeline.data.records import json_lines
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval import faiss_index, mined_block
from pipeline.retrieval.encode import EncoderSettings, encoder_width, store_query_vectors
from pipeline.retrieval.fanout import ranked_ids, read_qrels_of_corpus
from pipeline.retrieval.mined_block import COUNTS, OUTPUTS, Sampling
from pipeline.retrieval.query_vectors import StoredQueryVectors, read_blocks
from pipeline.retrieval.search import SearcherConfig, ShardedIndex, query_block_of

POSITIVE_ROWS = 65536  # queries' vectors an object of margin scoring: BERT-base's, 200 MB


@dataclass
class MiningSettings(Section):
    """Which of a query's candidates mining keeps: jobs/mine.py's and the recipe's mining stages'."""

    depth: int = field(default=200, metadata={"min": 1, "help": "passages retrieved per query"})
    count: int = field(default=30, metadata={"min": 1, "help": "negatives kept per query"})
    skip_top: int = field(
        default=0, metadata={"min": 0, "help": "ignore the best-ranked N candidates (likely unjudged positives)"}
    )
    query_block: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "queries per search block: the unit written, resumed and redone after a lost node; 0 = as many as keep a block's answers near 256 MiB (thousands; at most a 16th of the queries, so progress shows), recorded for a resumed run",
        },
    )


@dataclass
class MineConfig(
    MiningSettings,
    Output.with_defaults(output="runs/mine", notes={"output": "negatives.jsonl, train.tevatron.jsonl and run.trec"}),
    Collection.with_defaults(
        corpus="",
        **TRAINING_SPLIT,
        notes={"corpus": "for the answer filter", "queries": "mined for", "qrels": "positives are never negatives"},
    ),
):
    index: str = field(
        default="runs/index",
        metadata={"help": "sharded index (jobs/index.py output) of the corpus, encoded with --encoder.model"},
    )
    sample: Literal["random", "top"] = field(
        default="random",
        metadata={"help": "random = a seeded draw from the candidates (kept in rank order); top = the best-ranked"},
    )
    answers: str = field(
        default="",
        metadata={
            "help": "jsonl {query_id, answers: [str]}: drop candidates whose text contains an answer (needs --corpus)"
        },
    )
    absolute_margin: float | None = field(
        default=None,
        metadata={
            "help": "drop candidates scoring above the query's positive score minus this (sentence-transformers' absolute_margin; which positive: --margin_positive); unset = off"
        },
    )
    relative_margin: float | None = field(
        default=None,
        metadata={
            "help": "drop candidates scoring above the positive score minus this share of its magnitude (sentence-transformers' relative_margin, e.g. 0.05); unset = off"
        },
    )
    margin_positive: Literal["hardest", "easiest"] = field(
        default="hardest",
        metadata={
            "help": "a query with several judged positives: the margin is below its lowest-scoring one (hardest: every (query, positive) pair keeps the margin, as sentence-transformers' pairs do) or its highest-scoring one (easiest: drops only candidates about as good as its best positive)"
        },
    )
    seed: int = field(default=0, metadata={"min": 0, "help": "seed of sample=random"})
    nprobe: int = field(default=32, metadata={"min": 1, "help": "IVF lists searched per query"})
    write_in_tasks: bool = field(
        default=True,
        metadata={
            "help": "merge each block's answers and write its files in a Ray task (1 CPU) beside the searches, not on the driver (always on the driver with --answers)"
        },
    )
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    pool: ActorConfig = field(default_factory=ActorConfig)  # the query encoders
    searchers: SearcherConfig = field(default_factory=SearcherConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        for name in ("depth", "count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("skip_top", "query_block"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("absolute_margin", "relative_margin"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def margins(self) -> bool:
        return self.absolute_margin is not None or self.relative_margin is not None

    def check_inputs(self, prefix: str) -> None:
        for name in ("index", "queries", "qrels"):
            storage.must_exist(getattr(self, name), f"{prefix}{name}")


def _answer_hits(cfg: MineConfig, queries: dict, ranked: dict[str, list[str]]) -> dict[str, set[str]]:
    """Per query, the candidates whose text contains one of its answers (case-insensitive)."""

    if not cfg.corpus:
        raise ConfigError("--answers needs --corpus (the passage texts to search for the answers)")
    answers = {}
    for source, number, obj in json_lines(cfg.answers):
        qid = str(obj.get("query_id", ""))
        if not qid or not isinstance(obj.get("answers"), list):
            raise InputError(f'{source} line {number}: expected {{"query_id": ..., "answers": [...]}}')
        answers[qid] = [a.lower() for a in obj["answers"] if isinstance(a, str) and a.strip()]
    wanted = {d for qid in answers for d in ranked.get(qid, [])}
    texts = {d.doc_id: d.text.lower() for d in iter_documents(cfg.corpus) if d.doc_id in wanted}
    return {
        qid: {d for d in ranked.get(qid, []) if any(a in texts.get(d, "") for a in ans)} for qid, ans in answers.items()
    }


def positive_scores(
    index_uri: str, qids: Iterable[str], vector_blocks: list, qrels: Mapping, which: str = "hardest"
) -> np.ndarray:
    """Each query's score of its hardest (lowest-scoring) or easiest (highest-scoring)
    judged positive, as the index scores it (inner product with the positive's stored
    embedding); +inf for a query with no judged positive. ``vector_blocks``: Ray object refs
    of the queries' vectors in consecutive blocks. One Ray task per embedding shard, each
    answering the pairs whose positive it holds: the driver holds one float per query and
    the (positive, query) pairs as two arrays, not the positives' vectors nor the queries'."""
    manifest = faiss_index.load_index_manifest(index_uri)
    if manifest["metric"] != "ip":
        raise ConfigError("--absolute_margin / --relative_margin need an inner-product index (metric ip)")
    folder = manifest["embeddings"]
    docs, owners, rows = [], array("q"), 0
    for rows, qid in enumerate(qids, 1):
        for doc_id in positives(qrels.get(qid, {})):
            docs.append(doc_id.encode())
            owners.append(rows - 1)
    doc_keys = np.array(docs, dtype=bytes) if docs else np.zeros(0, "S1")
    order = np.argsort(doc_keys, kind="stable")
    wanted_docs, wanted_queries = doc_keys[order], np.asarray(owners, dtype=np.int64)[order]
    del docs, owners
    # A task from the embeddings module: a worker that runs it imports no torch or transformers.
    score = ray.remote(emb.pair_scores).options(num_cpus=1, max_retries=3)
    docs_ref, queries_ref = ray.put(wanted_docs), ray.put(wanted_queries)
    hardest = which == "hardest"
    out = np.full(rows, np.inf if hardest else -np.inf, dtype=np.float32)
    for queries, scores in ray.get(
        [
            score.remote(folder, entry, docs_ref, queries_ref, *vector_blocks)
            for entry in emb.load_manifest(folder)["shards"]
        ]
    ):
        (np.minimum if hardest else np.maximum).at(out, queries, scores)
    out[np.isneginf(out)] = np.inf  # no judged positive: no ceiling
    return out


def _check_width(cfg: MineConfig) -> None:
    """Before any work: the encoder's vectors are as wide as the index's. Found later, the
    mismatch is FAISS's assertion in a searcher, after every query is encoded."""
    manifest = faiss_index.load_index_manifest(cfg.index, check=False)
    width = encoder_width(cfg.encoder.model)
    if width != manifest["dim"]:
        try:
            made = f" (encoded by {emb.load_manifest(manifest['embeddings'])['model']})"
        except (ArtifactError, KeyError, OSError):  # the embeddings may be gone: the index is enough
            made = ""
        raise ConfigError(
            f"--encoder.model {cfg.encoder.model} encodes {width}-wide vectors, but --index {cfg.index} holds "
            f"{manifest['dim']}-wide ones{made}: mine with the model that encoded the index"
        )


def _made_by(cfg: MineConfig) -> dict:
    """What the mined files depend on: every setting but where they go and where it runs,
    and the stored versions of the index, the model, the queries and the judgments."""
    operational = ("output", "pool", "searchers", "ray", "write_in_tasks")
    settings = {k: v for k, v in asdict(cfg).items() if k not in operational}
    versions = {
        "index": storage.version(storage.join(cfg.index, "manifest.json")),
        "queries": storage.version(cfg.queries),
        "qrels": storage.version(cfg.qrels),
        "answers": storage.version(cfg.answers) if cfg.answers else "",
    }
    versions["model"] = model_ref.version(cfg.encoder.model, "--encoder.model")
    return {"settings": settings, "versions": versions}


def run_mining(cfg: MineConfig) -> dict:
    """Mine every query block not yet mined into part files, then join them into the outputs.

    A block's parts appear whole, its counts last: a run killed mid-way (a lost node, a
    Ctrl-C) reruns the same command and searches only the blocks it lacks, unless anything it
    depends on changed (then every part is deleted first, with a message)."""
    started = time.perf_counter()
    output = storage.resolve(cfg.output).uri
    queries = read_queries(cfg.queries)
    made_by = _made_by(cfg)  # names a missing model or file first
    _check_width(cfg)
    claim(output, made_by, what="mined blocks' files")
    block = recorded_block(output, cfg.query_block or query_block_of(cfg.index, cfg.searchers, cfg.depth, len(queries)))
    blocks = list(range(-(-len(queries) // block)))
    done = finished_blocks(output)
    sampling = Sampling.of(cfg)
    todo = [b for b in blocks if b not in done]
    # Encoded on the pool before the searchers start: the two never hold the GPUs at once.
    # The actors write each search block's vectors beside its parts, and the search reads a
    # block when it asks it: the driver never holds every query's vector. A block encodes
    # alone (its length-sorted batches are its own), so its vectors are those of an
    # uninterrupted run, and a resumed run reuses the blocks it stored (the claim above).
    vectors = StoredQueryVectors.in_parts(output, len(queries), block)
    store_query_vectors(cfg.encoder, lambda b: queries.texts(b * block, (b + 1) * block), todo, cfg.pool, vectors)
    search_start = time.perf_counter()
    with ShardedIndex(cfg.index, nprobe=cfg.nprobe, searchers=cfg.searchers) as index:
        qrels = read_qrels_of_corpus(cfg.qrels, index.holds, queries)
        depth = min(cfg.depth, index.total)
        ceilings = np.full(len(queries), np.inf)  # float64: margin_ceiling's own values, unrounded
        if cfg.margins and todo:
            # One task per embedding shard scores the pairs whose positive it holds, for every
            # query at once (one pass over the embeddings, where a pass per block would read
            # them once a block). Tasks read the todo blocks' vectors into the object store,
            # POSITIVE_ROWS queries an object: the driver holds their refs only.
            todo_rows = np.concatenate([np.arange(b * block, min((b + 1) * block, len(queries))) for b in todo])
            read = ray.remote(read_blocks).options(num_cpus=1, max_retries=3)
            per_read = max(1, POSITIVE_ROWS // block)
            scores = positive_scores(
                cfg.index,
                (qid for b in todo for qid in queries.ids(b * block, (b + 1) * block)),
                [read.remote(vectors, todo[i : i + per_read]) for i in range(0, len(todo), per_read)],
                qrels,
                cfg.margin_positive,
            )
            ceilings[todo_rows] = [margin_ceiling(float(p), cfg.absolute_margin, cfg.relative_margin) for p in scores]
        if cfg.write_in_tasks and not cfg.answers:

            def block_args(start: int, size: int) -> tuple:
                own_qids = queries.ids(start, start + size)
                own_queries = dict(zip(own_qids, queries.texts(start, start + size)))
                own_qrels = qrels.of(own_qids)
                return (
                    sampling,
                    output,
                    start // block,
                    own_queries,
                    own_qids,
                    own_qrels,
                    {},
                    ceilings[start : start + size].tolist(),
                )

            for _ in index.map_blocks(vectors, depth, mined_block.write, block_args, block=block, only=todo):
                pass
        else:
            answered = index.search_blocks(vectors, depth, block=block, only=todo)
            answer_hits: dict[str, set[str]] = {}
            if cfg.answers:  # the filter reads the candidates' texts in one pass over the corpus first
                answered = list(answered)
                ranked = {
                    q: ranked_ids(ids)
                    for start, _, _, ids in answered
                    for q, ids in zip(queries.ids(start, start + len(ids)), ids)
                }
                answer_hits = _answer_hits(cfg, queries, ranked)
                del ranked
            for start, scores, rows, block_ids in answered:
                mined_block.write(
                    scores,
                    rows,
                    block_ids,
                    sampling,
                    output,
                    start // block,
                    queries,
                    queries.ids(start, start + len(scores)),
                    qrels,
                    answer_hits,
                    ceilings[start : start + len(scores)].tolist(),
                )
        driver_share = index.driver_share()
        search_mode, fallback, restarted = index.search_mode, index.fallback, index.restarted()
    search_s = time.perf_counter() - search_start
    counts = summed(join_blocks(output, blocks, {name: storage.join(output, name) for name in OUTPUTS}), COUNTS)
    remove_parts(output)
    return {
        "job": "mine",
        "output": output,
        "negatives": storage.join(output, "negatives.jsonl"),
        "tevatron": storage.join(output, "train.tevatron.jsonl"),
        "run": storage.join(output, "run.trec"),
        "queries": len(queries),
        "blocks": len(blocks),
        "blocks_resumed": len(blocks) - len(todo),
        "examples": counts["examples"],
        "negatives_per_query": round(counts["negatives"] / max(len(queries), 1), 3),
        "queries_short": counts["short"],
        "positives_dropped": counts["positives_dropped"],
        "answer_dropped": counts["answer_dropped"],
        "margin_dropped": counts["margin_dropped"],
        "depth": cfg.depth,
        "search_seconds": round(search_s, 2),  # search, selection and writing, streamed together
        "search_driver_share": driver_share,  # of the search's wall time, the driver's merging and writing
        "search": search_mode,  # faiss-gpu, torch or faiss-cpu
        "gpu_fallback": fallback,  # why the search left FAISS's GPU path, when it did
        "searchers_restarted": restarted,  # by Ray, after their process or node died
        "seconds": round(time.perf_counter() - started, 2),
    }
