"""Corpus preparation: raw BEIR jsonl / text -> the tokenized shards of pipeline.data.shards.

Preparation has two phases. The driver streams the raw input once, validating it
(errors name file and line) and cutting it into text shards (:mod:`pipeline.data.text_shards`)
in a staging folder next to the output (or a run's shared staging), so every node can read them. Ray tasks then tokenize the shards in
parallel, one task per shard, and write the final shards; the manifest is written
only when every shard is done, so a crashed preparation is never mistaken for a
finished one.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import ray

from pipeline.core import model_ref, storage
from pipeline.core.parts import claim
from pipeline.core.progress import get_counted
from pipeline.core.runtime import RayConfig
from pipeline.core.sample import SAMPLE_CORPUS
from pipeline.core.sections import Output
from pipeline.data.corpus import corpus_files
from pipeline.data.join import JoinConfig
from pipeline.data.shard_tokenizing import PROGRESS, ShardTokenizer, continuation_table, tokenized_shard
from pipeline.data.shards import FORMAT, MANIFEST, WORD_PIECES, PreparedCorpus, check_shard_sizes
from pipeline.data.text_shards import iter_texts, stage_text
from pipeline.data.tokenizer import load_tokenizer, train_wordpiece


@dataclass
class PrepareConfig(Output.with_defaults(output="runs/corpus", notes={"output": "the shards and their manifest"})):
    input: str = field(
        default=SAMPLE_CORPUS,
        metadata={
            "help": "BEIR corpus.jsonl, MS MARCO's collection.tsv (id<TAB>text), a .txt file (blank-line separated documents), their .gz, a Parquet file (see --corpus.columns), or a folder of them; local or s3://"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "HF tokenizer: a model reference (directory, s3://..., Hub id, package:NAME); empty = train a WordPiece vocabulary on the corpus"
        },
    )
    vocab_size: int = field(default=8000, metadata={"min": 1, "help": "size of a trained vocabulary"})
    lowercase: bool = field(default=True, metadata={"help": "lowercase when training a vocabulary"})
    join: JoinConfig = field(default_factory=JoinConfig)
    columns: str = field(
        default="",
        metadata={
            "help": "a Parquet corpus's columns, e.g. id=docid,title=title,text=body; empty = found by name (_id/id/docid/doc_id/pid, title, text/contents/passage)"
        },
    )
    docs_per_shard: int = field(default=20000, metadata={"min": 1, "help": "documents per Parquet shard"})
    on_empty: Literal["skip", "error"] = field(
        default="skip", metadata={"help": "empty documents: skip (counted in the manifest) or error"}
    )
    overwrite: bool = field(default=False, metadata={"help": "redo the preparation even if a finished manifest exists"})
    text: str = field(
        default="",
        metadata={
            "help": "folder of the input's staged text shards, shared with the other readers of a run's corpus (BM25, passage servers); empty = staged in the output's _staging and removed after"
        },
    )

    def check_inputs(self, prefix: str) -> None:
        if self.input:
            corpus_files(self.input)
        if self.tokenizer:
            model_ref.check(self.tokenizer, f"{prefix}tokenizer")


def _settings(cfg: PrepareConfig) -> dict[str, Any]:
    """What the prepared shards depend on: not where they or the staged text live. The
    input is its resolved URI, so a relative and an absolute path are one input."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("output", "overwrite", "text")}
    if not settings["columns"]:  # unset: the settings earlier preparations recorded
        del settings["columns"]
    settings["input"] = storage.resolve(cfg.input).uri
    return settings


def prepare_corpus(cfg: PrepareConfig) -> PreparedCorpus:
    """Prepare ``cfg.input`` into ``cfg.output``. A finished manifest with the same settings
    is reused unless ``overwrite`` is set (its ``reused`` says which)."""
    return PreparedCorpus(cfg.output, _prepare(cfg))


def _stored_tokenizer(cfg: PrepareConfig, items: list[dict], tokenizer_uri: str):
    """The preparation's tokenizer: the one an earlier attempt stored (its record says it is
    whole), else loaded or trained now and stored."""
    stored = storage.join(cfg.output, PROGRESS, "tokenizer.json")
    if storage.exists(stored):
        return load_tokenizer(model_ref.materialize(tokenizer_uri, "the stored tokenizer"))
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.tokenizer:
            tokenizer = load_tokenizer(model_ref.materialize(cfg.tokenizer, "--corpus.tokenizer"))
            tokenizer.save_pretrained(tmp)
        else:
            tokenizer = train_wordpiece(iter_texts(items), tmp, cfg.vocab_size, cfg.lowercase)
        storage.upload_dir(tmp, tokenizer_uri)
    storage.write_json(stored, {"vocab_size": len(tokenizer)})
    return tokenizer


