"""The cross-encoder re-ranker: training on the shared loop, and scoring on Ray actors.

Training (SimLM stage 3) reuses the fine-tuning data path: the corpus is prepared with the
model's tokenizer, each query gets a group of 1 positive and n-1 negatives (by default the
round-2 top-k that ``jobs/mine.py`` wrote, or BM25 for a standalone run), and the group
stream delivers ``[CLS] q [SEP]`` and ``[CLS] d [SEP]`` token ids. :class:`RerankTask`
joins them into ``[CLS] q [SEP] d [SEP]`` pairs for the worker's loop (``pipeline/training/worker.py``).

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

from models.reranker import (
    ListwiseObjective,
    PairLengths,
    RerankerConfig,
    check_max_len,
)
from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.config import to_dict
from pipeline.core.errors import ConfigError, StorageError
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.core.sections import Collection
from pipeline.retrieval.rerank_scoring import RerankScoreConfig, run_scoring
from pipeline.training.driver import fit
from pipeline.training.group_training import (
    EncoderInit,
    FinetuneCorpusConfig,
    FinetuneDataConfig,
    GroupTask,
    prepare_group_training,
)
from pipeline.training.task import run_summary, write_summary
from pipeline.training.train_config import TrainConfig, embedded_train

MINED_NEGATIVES = "runs/mine/negatives.jsonl"  # what jobs/mine.py writes by default


@dataclass
class RerankEvalConfig(Collection.with_defaults(corpus="", notes={"corpus": "empty = the training corpus"})):
    """What the trained re-ranker is evaluated on: a first-stage run over the collection."""

    run: str = field(
        default="",
        metadata={
            "help": "TREC run of first-stage candidates for the eval queries, re-ranked after training; empty = no evaluation"
        },
    )
    depth: int = field(default=100, metadata={"min": 1, "help": "candidates re-ranked per query"})


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
    train: TrainConfig = field(default_factory=lambda: embedded_train("rerank"))
    ray: RayConfig = field(default_factory=RayConfig)

    def lengths(self) -> PairLengths:
        return PairLengths(self.data.query_max_len, self.data.passage_max_len, self.reranker.max_len)


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
    framing = prepared.stream.spec.framing
    if len(framing.head) != 1 or len(framing.tail) != 1:
        raise ConfigError(
            f"--model.init {cfg.model.init}: the re-ranker pairs texts as [CLS] query [SEP] passage [SEP]; this "
            "tokenizer does not frame a text with one token each side (a decoder's?): re-rankers take encoders"
        )
    objective = ListwiseObjective(cfg.reranker.group_size, cfg.lengths(), framing.tail[0], framing.pad_id)
    task = GroupTask(objective, cfg.model.init, prepared.corpus.tokenizer)
    result = fit(
        cfg.train, task, prepared.stream.parts, storage.join(cfg.train.output, "checkpoints"), hparams=to_dict(cfg)
    )
    summary = run_summary(
        "rerank", result, **prepared.summary_fields(), group_size=cfg.reranker.group_size, bm25=prepared.bm25
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
    return write_summary(cfg.train.output, summary, result, "re-ranker training")


# -- scoring -------------------------------------------------------------------------------
