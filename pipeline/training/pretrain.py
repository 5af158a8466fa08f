"""Pre-training: a method from ``models/`` on the shared loop, fed by the corpus stream."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow.compute as pc
import torch
import yaml

from models.backbone import FAMILIES, BackboneConfig, build_mlm
from models.cocondenser import CoCondenserConfig, CoCondenserMethod
from models.condenser import CondenserConfig, CondenserMethod
from models.masking import MaskingVocab
from models.memory import ActivationCost
from models.method import PretrainingMethod
from models.mlm import MLMConfig, MLMMethod
from models.simlm import SimLMConfig, SimLMMethod
from pipeline.core import model_ref, storage
from pipeline.core.config import to_dict
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.data.position import checkpoint_folders
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.data.shards import PreparedCorpus, shard_uris
from pipeline.data.stream import (
    StreamSpec,
    TrainingStream,
    estimate_sequences_per_epoch,
)
from pipeline.data.tokenizer import BERT_SPECIALS, check_special_tokens, load_tokenizer
from pipeline.training.driver import check_placement, fit
from pipeline.training.task import Task, run_summary, write_summary
from pipeline.training.tracking import flatten
from pipeline.training.train_config import TrainConfig, embedded_train, epochs_needed, warn_if_a_step_exceeds_an_epoch

METHODS: dict[str, type[PretrainingMethod]] = {
    "condenser": CondenserMethod,
    "cocondenser": CoCondenserMethod,
    "simlm": SimLMMethod,
    "mlm": MLMMethod,
}
HEAD_FILE = "condenser_head.safetensors"


@dataclass
class StreamConfig:
    max_len: int = field(default=128, metadata={"min": 3, "help": "tokens per sequence, [CLS] and [SEP] included"})
    pack: bool = field(
        default=True,
        metadata={
            "help": "pack consecutive documents into full sequences; false = one truncated document per sequence"
        },
    )
    shuffle_files: bool = field(default=True, metadata={"help": "shuffle the shard order each epoch (seeded)"})
    shuffle_window: int = field(
        default=100_000,
        metadata={
            "help": "shuffle rows within windows of this many consecutive corpus rows (within a shard), seeded per epoch, so that a corpus stored grouped by topic never fills a batch with one topic; a resumed run sees the same order; 0 = stream order"
        },
    )

    def __post_init__(self):
        if self.shuffle_window < 0:
            raise ValueError(f"shuffle_window must be >= 0, got {self.shuffle_window}")


@dataclass
class PretrainConfig:
    method: Literal["condenser", "cocondenser", "simlm", "mlm"] = field(
        default="condenser", metadata={"help": "pre-training method"}
    )
    corpus: PrepareConfig = field(default_factory=PrepareConfig)
    data: StreamConfig = field(default_factory=StreamConfig)
    model: BackboneConfig = field(default_factory=BackboneConfig)
    condenser: CondenserConfig = field(default_factory=CondenserConfig)
    cocondenser: CoCondenserConfig = field(default_factory=CoCondenserConfig)
    simlm: SimLMConfig = field(default_factory=SimLMConfig)
    mlm: MLMConfig = field(default_factory=MLMConfig)
    # The embedded default: a tiny model from scratch on the bundled corpus in ~2 minutes on CPU.
    train: TrainConfig = field(default_factory=lambda: embedded_train("pretrain"))
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        if self.train.max_steps < 1:
            raise ValueError(f"train.max_steps must be >= 1 (pre-training runs for steps), got {self.train.max_steps}")

    def run_folder(self) -> str:
        """The run's folder: ``train.output``, by default one per method."""
        return self.train.output or f"runs/pretrain-{self.method}"

    def check_inputs(self, prefix: str) -> None:
        if self.model.init:
            model_ref.check(self.model.init, f"{prefix}model.init")
        if self.method == "simlm" and self.simlm.generator:
            model_ref.check(self.simlm.generator, f"{prefix}simlm.generator")


