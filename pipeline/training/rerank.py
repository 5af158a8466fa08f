"""The cross-encoder re-ranker: training on the shared loop, and scoring on Ray actors.

Training (SimLM stage 3) reuses the fine-tuning data path: the corpus is prepared with the
model's tokenizer, each query gets a group of 1 positive and n-1 negatives (by default the
round-2 top-k that ``jobs/mine.py`` wrote, or BM25 for a standalone run), and the group
stream delivers ``[CLS] q [SEP]`` and ``[CLS] d [SEP]`` token ids. :class:`RerankTask`
joins them into ``[CLS] q [SEP] d [SEP]`` pairs for the loop in ``pipeline/training/loop.py``.

Scoring reads a first-stage TREC run and scores its top-``depth`` candidates per query
(plus, if asked, the judged positives it missed, so a distillation teacher has a score for
every positive) on a pool of Ray actors. The driver holds the texts of the candidate
passages only and ships each block of queries with the texts it needs, so no actor holds
the corpus. The re-ranked run is written atomically; with qrels, it is evaluated with
``ir_measures`` beside the first-stage run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from models.reranker import (
    PairLengths,
    RerankerConfig,
    build_reranker,
    check_max_len,
    listwise_backward,
    pair_inputs,
)
from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.config import to_dict
from pipeline.core.errors import ConfigError, StorageError
from pipeline.core.plots import plot_loss_curve
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.core.sample import SAMPLE_DEV_QRELS, SAMPLE_DEV_QUERIES
from pipeline.retrieval.rerank_scoring import RerankScoreConfig, run_scoring
from pipeline.training.finetune import (
    EncoderInit,
    FinetuneCorpusConfig,
    FinetuneDataConfig,
    prepare_group_training,
)
from pipeline.training.loop import consumed_source_rows, fit
from pipeline.training.train_config import TrainConfig

MINED_NEGATIVES = "runs/mine/negatives.jsonl"  # what jobs/mine.py writes by default


@dataclass
class RerankEvalConfig:
    run: str = field(
        default="",
        metadata={
            "help": "TREC run of first-stage candidates for the eval queries, re-ranked after training; empty = no evaluation"
        },
    )
    queries: str = field(default=SAMPLE_DEV_QUERIES, metadata={"help": "BEIR queries.jsonl of that run"})
    qrels: str = field(default=SAMPLE_DEV_QRELS, metadata={"help": "BEIR qrels TSV of those queries"})
    corpus: str = field(
        default="", metadata={"help": "BEIR corpus.jsonl of the candidates; empty = the training corpus"}
    )
    depth: int = field(default=100, metadata={"help": "candidates re-ranked per query"})


@dataclass
class RerankConfig:
    # Passages up to 160 tokens so that a 32-token query and its passage fill max_len 192.
    data: FinetuneDataConfig = field(
        default_factory=lambda: FinetuneDataConfig(negatives=MINED_NEGATIVES, passage_max_len=160)
    )
    corpus: FinetuneCorpusConfig = field(default_factory=FinetuneCorpusConfig)
    model: EncoderInit = field(default_factory=EncoderInit)
    reranker: RerankerConfig = field(default_factory=RerankerConfig)
    eval: RerankEvalConfig = field(default_factory=RerankEvalConfig)
    pool: ActorConfig = field(default_factory=ActorConfig)
    # micro_batch_size counts queries: each brings group_size pairs.
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            output="runs/rerank",
            micro_batch_size=8,
            max_steps=0,
            epochs=1,
            lr=1e-4,
            checkpoint_every=100,
            cpus_per_worker=2,
        )
    )
    ray: RayConfig = field(default_factory=RayConfig)

    def lengths(self) -> PairLengths:
        return PairLengths(self.data.query_max_len, self.data.passage_max_len, self.reranker.max_len)


class RerankTask:
    """Adapts the cross-encoder to the loop; built on each worker from picklable settings."""

    counter_names: tuple[str, ...] = ()

    def __init__(
        self, init: str, reranker: RerankerConfig, lengths: PairLengths, tokenizer_uri: str, sep_id: int, pad_id: int
    ):
        self.init, self.reranker, self.lengths, self.tokenizer_uri = init, reranker, lengths, tokenizer_uri
        self.sep_id, self.pad_id = sep_id, pad_id
        self._tokenizer_dir: str | None = None

    def build_model(self) -> torch.nn.Module:
        return build_reranker(model_ref.materialize(self.init, "--model.init"), self.lengths)

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        q_ids = torch.tensor(np.ascontiguousarray(batch["q_input_ids"]), dtype=torch.long)  # (b, Lq)
        d_ids = torch.tensor(np.ascontiguousarray(batch["d_input_ids"]), dtype=torch.long)  # (b, n, Ld)
        b, n = d_ids.shape[:2]
        q_len = torch.tensor(np.asarray(batch["q_length"]), dtype=torch.long).reshape(-1)
        d_len = torch.tensor(np.asarray(batch["d_length"]), dtype=torch.long).reshape(-1)
        # Row i * n + j is query i with its j-th passage: groups contiguous, positive first.
        return pair_inputs(
            q_ids.repeat_interleave(n, 0),
            q_len.repeat_interleave(n),
            d_ids.reshape(b * n, -1),
            d_len,
            self.lengths.max_len,
            self.sep_id,
            self.pad_id,
        )

    def backward(self, engine, batch):
        return listwise_backward(engine, batch, self.reranker.group_size)

    def counters(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        return {}

    def consumed_rows(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return consumed_source_rows(batch)

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
        q_len = np.asarray(batch["q_length"]).reshape(-1, 1).astype(np.int64)
        d_len = np.asarray(batch["d_length"]).reshape(len(q_len), -1).astype(np.int64)
        return int(np.minimum(q_len + d_len - 1, self.lengths.max_len).sum())

    def export(self, model: torch.nn.Module, out_dir: str) -> dict[str, str]:
        if self._tokenizer_dir is None:
            self._tokenizer_dir = model_ref.materialize(self.tokenizer_uri, "tokenizer")
        return model.save(out_dir, self._tokenizer_dir)


def _check_training_config(cfg: RerankConfig) -> None:
    """Fail before any corpus preparation on settings that cannot train."""

    cfg.lengths().check()
    if cfg.reranker.group_size < 2:
        raise ConfigError(
            f"--reranker.group_size must be >= 2 (a positive and a negative), got {cfg.reranker.group_size}"
        )
    if cfg.model.init:
        cfg.model.init = model_ref.check(cfg.model.init, "--model.init")
        config = SimpleNamespace(**model_ref.read_config(cfg.model.init, "--model.init"))
        check_max_len(config, cfg.reranker.max_len, f"--model.init {cfg.model.init}")
    if cfg.eval.run:  # found wanting after training would waste the run
        if cfg.eval.depth < 1:
            raise ConfigError(f"--eval.depth must be >= 1, got {cfg.eval.depth}")
        if not storage.exists(cfg.eval.run):
            raise StorageError(f"--eval.run {cfg.eval.run}: no such file (a TREC run of first-stage candidates)")
    if cfg.data.tevatron or cfg.data.negatives == "bm25":
        return
    if not cfg.data.negatives:
        raise ConfigError(
            "the re-ranker trains on hard negatives: --data.negatives FILE (the round-2 top-k "
            "that jobs/mine.py writes) or --data.negatives bm25"
        )
    if not storage.exists(cfg.data.negatives):
        raise StorageError(
            f"--data.negatives {cfg.data.negatives}: no such file. It is what jobs/mine.py "
            "writes (negatives.jsonl); run that first, or use --data.negatives bm25"
        )


def run_reranker_training(cfg: RerankConfig) -> dict:
    """Prepare the data, train the cross-encoder, export it, and re-rank ``eval.run`` if given."""

    _check_training_config(cfg)
    prepared = prepare_group_training(cfg, cfg.reranker.group_size)
    write_run_files(cfg, cfg.train.output)
    spec = prepared.stream.spec
    task = RerankTask(cfg.model.init, cfg.reranker, cfg.lengths(), prepared.tokenizer_uri, spec.sep_id, spec.pad_id)
    result = fit(cfg.train, task, prepared.stream, storage.join(cfg.train.output, "checkpoints"), hparams=to_dict(cfg))
    metrics = result.metrics
    summary = {
        "job": "rerank",
        "export_dir": metrics.get("export_dir"),
        "steps": metrics.get("steps"),
        "final_loss": metrics.get("final_loss"),
        "tokens_per_s": metrics.get("tokens_per_s"),
        "tokens_per_s_per_worker": metrics.get("tokens_per_s_per_worker"),
        "restarts": metrics.get("restarts"),
        "resumes": metrics.get("resumes"),
        "steps_this_attempt": metrics.get("steps_this_attempt"),
        "checkpoint": result.checkpoint,
        "examples": len(prepared.examples),
        "epochs": prepared.epochs,
        "group_size": cfg.reranker.group_size,
        "corpus_docs": prepared.manifest["num_docs"],
        "data_stats": prepared.stats.as_dict(),
        "bm25": prepared.bm25,
    }
    history = storage.read_json(storage.join(cfg.train.output, "history.json"))
    summary["loss_curve"] = plot_loss_curve(
        history, storage.join(cfg.train.output, "loss_curve.png"), title="re-ranker training"
    )
    if cfg.eval.run and summary["export_dir"]:
        summary["eval"] = run_scoring(
            RerankScoreConfig(
                model=summary["export_dir"],
                run=cfg.eval.run,
                queries=cfg.eval.queries,
                qrels=cfg.eval.qrels,
                corpus=cfg.eval.corpus or cfg.corpus.input,
                depth=cfg.eval.depth,
                output=storage.join(cfg.train.output, "eval"),
                pool=cfg.pool,
            )
        )
    storage.write_json(storage.join(cfg.train.output, "summary.json"), summary)
    return summary


# -- scoring -------------------------------------------------------------------------------
