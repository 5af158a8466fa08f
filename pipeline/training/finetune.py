"""Retriever fine-tuning: the bi-encoder on the shared loop, fed by the group stream.

Data: BEIR queries + qrels (+ a negatives jsonl, or ``bm25`` to mine round-1 negatives
here with bm25s), or a Tevatron train jsonl (``pipeline/training/group_training.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.biencoder import BiEncoderConfig, ContrastiveObjective
from pipeline.core import model_ref, storage
from pipeline.core.config import to_dict
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.data.tokenizer import check_lengths
from pipeline.retrieval.evaluate import EvalConfig, trainer_eval
from pipeline.training.driver import fit
from pipeline.training.group_training import (
    EncoderInit,
    FinetuneCorpusConfig,
    FinetuneDataConfig,
    GroupTask,
    finish_retriever_run,
    prepare_group_training,
)
from pipeline.training.train_config import TrainConfig, embedded_train


@dataclass
class FinetuneConfig:
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    corpus: FinetuneCorpusConfig = field(default_factory=FinetuneCorpusConfig)
    model: EncoderInit = field(default_factory=EncoderInit)
    # The embedded default: the tiny pre-trained Condenser on the bundled sample's queries,
    # at a high rate (embedded_train), pooling as its checkpoint says (auto: [CLS]).
    retriever: BiEncoderConfig = field(default_factory=BiEncoderConfig)
    eval: EvalConfig = field(default_factory=trainer_eval)
    train: TrainConfig = field(default_factory=lambda: embedded_train("finetune"))
    ray: RayConfig = field(default_factory=RayConfig)

    def check_inputs(self, prefix: str) -> None:
        """The training lengths within the initial model's positions, before Ray starts."""
        lengths = {f"{prefix}data.{n}": getattr(self.data, n) for n in ("query_max_len", "passage_max_len")}
        model_ref.check(self.model.init, f"{prefix}model.init")
        check_lengths(self.model.init, f"{prefix}model.init", **lengths)


def run_finetuning(cfg: FinetuneConfig) -> dict:
    """Prepare the corpus, mine round-1 negatives if asked, train, export, evaluate."""
    prepared = prepare_group_training(
        cfg,
        cfg.retriever.group_size,
    )
    write_run_files(cfg, cfg.train.output)
    task = GroupTask(
        ContrastiveObjective(cfg.retriever, cfg.data.passage_max_len, cfg.data.query_max_len),
        cfg.model.init,
        prepared.corpus.tokenizer,
    )
    result = fit(
        cfg.train, task, prepared.stream.parts, storage.join(cfg.train.output, "checkpoints"), hparams=to_dict(cfg)
    )
    return finish_retriever_run(cfg, prepared, result, "finetune", "retriever fine-tuning", bm25=prepared.bm25)