def _prepare(cfg: PrepareConfig) -> dict:

    manifest_uri = storage.join(cfg.output, MANIFEST)
    storage.check_reachable(manifest_uri)
    input_version = storage.version(cfg.input)
    if not cfg.overwrite and storage.exists(manifest_uri):
        manifest = storage.read_json(manifest_uri)
        if (
            manifest.get("completed")
            and manifest.get("settings") == _settings(cfg)
            and manifest.get("input_version") == input_version
        ):
            check_shard_sizes(cfg.output, manifest)
            print(
                f"prepare: reusing {storage.resolve(cfg.output).uri}, prepared from the same input with the same "
                "settings (--corpus.overwrite true prepares it again)",
                file=sys.stderr,
                flush=True,
            )
            return manifest | {"reused": True}
    started = time.time()
    staging = cfg.text or storage.join(cfg.output, "_staging")
    text = stage_text(cfg.input, staging, cfg.docs_per_shard, on_empty=cfg.on_empty, join=cfg.join, columns=cfg.columns)
    items = text["shards"]

    # A preparation cut short by the same input and settings resumes from what it stored
    # (its tokenizer, its finished shards); any other's files are deleted first.
    if cfg.overwrite:
        storage.delete_dir(storage.join(cfg.output, PROGRESS))
    made_by = {"format": FORMAT, "settings": _settings(cfg), "input_version": input_version}
    claim(cfg.output, made_by, work=(MANIFEST, "shards", "tokenizer", PROGRESS, WORD_PIECES), what="prepared files")
    tokenizer_uri = storage.join(cfg.output, "tokenizer")
    tokenizer = _stored_tokenizer(cfg, items, tokenizer_uri)

    # Plain tasks, one per shard (a shard is already a big unit of work): Ray schedules
    # them on free CPUs, with no actor pool to start or tear down.
    tokenize = ray.remote(tokenized_shard).options(num_cpus=1, max_retries=3, num_returns=2)
    shard_tokenizer = ray.put(ShardTokenizer.of(tokenizer, tokenizer_uri))  # one copy for every task
    calls = [tokenize.remote(item, shard_tokenizer, cfg.output) for item in items]  # (entry, counts) refs
    shards = get_counted([entry for entry, _ in calls], "prepare", "documents", [item["rows"] for item in items])
    sizes = storage.file_sizes(cfg.output)  # what a reuse checks the shards against
    shards = sorted(
        ({**{k: s[k] for k in ("path", "first_row", "rows", "tokens")}, "bytes": sizes[s["path"]]} for s in shards),
        key=lambda s: s["first_row"],
    )
    # Which token ids start a word and which continue one, as the tokenizer's word_ids say:
    # whole-word masking reads this, for any tokenizer (WordPiece, BPE, SentencePiece).
    # Summed one shard's counts at a time: the driver holds two vocabulary-sized arrays.
    word_pieces, total = {}, None
    for _, counts_ref in calls:
        counts = ray.get(counts_ref)
        if counts is None:  # a tokenizer without word_ids: masking falls back to "##"
            total = None
            break
        total = counts if total is None else total + counts
    if total is not None:
        storage.write_json(storage.join(cfg.output, WORD_PIECES), continuation_table(total))
        word_pieces = {"word_pieces": WORD_PIECES}
    if not cfg.text:
        storage.delete_dir(staging)
    storage.delete_dir(storage.join(cfg.output, PROGRESS))
    manifest = {
        "format": FORMAT,
        "completed": True,
        "source": cfg.input,
        "input_version": input_version,
        "num_docs": sum(s["rows"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
        "tokenizer": "tokenizer",
        "vocab_size": len(tokenizer),
        "settings": _settings(cfg),
        "input_stats": text["corpus_stats"],
        **word_pieces,
        "seconds": round(time.time() - started, 2),
    }
    storage.write_json(manifest_uri, manifest)
    return manifest | {"reused": False}


@dataclass
class PrepareJobConfig:
    corpus: PrepareConfig = field(default_factory=PrepareConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def run_preparation(cfg: PrepareJobConfig) -> dict:
    """jobs/prepare_corpus.py: prepare the corpus and summarise its manifest."""
    manifest = prepare_corpus(cfg.corpus).manifest
    return {
        "job": "prepare_corpus",
        "output": cfg.corpus.output,
        "shards": len(manifest["shards"]),
        **{k: manifest[k] for k in ("num_docs", "num_tokens", "vocab_size", "input_stats", "reused")},
    }
