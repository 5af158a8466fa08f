"""Corpus encoding on a pool of Ray actors: prepared shards in, embedding shards out.

Each corpus shard becomes one embedding shard with the same index, written atomically
by whichever actor encoded it (``pipeline/retrieval/embeddings.py``). That makes the job
resumable at shard granularity: a rerun skips the shards already written, and a shard
whose actor died is handed to a fresh actor. The manifest is written last, once every
shard exists, so the result holds every passage exactly once.

Inside an actor, a shard's passages are sorted by length and encoded in batches padded
only to their own longest passage; in half precision, the model is held in fp16 or bf16.

Queries are encoded on actors too, in blocks: never in the driver, which at MS MARCO scale
would encode half a million queries on the head's CPUs. The actors write each block's
vectors to storage (:func:`store_query_vectors`), so not even the vectors pass through the
driver: mining and evaluation read a block when they search it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, ClassVar, Iterable, Literal

import numpy as np
import ray
import torch

from models.biencoder import ExportShape, export_shape, load_biencoder
from models.compiled import compile_in_place
from models.framing import Framing
from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig, actor_device, run_actor_pool, stream_actor_pool
from pipeline.core.capacity import CapacityWait
from pipeline.core.config import Renamed, truthy
from pipeline.core.progress import progress
from pipeline.core.runtime import RayConfig
from pipeline.core.sections import Corpus, Lengths, Output
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.data.shards import PreparedCorpus, check_shards
from pipeline.data.tokenizer import check_lengths, check_model_tokenizer, load_tokenizer, prefix_token_ids
from pipeline.retrieval.embeddings import (
    claim,
    finished_shards,
    shard_path,
    write_manifest,
    write_shard,
)
from pipeline.retrieval.inference import (
    batch_limits,
    check_finite,
    cpu_linears_field,
    held_in,
    inference,
    inference_dtype,
    length_sorted_batches,
    made_in,
    on_device,
    overlapped,
    with_cpu_linears,
)
from pipeline.retrieval.query_vectors import StoredQueryVectors, write_vectors

CPU_BATCH = 256  # passages a forward on CPUs where encoder.batch_size is 0


def _similarity_of_normalize(value) -> str:
    """The former ``normalize`` (true, false or empty) as a similarity."""
    return "" if value == "" else ("cos" if truthy(value) else "dot")


@dataclass
class EncoderSettings(Lengths):
    """How a retriever encodes: the model, and the settings that override its export's."""

    RENAMED: ClassVar[dict] = {
        "max_len": Renamed("passage_max_len"),
        "normalize": Renamed("similarity", convert=_similarity_of_normalize),
    }

    model: str = field(
        default="runs/finetune/export",
        metadata={
            "help": "retriever export (settings from its retriever.json) or any HF checkpoint (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME)"
        },
    )
    pooling: Literal["", "auto", "cls", "mean", "last"] = field(
        default="",
        metadata={
            "help": "cls, mean or last; empty or auto = the export's retriever.json, else the checkpoint's sentence-transformers pooling, else last for a decoder and cls for an encoder"
        },
    )
    similarity: Literal["", "dot", "cos"] = field(
        default="",
        metadata={"help": "cos (L2-normalised vectors) or dot; empty = the export's (dot for a plain checkpoint)"},
    )
    batch_size: int = field(
        default=0, metadata={"help": "passages per forward at most; 0 = auto: 4,096 on GPUs, 256 on CPUs"}
    )
    batch_tokens: int = field(
        default=0,
        metadata={
            "help": "padded tokens per forward at most (rows x the batch's longest), so long passages do not take a short batch's rows; 0 = auto: 131,072 on GPUs, none on CPUs"
        },
    )
    precision: Literal["auto", "fp32", "fp16", "bf16"] = field(
        default="auto",
        metadata={
            "help": "fp16/bf16 hold the model in that precision (pooling in fp32); auto = fp16 on GPUs, fp32 on CPUs"
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the towers for batches of any width (one compile per process); embeddings within 1e-4 of eager. It replaces cpu_linears' packed layers, which Inductor cannot trace"
        },
    )
    cpu_linears: Literal["onednn", "blas"] = cpu_linears_field()
    shards_in_flight: int = field(
        default=0,
        metadata={
            "help": "corpus shards an encoding actor holds at once: one is encoded while the next is read and the last written; 0 = 2 on GPUs, 1 on CPUs (where the read and write would take the encoder's cores)"
        },
    )

    query_prefix: str | None = field(
        default=None,
        metadata={"help": "text before every query; none = the export's retriever.json (none for a plain checkpoint)"},
    )
    passage_prefix: str | None = field(
        default=None, metadata={"help": "text before every passage; none = the export's, likewise"}
    )

    def __post_init__(self):
        for name in ("shards_in_flight", "batch_size", "batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"encoder.{name} must be >= 0, got {getattr(self, name)}")

    def check_inputs(self, prefix: str) -> None:
        if self.model:
            model_ref.check(self.model, f"{prefix}model")
            check_model_tokenizer(self.model, f"{prefix}model")
            set_lengths = {
                f"{prefix}{n}": getattr(self, n) for n in ("query_max_len", "passage_max_len") if getattr(self, n)
            }
            check_lengths(self.model, f"{prefix}model", **set_lengths)

    def batch_limits(self, device: str) -> tuple[int, int]:
        """(passages, padded tokens) per forward on ``device``, auto resolved
        (:func:`pipeline.retrieval.inference.batch_limits`)."""
        return batch_limits(device, self.batch_size, self.batch_tokens, CPU_BATCH)

    def overrides(self) -> dict:
        """The retriever settings that replace the export's."""
        chosen = {
            k: v for k, v in (("pooling", self.pooling), ("similarity", self.similarity)) if v not in ("", "auto")
        }
        prefixes = (("query_prefix", self.query_prefix), ("passage_prefix", self.passage_prefix))
        return chosen | {k: v for k, v in prefixes if v is not None}  # "" overrides; None keeps the export's


def _frame_batch(token_lists: list, max_len: int, framing: Framing):
    """Each list framed, truncated to max_len, padded only to the batch's longest."""

    room = framing.room(max_len)
    width = max(min(len(t), room) for t in token_lists) + framing.extra
    ids, lengths = framing.frame_truncated(token_lists, width)
    mask = np.arange(width)[None, :] < lengths[:, None]
    return torch.from_numpy(ids).long(), torch.from_numpy(mask).long()


class Encoder:
    """The model on one device, encoding token-id lists in length-sorted batches.

    The retriever's prefixes (``query_prefix``, ``passage_prefix``) go in front of every
    text: query text is tokenized with its prefix, as sentence-transformers' prompts are;
    pre-tokenized passages get the prefix's token ids in front, which is the same for
    WordPiece and SentencePiece (byte-level BPE would mark the first word's space
    differently)."""

    def __init__(self, settings: EncoderSettings, tokenizer_dir: str, device: str = "cpu", model=None):
        self.settings, self.device = settings, device
        self.batch_limits = settings.batch_limits(device)
        if model is None:
            path = model_ref.materialize(settings.model, "--encoder.model")
            model = load_biencoder(path, settings.overrides()).to(device).eval()
        self.dtype = inference_dtype(settings.precision, device, model.passage_tower.config.hidden_size)
        model = held_in(model, self.dtype)  # a model given (the other tower's Encoder) is held so already
        if settings.compile:
            compile_in_place(model.query_encoder, model.passage_encoder)
        else:
            with_cpu_linears(model, device, settings.cpu_linears)
        self.model = model
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.framing = Framing.of(self.tokenizer, last_token=model.cfg.pooling == "last")
        # Passages alone come pre-tokenized: queries are tokenized with their prefix.
        self.passage_prefix_ids = prefix_token_ids(self.tokenizer, model.cfg.passage_prefix)
        # Compiled (or CUDA's libraries loaded) here, at start-up, not inside the first shard.
        if settings.compile or device != "cpu":
            for tower in ("query", "passage"):
                self._encode_framed([[self.framing.pad_id] * 6] * 4, 16, tower)

    @property
    def normalized(self) -> bool:
        return self.model.cfg.similarity == "cos"

    def encode_tokens(self, token_lists: list, max_len: int) -> np.ndarray:
        """Encode passages given as token ids (without the passage prefix)."""
        prefix = self.passage_prefix_ids
        if prefix:
            token_lists = [prefix + list(t) for t in token_lists]
        return self._encode_framed(token_lists, max_len, "passage")

    def encode_texts(self, texts: list[str], max_len: int, tower: str = "query") -> np.ndarray:
        prefix = self.model.cfg.prefix(tower)
        tokens = self.tokenizer(
            [prefix + t for t in texts],
            add_special_tokens=False,
            truncation=True,
            max_length=self.framing.room(max_len),
        )["input_ids"]
        return self._encode_framed(tokens, max_len, tower)

    def _encode_framed(self, token_lists: list, max_len: int, tower: str) -> np.ndarray:
        encode = self.model.encode_passage if tower == "passage" else self.model.encode_query
        out = np.zeros((len(token_lists), self.dim), dtype=np.float32)

        def forward(idx: np.ndarray) -> torch.Tensor:
            ids, mask = _frame_batch([token_lists[i] for i in idx], max_len, self.framing)
            inputs = on_device({"ids": ids, "mask": mask}, self.device)
            return encode(inputs["ids"], inputs["mask"])

        with inference(self.device, self.dtype):
            room, extra = self.framing.room(max_len), self.framing.extra
            framed_lengths = [min(len(t), room) + extra for t in token_lists]
            for idx, reps in overlapped(length_sorted_batches(framed_lengths, *self.batch_limits), forward):
                out[idx] = reps
        check_finite(out, self.dtype, f"{tower} vectors")
        return out

    @property
    def dim(self) -> int:
        return int(self.model.query_encoder.config.hidden_size)


def encoder_width(model: str) -> int:
    """The width of the query vectors ``model`` encodes, from its ``config.json`` (the query
    tower's, in an export of two), without reading its weights: a driver-side check."""
    two_towers = model_ref.parse(model, "--encoder.model").kind != "hub" and model_ref.has_file(
        model, "query/config.json"
    )
    tower = model_ref.join(model, "query") if two_towers else model
    return int(model_ref.read_config(tower, "--encoder.model")["hidden_size"])


def model_tokenizer_dir(model_dir: str) -> str:
    """The tokenizer that reads query text: the query tower's when the export has two."""
    towers = os.path.join(model_dir, "query")
    return towers if os.path.isdir(towers) else model_dir


def local_encoder(settings: EncoderSettings, device: str = "cpu") -> Encoder:
    """An :class:`Encoder` in this process (tests, benchmarks), with the model's own tokenizer."""

    model_dir = model_ref.materialize(settings.model, "--encoder.model")
    return Encoder(settings, model_tokenizer_dir(model_dir), device)


class EncoderActor:
    """A Ray actor holding one :class:`Encoder`: encodes corpus shards (token ids with the
    corpus's tokenizer, ``tokenizer_uri``) and blocks of query text (the model's own
    tokenizer; an empty ``tokenizer_uri`` for a pool that encodes only queries)."""

    def __init__(self, settings: EncoderSettings, tokenizer_uri: str, pool: ActorConfig):
        torch.set_num_threads(max(1, int(pool.cpus_per_actor)))
        device = actor_device(pool)
        model_dir = model_ref.materialize(settings.model, "--encoder.model")
        tokenizer_dir = model_ref.materialize(tokenizer_uri, "tokenizer") if tokenizer_uri else ""
        self.encoder = Encoder(settings, tokenizer_dir or model_tokenizer_dir(model_dir), device)
        self.query_encoder = self.encoder
        if tokenizer_dir and model_tokenizer_dir(model_dir) != model_dir:
            # Two towers: passages come pre-tokenized, query text needs the query tokenizer.
            self.query_encoder = Encoder(settings, model_tokenizer_dir(model_dir), device, self.encoder.model)
        # With several calls in flight (shards_in_flight), one encodes at a time while the
        # others read their shard or write their vectors.
        self.device_lock = threading.Lock()

    def pid(self) -> int:
        return os.getpid()

    def encode_queries(self, texts: list[str], destination: str) -> dict:
        """A block of queries' vectors, written to ``destination``
        (:func:`pipeline.retrieval.query_vectors.write_vectors`), not returned."""
        started = time.perf_counter()
        with self.device_lock:
            vectors = self.query_encoder.encode_texts(texts, self.encoder.settings.query_max_len, tower="query")
        write_vectors(destination, vectors)
        return {"rows": len(texts), "seconds": time.perf_counter() - started, "pid": os.getpid()}

    def encode_shard(self, corpus_shard_uri: str, index: int, output: str) -> dict:
        # With calls in flight, "seconds" overlap: a call's wait for the device is in it.
        # "device_seconds" is its time holding the device; started_at/finished_at let a
        # reader take the actor's busy span.
        started_at, started = time.time(), time.perf_counter()
        table = storage.read_parquet(corpus_shard_uri, columns=["row", "doc_id", "input_ids"])
        tokens = table.column("input_ids").to_pylist()
        with self.device_lock:
            holding = time.perf_counter()
            vectors = self.encoder.encode_tokens(tokens, self.encoder.settings.passage_max_len)
            device_seconds = time.perf_counter() - holding
        entry = write_shard(output, index, table.column("row").to_numpy(), table.column("doc_id").to_pylist(), vectors)
        timing = {"seconds": time.perf_counter() - started, "device_seconds": device_seconds}
        return {**entry, **timing, "started_at": started_at, "finished_at": time.time(), "pid": os.getpid()}


@dataclass
class EncodeConfig(
    Output.with_defaults(output="runs/encode", notes={"output": "the embedding shards and their manifest"}),
    Corpus.with_defaults(
        notes={"corpus": "prepared here with the model's tokenizer; or a prepared corpus folder (manifest.json)"}
    ),
):
    prepared: str = field(default="", metadata={"help": "where a BEIR corpus is prepared; empty = <output>/corpus"})
    docs_per_shard: int = field(
        default=20000,
        metadata={"min": 1, "help": "passages per shard when preparing a BEIR corpus (the unit of work and of resume)"},
    )
    encoder: EncoderSettings = field(default_factory=EncoderSettings)
    pool: ActorConfig = field(default_factory=ActorConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def prepared_corpus(corpus: str, model_dir: str, prepared: str, docs_per_shard: int) -> PreparedCorpus:
    """``corpus`` itself if it is prepared, else ``corpus`` prepared in ``prepared`` with the
    model's tokenizer (reused on a rerun)."""

    ready = PreparedCorpus.at(corpus)
    if ready is not None:
        return ready
    cfg = PrepareConfig(input=corpus, output=prepared, tokenizer=model_dir, docs_per_shard=docs_per_shard)
    return prepare_corpus(cfg)


def _made_by(cfg: EncodeConfig, model_dir: str, shape: ExportShape, corpus: PreparedCorpus) -> dict:
    """What the passage vectors depend on: the model (reference and stored version), the
    retriever settings it encodes with (pooling, similarity: the export's, overridden), the
    passage length and the precision it means on the pool's devices, and the prepared corpus
    (its input's version, cut and tokenizer)."""
    device = "cuda" if cfg.pool.use_gpu else "cpu"
    return {
        "model": cfg.encoder.model,
        "model_version": storage.version(model_dir),
        "retriever": asdict(shape.cfg),
        "passage_max_len": cfg.encoder.passage_max_len,
        **made_in(cfg.encoder.precision, device, shape.passage_width),
        "corpus": corpus.folder,
        "corpus_version": corpus.version,
        "corpus_shards": [(s["first_row"], s["rows"]) for s in corpus.manifest["shards"]],
    }


def run_encoding(cfg: EncodeConfig, before_work=None) -> dict:
    """Encode every shard not yet written, on ``cfg.pool.actors`` actors; write the manifest.
    ``before_work(dim, corpus)`` (``corpus``: the :class:`PreparedCorpus`): the caller's checks of what it will do with the
    vectors, once the prepared corpus and the vectors' width are known and before anything
    is encoded."""

    started = time.perf_counter()
    cfg.output = storage.resolve(cfg.output).uri
    # Actors get the reference and fetch it on their nodes; the driver reads the shape here.
    cfg.encoder.model = model_ref.check(cfg.encoder.model, "--encoder.model")
    model_dir = model_ref.materialize(cfg.encoder.model, "--encoder.model")
    towers = os.path.join(model_dir, "query")
    tokenizer_dir = towers if os.path.isdir(towers) else model_dir
    corpus = prepared_corpus(
        storage.resolve(cfg.corpus).uri,
        tokenizer_dir,
        cfg.prepared or storage.join(cfg.output, "corpus"),
        cfg.docs_per_shard,
    )
    manifest = corpus.manifest
    check_shards(corpus.folder, manifest)
    # The settings and widths from the export's JSON files: the driver never holds the weights
    # (a 7B decoder's are 13.5 GB in the head's memory).
    shape = export_shape(model_dir, cfg.encoder.overrides())
    dim, similarity = shape.query_width, shape.cfg.similarity
    if before_work is not None:
        before_work(dim, corpus)
    made_by = _made_by(cfg, model_dir, shape, corpus)
    claim(cfg.output, made_by)

    shards = manifest["shards"]
    done = finished_shards(cfg.output)
    todo = [(i, storage.join(corpus.folder, s["path"])) for i, s in enumerate(shards) if i not in done]
    in_flight = cfg.encoder.shards_in_flight or (2 if cfg.pool.use_gpu else 1)
    remote = ray.remote(EncoderActor).options(**cfg.pool.remote_options(), max_restarts=0, max_concurrency=in_flight)
    with progress(sum(shards[i]["rows"] for i, _ in todo), "encode", "passages") as passages:
        results = run_actor_pool(
            lambda: remote.remote(cfg.encoder, corpus.tokenizer, cfg.pool),
            todo,
            lambda actor, task: actor.encode_shard.remote(task[1], task[0], cfg.output),
            cfg.pool.max_retries,
            cfg.pool.actors,
            lambda task, result: passages.update(result["rows"]),
            calls_per_actor=in_flight,
            capacity=CapacityWait.of(cfg.pool, "encoder actors"),
        )
    entries = [
        {"index": i, "path": shard_path(i), "rows": s["rows"], "first_row": s["first_row"]}
        for i, s in enumerate(shards)
    ]
    write_manifest(
        cfg.output,
        dim,
        entries,
        dtype="float32",
        normalized=similarity == "cos",
        similarity=similarity,
        model=cfg.encoder.model,
        made_by=made_by,
    )
    seconds = time.perf_counter() - started
    return {
        "job": "encode",
        "output": cfg.output,
        "corpus": corpus.folder,
        "passages": manifest["num_docs"],
        "shards": len(shards),
        "shards_encoded": len(todo),
        "shards_skipped": len(done & set(range(len(shards)))),
        "dim": dim,
        "similarity": similarity,
        "actors": cfg.pool.actors,
        "seconds": round(seconds, 2),
        "passages_per_s": round(sum(r["rows"] for r in results) / max(seconds, 1e-9), 1),
        "actor_seconds": round(sum(actor_spans(results).values()), 2),
        "shard_results": [
            {k: r[k] for k in ("index", "rows", "seconds", "device_seconds", "started_at", "finished_at", "pid")}
            for r in results
        ],
    }


def actor_spans(shard_results: list[dict]) -> dict[int, float]:
    """Each actor's (pid's) busy seconds: its first shard call's start to its last one's end.
    With shards in flight the calls' own seconds overlap (each holds its wait for the
    device), so their sum would count that wait twice."""
    spans: dict[int, tuple[float, float]] = {}
    for shard in shard_results:
        first, last = spans.get(shard["pid"], (shard["started_at"], shard["finished_at"]))
        spans[shard["pid"]] = (min(first, shard["started_at"]), max(last, shard["finished_at"]))
    return {pid: last - first for pid, (first, last) in spans.items()}


def store_query_vectors(
    settings: EncoderSettings,
    texts_of: Callable[[int], list[str]],
    blocks: Iterable[int],
    pool: ActorConfig,
    stored: StoredQueryVectors,
) -> int:
    """Encode each of ``blocks`` (block ``b``: the queries ``texts_of(b)``) that ``stored``
    lacks on a pool of actors, each writing the block's vectors there: none pass through
    this process, and a block's texts are read only as an actor is free to take it (the
    pool holds a window of blocks, never every query's text). A block's vectors depend on
    its texts only (it is batched within itself), so a caller that resumes by blocks gets
    bit-identical vectors. A block already stored is kept (the caller's claim on the folder
    says it was made as it would be now). Returns the blocks encoded."""
    todo = [b for b in blocks if not stored.stored(b)]
    settings = dataclasses.replace(settings, model=model_ref.check(settings.model, "--encoder.model"))
    remote = ray.remote(EncoderActor).options(**pool.remote_options(), max_restarts=0)
    rows = sum(min(stored.block, stored.rows - b * stored.block) for b in todo)
    with progress(rows, "encode", "queries") as bar:
        for _ in stream_actor_pool(
            lambda: remote.remote(settings, "", pool),
            ((stored.uri_of(b), texts_of(b)) for b in todo),
            lambda actor, block: actor.encode_queries.remote(block[1], block[0]),
            pool.max_retries,
            pool.actors,
            lambda block, _: bar.update(len(block[1])),
            capacity=CapacityWait.of(pool, "query encoder actors"),
        ):
            pass
    return len(todo)