class PretrainTask(Task):
    """Adapts a pre-training method to the loop; built on each worker from picklable settings."""

    def __init__(
        self,
        method: str,
        method_cfg,
        backbone: BackboneConfig,
        tokenizer_uri: str,
        vocab_size: int,
        word_pieces: dict | None = None,
        max_len: int = 128,
    ):
        """``word_pieces``: the prepared corpus's word-start table (whole-word masking);
        ``max_len``: the stream's row width."""
        self.method_name, self.method_cfg, self.backbone, self.max_len = method, method_cfg, backbone, max_len
        self.tokenizer_uri, self.vocab_size, self.word_pieces = tokenizer_uri, vocab_size, word_pieces

    def build_model(self) -> torch.nn.Module:
        vocab = MaskingVocab.from_tokenizer(load_tokenizer(self.tokenizer_dir(), BERT_SPECIALS), self.word_pieces)
        self.method = METHODS[self.method_name](_materialized(self.method_cfg), vocab)
        backbone = self.backbone
        if backbone.init:
            backbone = dataclasses.replace(backbone, init=model_ref.materialize(backbone.init, "--model.init"))
        return self.method.build(build_mlm(backbone, self.vocab_size))

    @property
    def counter_names(self) -> tuple[str, ...]:
        # The span-pair stream skips documents too short for a pair, and counts them.
        return ("skipped_docs",) if METHODS[self.method_name].example_format == "span_pairs" else ()

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        return self.method.make_batch(batch, generator)

    def backward(self, engine, batch):
        return self.method.backward(engine, batch)

    def counters(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        if "skipped_docs" not in batch:
            return {}
        return {"skipped_docs": int(np.asarray(batch["skipped_docs"]).sum())}

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
        return self.method.count_tokens(batch)

    @property
    def objective(self) -> PretrainingMethod:
        return self.method

    def activation_cost(self, module: torch.nn.Module) -> ActivationCost | None:
        return self.method.activation_cost(module, self.max_len)  # a method measures rows of the stream's width

    def export(self, model: torch.nn.Module, out_dir: str) -> dict[str, str]:
        return self.method.export(model, out_dir, self.tokenizer_dir())


def _materialized(method_cfg):
    """The method's settings with its model references (SimLM's generator and decoder,
    coCondenser's head) as local paths on this node."""
    changes = {}
    for name, is_dir in (("generator", True), ("decoder", False), ("head", False)):
        value = getattr(method_cfg, name, "")
        if value and value != "auto":
            fetch = model_ref.materialize if is_dir else model_ref.materialize_file
            changes[name] = fetch(value, f"--{name}")
    return dataclasses.replace(method_cfg, **changes) if changes else method_cfg


def _pair_fraction(corpus: PreparedCorpus, spans: CoCondenserConfig) -> float:
    """The share of documents long enough for a span pair, from the first shard's lengths,
    so that enough epochs are streamed for max_steps when many documents are skipped."""

    first_shard = shard_uris(corpus.folder, corpus.manifest)[0]
    table = storage.read_parquet(first_shard, columns=["input_ids"])
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    if not len(lengths):
        return 1.0
    fraction = float((lengths >= 2 * spans.min_span_length).mean())
    if fraction == 0:
        raise InputError(
            f"no document of {first_shard} holds two spans of "
            f"{spans.min_span_length}+ tokens: lower --cocondenser.min_span_length"
        )
    return fraction


# Settings a pre-training run's checkpoints were made with: resumed with others, they would
# fail to load (another shape or vocabulary) or train on other data from the stored position.
# What a resume may change: where the corpus goes, and references resolved when the run began.
RESUMES_WITH = ("model", "data", "corpus")
RESUMABLE_CHANGES = {"corpus.output", "corpus.overwrite", "corpus.tokenizer", "cocondenser.head", "simlm.generator"}


def _check_same_run(cfg: PretrainConfig) -> None:
    """A re-run resumes from the output's checkpoints: they must be this method's, made with
    these settings."""

    previous = storage.join(cfg.train.output, "config.yaml")
    if not storage.exists(previous):
        return
    stored = yaml.safe_load(storage.read_bytes(previous)) or {}
    method = stored.get("method")
    if method and method != cfg.method:
        raise ConfigError(
            f"{cfg.train.output} holds a {method} run, and re-running into it resumes its "
            f"checkpoints: give --method {cfg.method} its own --train.output"
        )
    if not checkpoint_folders(storage.join(cfg.train.output, "checkpoints")):
        return
    now = to_dict(cfg)
    sections = (*RESUMES_WITH, cfg.method)
    was, is_now = (flatten({k: d.get(k) or {} for k in sections}) for d in (stored, now))
    changed = [key for key in is_now if key not in RESUMABLE_CHANGES and was.get(key, is_now[key]) != is_now[key]]
    if changed:
        shown = ", ".join(f"--{key} {was[key]} (now {is_now[key]})" for key in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise ConfigError(
            f"{cfg.train.output} holds checkpoints made with other settings: {shown}{more}. Re-running into it "
            f"resumes them: give this run its own --train.output, or delete {cfg.train.output} to start over"
        )


def _resolve_warm_start_head(cfg: PretrainConfig) -> None:
    """coCondenser starts from a trained Condenser, head included (paper §3.3)."""
    if cfg.cocondenser.head == "auto":
        beside = cfg.model.init and model_ref.has_file(cfg.model.init, HEAD_FILE)
        cfg.cocondenser.head = model_ref.join(cfg.model.init, HEAD_FILE) if beside else ""
        if not cfg.cocondenser.head:
            sys.stderr.write(
                "cocondenser: no Condenser head beside --model.init; the head starts from random "
                "(the paper warm-starts from a trained Condenser: pass its export as --model.init)\n"
            )
    elif cfg.cocondenser.head:
        cfg.cocondenser.head = model_ref.check_file(cfg.cocondenser.head, "--cocondenser.head")


GENERATOR_LAYERS = 2  # SimLM's generator is a small MLM (paper: a shallow pre-trained one)


def _auto_generator(cfg: PretrainConfig) -> str:
    """SimLM without ``--simlm.generator``: a 2-layer MLM trained on the same corpus (same
    vocabulary, same budget) under ``<train.output>/generator``, or the one a previous run
    finished there. Says which on stderr."""
    output = storage.join(cfg.train.output, "generator")
    export = storage.join(output, "export")
    if model_ref.has_file(export, "config.json"):  # exports are uploaded last: present means finished
        sys.stderr.write(f"simlm: no --simlm.generator given; reusing the generator trained before at {export}\n")
        return export
    sys.stderr.write(
        f"simlm: no --simlm.generator given; training a {GENERATOR_LAYERS}-layer MLM generator on the same "
        f"corpus first ({cfg.train.max_steps} steps, into {output})\n"
    )
    generator = dataclasses.replace(
        cfg,
        method="mlm",
        model=dataclasses.replace(cfg.model, init="", num_layers=GENERATOR_LAYERS),
        train=dataclasses.replace(cfg.train, output=output, tracker=[]),
    )
    summary = run_pretraining(generator)
    sys.stderr.write(f"simlm: generator trained (final loss {summary['final_loss']:.3f}): {summary['export_dir']}\n")
    return summary["export_dir"]


def _check_simlm_paths(cfg: PretrainConfig) -> None:
    """Fail on the driver, in seconds, rather than on every worker after Ray starts them."""
    cfg.simlm.generator = model_ref.check(cfg.simlm.generator, "--simlm.generator")
    if cfg.simlm.decoder:
        cfg.simlm.decoder = model_ref.check_file(cfg.simlm.decoder, "--simlm.decoder")


def _check_backbone(init: str, vocab_size: int) -> None:
    """What the workers' :func:`build_mlm` would find, found on the driver in seconds."""
    config = model_ref.read_config(init, "--model.init")
    if config.get("model_type") not in FAMILIES:
        raise ConfigError(
            f"--model.init {init}: model_type {config.get('model_type')!r} is not supported: "
            f"pre-training takes {', '.join(FAMILIES)}"
        )
    if config.get("vocab_size", 0) < vocab_size:
        raise ConfigError(
            f"--model.init {init} has vocab_size {config.get('vocab_size')} but the corpus was tokenized with a "
            f"vocabulary of {vocab_size}: prepare the corpus with this checkpoint's tokenizer (--corpus.tokenizer)"
        )


def run_pretraining(cfg: PretrainConfig, *, replay_batches: int = 0) -> dict:
    """Prepare the corpus if needed, train, export; returns the job summary.

    ``replay_batches`` (benchmarks only) trains on the first N streamed batches, cycled.
    """
    cfg.corpus.output = storage.resolve(cfg.corpus.output).uri
    cfg.train.output = storage.resolve(cfg.run_folder()).uri
    if cfg.model.init:
        cfg.model.init = model_ref.check(cfg.model.init, "--model.init")
        if cfg.corpus.input and not cfg.corpus.tokenizer:
            # A checkpoint reads its own token ids: never a vocabulary trained here.
            cfg.corpus.tokenizer = cfg.model.init
    if cfg.corpus.input and cfg.corpus.tokenizer:
        given = "--model.init" if cfg.corpus.tokenizer == cfg.model.init else "--corpus.tokenizer"
        check_special_tokens(cfg.corpus.tokenizer, given, BERT_SPECIALS)
    if cfg.corpus.input and not storage.is_s3(cfg.corpus.input):
        cfg.corpus.input = os.path.abspath(cfg.corpus.input)
    storage.check_reachable(cfg.corpus.output)
    storage.check_reachable(cfg.train.output)
    check_placement(cfg.train)
    _check_same_run(cfg)
    if cfg.method == "cocondenser":
        _resolve_warm_start_head(cfg)
    if cfg.method == "simlm":
        if not cfg.simlm.generator:
            cfg.simlm.generator = _auto_generator(cfg)
        _check_simlm_paths(cfg)

    corpus = prepare_corpus(cfg.corpus) if cfg.corpus.input else PreparedCorpus.load(cfg.corpus.output)
    manifest = corpus.manifest
    tokenizer = load_tokenizer(model_ref.materialize(corpus.tokenizer, "tokenizer"), BERT_SPECIALS)
    if cfg.model.init:
        _check_backbone(cfg.model.init, manifest["vocab_size"])
    run_dir = storage.join(cfg.train.output, "checkpoints")
    method_cfg = getattr(cfg, cfg.method)
    spans = method_cfg if METHODS[cfg.method].example_format == "span_pairs" else None
    # coCondenser streams span pairs: a row is a document, and a span is at most span_length.
    max_len = spans.span_length + 2 if spans else cfg.data.max_len
    pack = cfg.data.pack and not spans
    per_epoch = estimate_sequences_per_epoch(manifest, max_len, pack, bool(spans))
    if spans:
        per_epoch = max(1, int(per_epoch * _pair_fraction(corpus, spans)))
    warn_if_a_step_exceeds_an_epoch(cfg.train, per_epoch, "span pairs" if spans else "sequences")
    spec = StreamSpec(
        corpus=corpus.folder,
        max_len=max_len,
        pack=pack,
        epochs=epochs_needed(cfg.train, per_epoch),
        seed=cfg.train.seed,
        shuffle_files=cfg.data.shuffle_files,
        shuffle_window=cfg.data.shuffle_window,
        cls_id=tokenizer.cls_token_id,
        sep_id=tokenizer.sep_token_id,
        pad_id=tokenizer.pad_token_id,
        run_dir=run_dir,
        spans=spans,
    )
    word_pieces = manifest.get("word_pieces")
    word_pieces = storage.read_json(storage.join(corpus.folder, word_pieces)) if word_pieces else None
    task = PretrainTask(
        cfg.method, method_cfg, cfg.model, corpus.tokenizer, manifest["vocab_size"], word_pieces, max_len=max_len
    )
    write_run_files(cfg, cfg.train.output)

    result = fit(cfg.train, task, TrainingStream(spec), run_dir, replay_batches=replay_batches, hparams=to_dict(cfg))
    summary = run_summary(
        "pretrain",
        result,
        method=cfg.method,
        head_path=result.metrics.get("head_path"),
        corpus_docs=corpus.docs,
        epochs_streamed=spec.epochs,
        **(result.metrics.get("counters") or {}),
    )
    summary["logged_steps"] = [entry["step"] for entry in result.history]
    return write_summary(cfg.train.output, summary, result, f"{cfg.method} pre-training")
