"""Distillation: a retriever trained on a cross-encoder's scores (SimLM's last stage).

The scoring stage writes a TREC run holding the re-ranker's score of each training
query's candidates (the round-2 top-k, plus the judged positives). Each query trains with
its positive (from the qrels) and negatives drawn from its scored candidates, and the
loss is ``KL(teacher softmax || student softmax) + alpha * CE`` over the group
(``models/distillation.py``). The student starts from a checkpoint (SimLM: the same
pre-trained one the round-2 retriever started from). Everything else is the retriever's (``group_training.py``):
the corpus, the group stream (which carries each group's teacher scores), the loop,
the export with ``retriever.json`` and the evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.biencoder import BiEncoderConfig
from models.distillation import DistillationConfig, DistillationObjective
from pipeline.core import storage
from pipeline.core.config import to_dict
from pipeline.core.errors import ConfigError
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.core.sections import Lengths, Section, TrainingQueries
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.examples import DistillDataStats, ExampleRows, load_distillation_examples
from pipeline.retrieval.evaluate import EvalConfig, trainer_eval
from pipeline.training.driver import fit
from pipeline.training.group_training import (
    EncoderInit,
    FinetuneCorpusConfig,
    GroupTask,
    finish_retriever_run,
    prepare_group_training,
)
from pipeline.training.train_config import TrainConfig, embedded_train


@dataclass
class TeacherDraw(Section):
    """How a query's negatives are drawn from the teacher's scored candidates, besides its
    best ``teacher_depth``: the recipe's distillation stage composes the same section."""

    teacher_deep: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "the mix for recall: this many more negatives per query drawn (seeded by --train.seed and the query) from the scored candidates below the best --data.teacher_depth (the recipe's --distill.teacher_best); 0 = none",
        },
    )
    teacher_margin: float | None = field(
        default=None,
        metadata={
            "help": "teacher-cleaned negatives (RocketQA's denoising): drop candidates the teacher scores above the query's lowest positive score minus this, as likely unjudged positives, before the depth cut; counted in data_stats; unset = off"
        },
    )


@dataclass
class DistillDataConfig(TeacherDraw, Lengths, TrainingQueries):
    teacher_scores: str = field(
        default="",
        metadata={
            "help": "TREC run of the teacher's scores (qid Q0 docid rank score tag): every training query's candidates and judged positives, as the scoring stage writes it"
        },
    )
    teacher_depth: int = field(
        default=200,
        metadata={
            "min": 0,
            "help": "negatives per query: the best this many scored candidates by teacher score, judged positives excluded; 0 = all",
        },
    )


@dataclass
class DistillConfig:
    data: DistillDataConfig = field(default_factory=DistillDataConfig)
    corpus: FinetuneCorpusConfig = field(default_factory=FinetuneCorpusConfig)
    model: EncoderInit = field(default_factory=EncoderInit)
    retriever: BiEncoderConfig = field(default_factory=BiEncoderConfig)
    distill: DistillationConfig = field(default_factory=DistillationConfig)
    eval: EvalConfig = field(default_factory=trainer_eval)
    train: TrainConfig = field(default_factory=lambda: embedded_train("distill"))
    ray: RayConfig = field(default_factory=RayConfig)


def load_scored_examples(cfg: DistillConfig, corpus_ids: CorpusIds) -> tuple[ExampleRows, DistillDataStats, None]:
    """``prepare_group_training``'s loader: the examples with their teacher scores, the
    teacher's run streamed a query at a time into arrays."""
    examples, stats = load_distillation_examples(
        cfg.data.queries,
        cfg.data.qrels,
        cfg.data.teacher_scores,
        corpus_ids,
        cfg.data.teacher_depth,
        cfg.data.teacher_margin,
        cfg.data.teacher_deep,
        cfg.train.seed,
    )
    return examples, stats, None


def run_distillation(cfg: DistillConfig) -> dict:
    """Prepare the corpus, read the teacher's scores, train, export, evaluate."""
    if not cfg.data.teacher_scores:
        raise ConfigError(
            "--data.teacher_scores is required: the TREC run of the re-ranker's scores that the scoring stage writes"
        )
    if cfg.data.teacher_depth < 0:
        raise ConfigError(f"--data.teacher_depth must be >= 0 (0 = all candidates), got {cfg.data.teacher_depth}")
    if cfg.data.teacher_deep and not cfg.data.teacher_depth:
        raise ConfigError(
            f"--data.teacher_deep {cfg.data.teacher_deep} draws below the best --data.teacher_depth candidates, "
            "which is 0 (every candidate already): set a depth"
        )
    if cfg.distill.alpha < 0 or cfg.distill.teacher_temperature <= 0:
        raise ConfigError(
            f"--distill.alpha must be >= 0 and --distill.teacher_temperature > 0, got "
            f"{cfg.distill.alpha} and {cfg.distill.teacher_temperature}"
        )
    cfg.data.teacher_scores = storage.resolve(cfg.data.teacher_scores).uri
    prepared = prepare_group_training(
        cfg,
        cfg.retriever.group_size,
        load=load_scored_examples,
    )
    write_run_files(cfg, cfg.train.output)
    task = GroupTask(
        DistillationObjective(cfg.retriever, cfg.distill, cfg.data.passage_max_len, cfg.data.query_max_len),
        cfg.model.init,
        prepared.corpus.tokenizer,
    )
    result = fit(
        cfg.train, task, prepared.stream.parts, storage.join(cfg.train.output, "checkpoints"), hparams=to_dict(cfg)
    )
    return finish_retriever_run(
        cfg,
        prepared,
        result,
        "distill",
        "retriever distillation",
        teacher_scores=cfg.data.teacher_scores,
        teacher_depth=cfg.data.teacher_depth,
        teacher_margin=cfg.data.teacher_margin,
        teacher_deep=cfg.data.teacher_deep,
        alpha=cfg.distill.alpha,
        teacher_temperature=cfg.distill.teacher_temperature,
        teacher_loss=cfg.distill.teacher_loss,
    )
