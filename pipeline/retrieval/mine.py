"""Hard-negative mining for the next fine-tuning round: dense top-depth minus judged positives.

For each training query: search the sharded index to ``depth`` (200), drop every judged
positive by id (and, with an answers file, every passage whose text contains one of the
query's answer strings: an unjudged positive), optionally skip the ``skip_top`` best-ranked
candidates (the likeliest false negatives), then keep ``count`` (30): a seeded random draw
(per query, so a query's sample does not depend on the others) or the top ones.

Outputs, under ``output``:
- ``negatives.jsonl``: ``{query_id, negatives, scores}``, what ``jobs/finetune.py --data.negatives`` reads;
- ``train.tevatron.jsonl``: the round's training file in Tevatron format, passages by id (text
  empty: the trainer joins the text from the corpus at training time);
- ``run.trec``: the full top-depth run, for ``ir_measures``.

All three are written a block of queries at a time as the searchers answer, with the
results already as doc ids: the driver holds the queries, their vectors and one block of
results, never the corpus's ids nor the whole run. The answer filter is the exception: it
holds every candidate id (and their texts) before the first line is written. Each block
goes to part files first (:mod:`pipeline.core.parts`), so a run killed mid-way resumes
from the blocks it finished.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.parts import claim, finished_blocks, join_parts, part_uri, remove_parts, summed
from pipeline.core.runtime import RayConfig
from pipeline.core.sample import SAMPLE_TRAIN_QRELS, SAMPLE_TRAIN_QUERIES
from pipeline.data.beir import positives, read_queries
from pipeline.data.corpus import iter_documents
from pipeline.data.groups import select_negatives
from pipeline.data.records import json_lines, write_json_line
from pipeline.data.runs import negatives_record, write_trec_lines
from pipeline.data.tevatron import tevatron_record
from pipeline.retrieval import faiss_index
from pipeline.retrieval.encode import EncoderSettings, encode_queries
from pipeline.retrieval.fanout import query_block, ranked_ids, read_qrels_of_corpus
from pipeline.retrieval.search import ShardedIndex


@dataclass
class MineConfig:
    index: str = field(
        default="runs/index",
        metadata={"help": "sharded index (jobs/index.py output) of the corpus, encoded with --encoder.model"},
    )
    queries: str = field(default=SAMPLE_TRAIN_QUERIES, metadata={"help": "BEIR queries.jsonl to mine for"})
    qrels: str = field(
        default=SAMPLE_TRAIN_QRELS, metadata={"help": "their judgments: positives (score > 0) are never negatives"}
    )
    output: str = field(
        default="runs/mine", metadata={"help": "folder for negatives.jsonl, train.tevatron.jsonl and run.trec"}
    )
    depth: int = field(default=200, metadata={"help": "passages retrieved per query"})
    count: int = field(default=30, metadata={"help": "negatives kept per query"})
    sample: Literal["random", "top"] = field(
        default="random",
        metadata={"help": "random = a seeded draw from the candidates (kept in rank order); top = the best-ranked"},
    )
    skip_top: int = field(
        default=0, metadata={"help": "ignore the best-ranked N candidates (likely unjudged positives)"}
    )
    answers: str = field(
        default="",
        metadata={
            "help": "jsonl {query_id, answers: [str]}: drop candidates whose text contains an answer (needs --corpus)"
        },
    )
    corpus: str = field(default="", metadata={"help": "BEIR corpus.jsonl, for the answer filter"})
    seed: int = field(default=0, metadata={"help": "seed of sample=random"})
    nprobe: int = field(default=32, metadata={"help": "IVF lists searched per query"})
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    pool: ActorConfig = field(default_factory=ActorConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        for name in ("depth", "count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.skip_top < 0:
            raise ValueError(f"skip_top must be >= 0, got {self.skip_top}")


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


PART_FILES = ("negatives.jsonl", "train.tevatron.jsonl", "run.trec", "counts.json")
COUNTS = ("negatives", "positives_dropped", "answer_dropped", "short", "examples")


def _made_by(cfg: MineConfig) -> dict:
    """What the mined files depend on: every setting but where they go and where it runs,
    and the stored versions of the index, the model, the queries and the judgments."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("output", "pool", "ray")}
    versions = {
        "index": storage.version(storage.join(cfg.index, "manifest.json")),
        "queries": storage.version(cfg.queries),
        "qrels": storage.version(cfg.qrels),
        "answers": storage.version(cfg.answers) if cfg.answers else "",
    }
    versions["model"] = model_ref.version(cfg.encoder.model, "--encoder.model")
    return {"settings": settings, "versions": versions}


