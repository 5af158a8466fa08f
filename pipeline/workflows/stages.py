"""The stages the recipe and the comparison share: their data and evaluation settings, a
retriever trained then evaluated through the distributed path, and a pre-training's record.

Neither workflow imports the other; what both need lives here.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from models.biencoder import BiEncoderConfig
from pipeline.core import storage
from pipeline.core.config import Renamed
from pipeline.core.runtime import RayConfig
from pipeline.core.sections import Collection, Corpus, Lengths, Queries, training_queries
from pipeline.data.corpus_store import CorpusStore
from pipeline.retrieval.bm25_negatives import Bm25Negatives
from pipeline.retrieval.encode import EncoderSettings
from pipeline.retrieval.evaluate import EvalConfig, EvaluateJobConfig, SearchSettings, evaluation_job, run_evaluation
from pipeline.training.finetune import FinetuneConfig, run_finetuning
from pipeline.training.group_training import EncoderInit, FinetuneCorpusConfig, FinetuneDataConfig
from pipeline.training.pretrain import PretrainConfig
from pipeline.training.train_config import TrainConfig, embedded_train


@dataclass
class RetrievalData(Lengths, Corpus):
    """The run's collection: one corpus, the training queries and the dev queries every
    stage is evaluated on."""

    RENAMED: ClassVar[dict] = {
        f"{split}_{name}": Renamed(f"{split}.{name}") for split in ("train", "dev") for name in ("queries", "qrels")
    }

    train: Queries = field(default_factory=training_queries)
    dev: Queries = field(default_factory=Queries)
    docs_per_shard: int = field(default=20000, metadata={"min": 1, "help": "passages per corpus / embedding shard"})


@dataclass
class PretrainStage:
    """A pre-training a workflow runs before its retrievers, when enabled."""

    enabled: bool = field(default=True, metadata={"help": "run this pre-training (its settings: the job.* options)"})
    job: PretrainConfig = field(default_factory=PretrainConfig)


@dataclass
class RetrieverStage:
    retriever: BiEncoderConfig = field(default_factory=BiEncoderConfig)
    train: TrainConfig = field(default_factory=lambda: embedded_train("recipe.retriever"))


@dataclass
class EvalStage(SearchSettings):
    """How every stage's dev evaluation searches (and mining, with the same searchers)."""

    precision: Literal["auto", "fp32", "fp16", "bf16"] = field(
        default="auto",
        metadata={
            "help": "encoding precision: auto (the model held in fp16 on GPUs, fp32 on CPUs, by measurement), fp32, fp16 or bf16 (bf16 also speeds up CPUs with AMX)"
        },
    )


def corpus_store(data: RetrievalData, output: str) -> CorpusStore:
    """A run's corpus (``<output>/corpus``): its text staged once, each tokenizer's shards
    prepared once, for every stage that reads it."""
    return CorpusStore(data.corpus, storage.join(output, "corpus"), data.docs_per_shard)


def eval_k(corpus: CorpusStore, k: int) -> int:
    """``k`` capped at the corpus size (counted when the corpus is staged, kept with it)."""
    return min(k, corpus.docs())


def dev_evaluation(
    data: RetrievalData,
    settings: EvalStage,
    model: str,
    folder: str,
    k: int,
    pooling: str = "",
    similarity: str = "",
    corpus: str = "",
) -> EvaluateJobConfig:
    """The evaluation job of a retriever on the dev queries. ``pooling`` / ``similarity``:
    overrides of the export's (empty = its own); ``corpus``: the corpus prepared with the
    model's tokenizer (a run's, reused); empty = the raw corpus, prepared inside ``folder``."""

    encoder = EncoderSettings(
        model=model, pooling=pooling, similarity=similarity, precision=settings.precision, **Lengths.values_of(data)
    )
    search = replace(settings, k=k)  # the same pool and searchers
    collection = Collection(corpus=corpus or data.corpus, **Queries.values_of(data.dev))
    return evaluation_job(encoder, collection, search, folder, data.docs_per_shard)


def corpus_section(corpus: CorpusStore, prepared: str) -> FinetuneCorpusConfig:
    """A trainer's corpus section: the run's corpus, prepared (or to be prepared) in
    ``prepared`` from the run's staged text."""
    return FinetuneCorpusConfig(
        input=corpus.corpus, output=prepared, docs_per_shard=corpus.docs_per_shard, text=corpus.text_folder
    )


def finetune_config(
    data: RetrievalData,
    settings: RetrieverStage,
    *,
    init: str,
    negatives: str,
    output: str,
    corpus: CorpusStore,
    prepared_corpus: str,
    ray: RayConfig,
    queries: Queries | None = None,
    bm25: Bm25Negatives | None = None,
) -> FinetuneConfig:
    """The fine-tuning job of one retriever stage (``queries``: a subset of the training
    queries instead of ``data``'s)."""

    train = copy.deepcopy(settings.train)
    train.output = output
    return FinetuneConfig(
        data=FinetuneDataConfig(
            **Queries.values_of(queries or data.train),
            negatives=negatives,
            **Bm25Negatives.values_of(bm25 or Bm25Negatives()),
            query_max_len=data.query_max_len,
            passage_max_len=data.passage_max_len,
        ),
        corpus=corpus_section(corpus, prepared_corpus),
        model=EncoderInit(init=init),
        retriever=copy.deepcopy(settings.retriever),
        eval=EvalConfig(queries="", qrels=""),  # evaluated by the caller, through the distributed path
        train=train,
        ray=ray,
    )


def train_and_evaluate(job: FinetuneConfig, data: RetrievalData, settings: EvalStage, corpus: CorpusStore) -> dict:
    """A retriever stage's record: fine-tune (``job``), then evaluate the export on the dev
    queries into ``<train.output>/eval``, reading the corpus the training prepared (the
    export carries its tokenizer; prepared here if a stand-in trainer did not)."""

    started = time.time()
    summary = run_finetuning(job)
    train_s = time.time() - started
    folder = storage.join(job.train.output, "eval")
    prepared = corpus.prepare(job.corpus.output, job.corpus.tokenizer or job.model.init)
    evaluation = run_evaluation(
        dev_evaluation(
            data, settings, summary["export_dir"], folder, eval_k(corpus, settings.k), corpus=prepared.folder
        )
    )
    return {
        "outputs": {
            "export": summary["export_dir"],
            "run": evaluation["run"],
            "index": storage.join(folder, "index"),
        },
        "metrics": {
            **evaluation["metrics"],
            "train_seconds": round(train_s, 1),
            "tokens_per_s": summary.get("tokens_per_s"),
        },
        "summary": {"train": summary, "eval": evaluation},
    }


def pretrained_record(summary: dict) -> dict:
    """A pre-training stage's record: its export, speed and final loss."""
    return {
        "outputs": {"export": summary["export_dir"]},
        "metrics": {"tokens_per_s": summary.get("tokens_per_s"), "final_loss": summary.get("final_loss")},
        "summary": summary,
    }