def _mine_block(cfg, output, block, queries, qids, qrels, answer_hits, scores, block_ids) -> None:
    """One block's results: its part of every output file, and its counts, each written whole."""
    counts = dict.fromkeys(COUNTS, 0)
    with (
        storage.open_output(part_uri(output, block, "negatives.jsonl")) as neg_out,
        storage.open_output(part_uri(output, block, "train.tevatron.jsonl")) as tev_out,
        storage.open_output(part_uri(output, block, "run.trec")) as run_out,
    ):
        for qid, row_scores, row_ids in zip(qids, scores, block_ids):
            ids = ranked_ids(row_ids)
            write_trec_lines(run_out, qid, ids, row_scores[: len(ids)].tolist(), tag="mined")
            judged = set(positives(qrels.get(qid, {})))
            hits = answer_hits.get(qid, set())
            counts["positives_dropped"] += sum(d in judged for d in ids)
            counts["answer_dropped"] += sum(d in hits and d not in judged for d in ids)
            negs, neg_scores = select_negatives(qid, ids, row_scores[: len(ids)].tolist(), judged | hits, cfg)
            counts["negatives"] += len(negs)
            counts["short"] += len(negs) < cfg.count
            write_json_line(neg_out, negatives_record(qid, negs, neg_scores))
            if judged:
                counts["examples"] += 1
                write_json_line(tev_out, tevatron_record(qid, queries[qid], sorted(judged), negs))
    storage.write_json(part_uri(output, block, "counts.json"), counts)  # last: the block is done


def run_mining(cfg: MineConfig) -> dict:
    """Mine every query block not yet mined into part files, then join them into the outputs.

    A block's parts appear whole, its counts last: a run killed mid-way (a lost node, a
    Ctrl-C) reruns the same command and searches only the blocks it lacks, unless anything it
    depends on changed (then every part is deleted first, with a message)."""
    started = time.perf_counter()
    output = storage.resolve(cfg.output).uri
    queries = read_queries(cfg.queries)
    qids = list(queries)
    claim(output, _made_by(cfg), what="mined blocks' files")
    block = query_block(len(faiss_index.load_index_manifest(storage.resolve(cfg.index).uri)["shards"]))
    blocks = list(range(-(-len(qids) // block)))
    done = finished_blocks(output, PART_FILES)
    todo = [b for b in blocks if b not in done]
    todo_qids = [q for b in todo for q in qids[b * block : (b + 1) * block]]
    # Encoded on the pool before the searchers start: the two never hold the GPUs at once.
    vectors = encode_queries(cfg.encoder, [queries[q] for q in todo_qids], cfg.pool)
    search_start = time.perf_counter()
    with ShardedIndex(cfg.index, nprobe=cfg.nprobe, pool=cfg.pool) as index:
        qrels = read_qrels_of_corpus(cfg.qrels, index.holds, set(queries))
        answered = index.search_blocks(vectors, min(cfg.depth, index.total), block=block)
        answer_hits: dict[str, set[str]] = {}
        if cfg.answers:  # the filter reads the candidates' texts in one pass over the corpus first
            answered = list(answered)
            ranked = {q: ranked_ids(ids) for start, _, _, ids in answered for q, ids in zip(todo_qids[start:], ids)}
            answer_hits = _answer_hits(cfg, queries, ranked)
            del ranked
        # The todo blocks are whole blocks (only the last can be short), so the searched
        # vectors' blocks are the todo blocks, in order.
        for (start, scores, _, block_ids), b in zip(answered, todo):
            block_qids = todo_qids[start : start + len(scores)]
            _mine_block(cfg, output, b, queries, block_qids, qrels, answer_hits, scores, block_ids)
    search_s = time.perf_counter() - search_start
    counts = summed(output, blocks, "counts.json", COUNTS)
    for name in PART_FILES[:3]:
        join_parts(output, blocks, name, storage.join(output, name))
    remove_parts(output)
    return {
        "job": "mine",
        "output": output,
        "negatives": storage.join(output, "negatives.jsonl"),
        "tevatron": storage.join(output, "train.tevatron.jsonl"),
        "run": storage.join(output, "run.trec"),
        "queries": len(qids),
        "blocks": len(blocks),
        "blocks_resumed": len(blocks) - len(todo),
        "examples": counts["examples"],
        "negatives_per_query": round(counts["negatives"] / max(len(qids), 1), 3),
        "queries_short": counts["short"],
        "positives_dropped": counts["positives_dropped"],
        "answer_dropped": counts["answer_dropped"],
        "depth": cfg.depth,
        "search_seconds": round(search_s, 2),  # search, selection and writing, streamed together
        "seconds": round(time.perf_counter() - started, 2),
    }
