"""The multi-round recipe as one job: stages, a run manifest, skip / --only / --from.

Stages, in order (``STAGES``); each reads the outputs of earlier ones from the manifest:

- ``pretrain``   (optional) continue pre-training the initial checkpoint on the corpus;
- ``bm25``       BM25 on the dev queries (the baseline row of the results; ``--bm25.enabled``);
- ``zeroshot``   the initial encoder, untrained for retrieval, on the dev queries;
- ``mine0``      (only with ``--mine.bm25_negatives false``) mine the zero-shot index;
- ``round1``     fine-tune with BM25 negatives (or mine0's), then evaluate (encode, index, search);
- ``mine1``      mine the training queries' negatives in the round-1 index;
- ``round2``     fine-tune again from the pre-trained checkpoint on those negatives, evaluate;
- ``mine2``      mine the round-2 index (re-ranker negatives, and the teacher's candidates);
- ``reranker``   train the cross-encoder on the round-2 negatives;
- ``rerank``     re-rank the round-2 dev run with it (the re-ranker row of the results);
- ``teacher``    score the training queries' round-2 candidates: the distillation targets;
- ``distill``    train a retriever on KL(teacher || student) + alpha * CE, evaluate.

The stages are one table (``RECIPE``) of units for the stage engine (``units.run_units``).
The manifest (``<output>/recipe.json``) records each finished stage: its outputs, metrics
and wall time, written atomically after the stage. A rerun skips recorded stages and resumes
an interrupted one from its own checkpoints (trainers) or finished shards (encoding). A
stage run again by ``--only`` or ``--from`` starts from an empty folder. Each record keeps
the settings the stage ran with (``stage_settings``); a rerun whose config changes them runs
that stage again from an empty folder, and every stage that reads it.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import numpy as np

from models.biencoder import BiEncoderConfig
from models.distillation import DistillationConfig
from models.reranker import RerankerConfig
from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.config import to_dict
from pipeline.core.errors import ConfigError
from pipeline.core.plots import plot_metrics
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.core.sections import Lengths, Output, Queries
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus_store import CorpusStore
from pipeline.data.records import read_lines
from pipeline.data.runs import read_trec_run, write_trec_run
from pipeline.retrieval.bm25 import bm25_run, build_index
from pipeline.retrieval.bm25_negatives import Bm25Negatives
from pipeline.retrieval.encode import EncoderSettings
from pipeline.retrieval.evaluate import EvalConfig, EvaluateJobConfig
from pipeline.retrieval.metrics import JOB_MEASURES, evaluate
from pipeline.retrieval.mine import MineConfig, MiningSettings, run_mining
from pipeline.retrieval.rerank_scoring import RerankScoreConfig, run_scoring
from pipeline.training.distill import DistillConfig, DistillDataConfig, TeacherDraw, run_distillation
from pipeline.training.group_training import EncoderInit, FinetuneDataConfig, auto_pooling
from pipeline.training.pretrain import PretrainConfig, run_pretraining
from pipeline.training.rerank import RerankConfig, RerankEvalConfig, run_reranker_training
from pipeline.training.train_config import TrainConfig, embedded_train
from pipeline.workflows import stages
from pipeline.workflows.manifest import RunManifest
from pipeline.workflows.stages import (
    EvalStage,
    PretrainStage,
    RetrievalData,
    RetrieverStage,
    corpus_section,
    corpus_store,
    dev_evaluation,
    eval_k,
    finetune_config,
    pretrained_record,
    train_and_evaluate,
)
from pipeline.workflows.units import Unit, run_units

ROUND2_INIT = "round2"  # --distill.init's name for round 2's export
RERANK_STAGES = ("mine2", "reranker", "rerank", "teacher", "distill")
DISTILL_STAGES = ("teacher", "distill")
MANIFEST = "recipe.json"
FORMER_MANIFEST = "pipeline.json"  # run folders written before the recipe was named so


@dataclass
class MineStage(MiningSettings, Bm25Negatives):
    """The recipe's mining: round 1's BM25 negatives (or the zero-shot retriever's), then
    each round's dense mining."""

    bm25_negatives: bool = field(
        default=True,
        metadata={
            "help": "round 1 trains on BM25 negatives; false: on the zero-shot dense retriever's, mined in the index its dev evaluation built (stage mine0; no BM25 index over the corpus)"
        },
    )


@dataclass
class Bm25Stage:
    """The BM25 row of the results: BM25 over the whole corpus on the dev queries."""

    enabled: bool = field(
        default=True,
        metadata={
            "help": "run the bm25 stage (the baseline row); its index is built once per corpus and shared with round 1's BM25 negatives (docs/retrieval/bm25.md)"
        },
    )


@dataclass
class RerankerStage(RerankerConfig):
    enabled: bool = field(
        default=True,
        metadata={"help": "run mine2, reranker and rerank (and, with --distill.enabled, teacher and distill)"},
    )
    init: str = field(
        default="", metadata={"help": "cross-encoder initial checkpoint; empty = the retrievers' initial encoder"}
    )
    train: TrainConfig = field(default_factory=lambda: embedded_train("recipe.reranker"))
    dev_depth: int = field(default=100, metadata={"min": 1, "help": "round-2 dev candidates re-ranked per query"})
    teacher_depth: int = field(
        default=32, metadata={"min": 1, "help": "round-2 training candidates the teacher scores per query"}
    )
    teacher_queries: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "training queries the teacher scores (a seeded sample; distillation trains on these); 0 = all",
        },
    )
    queries_per_task: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "queries per scoring task: the unit written, resumed and redone after a lost node; 0 = sized by bytes (about 32 MiB of candidate text a task)",
        },
    )
    pool: ActorConfig = field(default_factory=ActorConfig)


@dataclass
class DistillStage(TeacherDraw, RetrieverStage):
    enabled: bool = field(
        default=False,
        metadata={
            "help": "run teacher and distill (with the re-ranker stages); off by default (docs/recipe.md says why)"
        },
    )
    loss: DistillationConfig = field(default_factory=DistillationConfig)
    teacher_best: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "negatives drawn from the teacher's best this many scored candidates of each query (judged positives aside); 0 = every candidate it scored",
        },
    )
    init: str = field(
        default="",
        metadata={
            "help": "student's initial checkpoint; empty = the pre-trained encoder (as rounds 1 and 2); round2 = round 2's export (needs its shared encoder)"
        },
    )


@dataclass
class FinalExport:
    stage: str = field(
        default="",
        metadata={
            "help": "the retriever stage whose export is the recipe's final (round1, round2, distill); empty = the best on --final.metric"
        },
    )
    metric: Literal["MRR@10", "R@10", "R@100", "R@1000", "nDCG@10"] = field(
        default="MRR@10", metadata={"help": "the dev metric that chooses the final retriever"}
    )


@dataclass
class RecipeConfig(
    Output.with_defaults(
        output="runs/recipe", notes={"output": "the run folder: every stage's outputs, recipe.json, results.md"}
    )
):
    data: RetrievalData = field(default_factory=RetrievalData)
    model: EncoderInit = field(
        default_factory=EncoderInit,
        metadata={"help": "what the retrievers start from without the pretrain stage (with it: its export)"},
    )
    pretrain: PretrainStage = field(
        default_factory=PretrainStage,
        metadata={"help": "the pre-training stage; disabled, the retrievers start from --model.init"},
    )
    bm25: Bm25Stage = field(default_factory=Bm25Stage)
    round1: RetrieverStage = field(default_factory=RetrieverStage)
    mine: MineStage = field(default_factory=MineStage)
    round2: RetrieverStage = field(default_factory=RetrieverStage)
    reranker: RerankerStage = field(default_factory=RerankerStage)
    distill: DistillStage = field(default_factory=DistillStage)
    eval: EvalStage = field(default_factory=EvalStage)
    final: FinalExport = field(default_factory=FinalExport)
    only: str = field(default="", metadata={"help": "run just this stage again (its inputs must be recorded)"})
    start_from: str = field(
        default="", metadata={"help": "forget this stage and every later one, then run from it (CLI: --from)"}
    )
    stop_after: str = field(default="", metadata={"help": "stop once this stage is recorded"})
    retries: int = field(
        default=2,
        metadata={
            "min": 0,
            "help": "times a failed stage is run again (resuming from what it committed) before the recipe gives up; a user error (exit 2) is not retried",
        },
    )
    ray: RayConfig = field(default_factory=RayConfig)

    def check_inputs(self, prefix: str) -> tuple[str, ...]:
        enabled = enabled_stages(self)
        for flag, name in (("--only", self.only), ("--from", self.start_from), ("--stop_after", self.stop_after)):
            if name and name not in enabled:
                raise ConfigError(f"{flag} {name}: not a stage of this recipe (stages: {', '.join(enabled)})")
        if self.only and self.start_from:
            raise ConfigError("--only and --from exclude each other")
        if self.final.stage and self.final.stage not in [s for s in RETRIEVER_STAGES if s in enabled]:
            chosen = ", ".join(s for s in RETRIEVER_STAGES if s in enabled)
            raise ConfigError(f"--final.stage {self.final.stage}: not a retriever stage of this recipe ({chosen})")
        if self.distill.init == ROUND2_INIT and not self.round2.retriever.shared_encoder:
            raise ConfigError(
                "--distill.init round2 starts the student from round 2's export, which holds two towers "
                "with --round2.retriever.shared_encoder false: give a checkpoint, or share round 2's encoder"
            )
        return ("model",) if self.pretrain.enabled else ()  # the retrievers start from the pre-training's export


# -- stages ------------------------------------------------------------------------------


@dataclass
class StageContext:
    cfg: RecipeConfig
    manifest: RunManifest

    def folder(self, stage: str) -> str:
        return storage.join(self.cfg.output, stage)

    def output(self, stage: str, key: str) -> str:
        return self.manifest.record(stage)["outputs"][key]

    def retriever(self, settings: BiEncoderConfig, init: str) -> BiEncoderConfig:
        """A retriever stage's settings for a student starting from ``init``: pooling ``auto``
        is the embedded example's own when the recipe pre-trains the embedded toy model, and
        is otherwise left for the trainer to resolve from ``init``."""
        pretrain = self.cfg.pretrain
        toy = pretrain.enabled and pretrain.job.model == PretrainConfig().model and init == self.encoder_init()
        if settings.pooling == "auto" and toy:
            return replace(settings, pooling=auto_pooling(init, embedded_toy=True))
        return copy.deepcopy(settings)

    def encoder_init(self) -> str:
        """What the retrievers start from: the pre-training export, or the initial checkpoint."""
        if self.cfg.pretrain.enabled:
            return self.output("pretrain", "export")

        return model_ref.check(self.cfg.model.init, "--model.init")

    @functools.cached_property
    def corpus(self) -> CorpusStore:
        """The run's corpus: one preparation per tokenizer, read by every stage that uses it."""
        return corpus_store(self.cfg.data, self.cfg.output)

    def prepared_corpus(self, init: str) -> str:
        """Where the corpus prepared with ``init``'s tokenizer lives (a trainer prepares it there)."""
        return self.corpus.folder(init)

    def eval_k(self) -> int:
        return eval_k(self.corpus, self.cfg.eval.k)

    def evaluation(
        self, model: str, folder: str, init: str, pooling: str = "", similarity: str = ""
    ) -> EvaluateJobConfig:
        """The dev evaluation of ``model``, which reads the tokens of ``init``'s tokenizer."""
        corpus = self.prepared_corpus(init)
        return dev_evaluation(self.cfg.data, self.cfg.eval, model, folder, self.eval_k(), pooling, similarity, corpus)

    def evaluate(self, model: str, folder: str, init: str, pooling: str = "", similarity: str = "") -> dict:
        """Dev metrics of ``model``: :meth:`evaluation`, run on the corpus prepared for ``init``."""
        self.corpus.prepared(init)  # what evaluation() names, prepared now if no trainer did
        return stages.run_evaluation(self.evaluation(model, folder, init, pooling, similarity))


def stage_pretrain(ctx: StageContext) -> dict:
    job = copy.deepcopy(ctx.cfg.pretrain.job)
    job.train.output = ctx.folder("pretrain")
    if not job.corpus.output or job.corpus.output == type(job.corpus)().output:
        job.corpus.output = storage.join(ctx.folder("pretrain"), "corpus")
    job.corpus.text = job.corpus.text or ctx.corpus.text_folder  # staged once, whatever corpus it is
    return pretrained_record(run_pretraining(job))


def stage_bm25(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    queries = read_queries(cfg.data.dev.queries)
    with build_index(ctx.corpus.text()) as index:
        run = bm25_run(index, queries, depth=ctx.eval_k())
    run_uri = storage.join(ctx.folder("bm25"), "run.trec")
    write_trec_run(run, run_uri, tag="bm25")
    values = evaluate(read_qrels(cfg.data.dev.qrels, query_ids=queries), run, JOB_MEASURES.values())
    return {"outputs": {"run": run_uri}, "metrics": {n: values[m] for n, m in JOB_MEASURES.items()}}


def stage_zeroshot(ctx: StageContext) -> dict:
    retriever = ctx.cfg.round1.retriever
    init = ctx.encoder_init()
    summary = ctx.evaluate(
        init,
        ctx.folder("zeroshot"),
        init,
        pooling=retriever.pooling,
        similarity=retriever.similarity,
    )
    outputs = {"run": summary["run"], "index": storage.join(ctx.folder("zeroshot"), "index"), "export": init}
    return {"outputs": outputs, "metrics": summary["metrics"], "summary": summary}


def _finetune_config(ctx: StageContext, stage: str, settings: RetrieverStage, init: str, negatives: str):
    return finetune_config(
        ctx.cfg.data,
        replace(settings, retriever=ctx.retriever(settings.retriever, init)),
        init=init,
        negatives=negatives,
        output=ctx.folder(stage),
        corpus=ctx.corpus,
        prepared_corpus=ctx.prepared_corpus(init),
        ray=ctx.cfg.ray,
        bm25=ctx.cfg.mine,
    )


def _retriever_stage(ctx: StageContext, stage: str, settings: RetrieverStage, negatives: str) -> dict:
    job = _finetune_config(ctx, stage, settings, ctx.encoder_init(), negatives)
    return train_and_evaluate(job, ctx.cfg.data, ctx.cfg.eval, ctx.corpus)


def stage_round1(ctx: StageContext) -> dict:
    if ctx.cfg.mine.bm25_negatives:
        return _retriever_stage(ctx, "round1", ctx.cfg.round1, "bm25")
    record = _retriever_stage(ctx, "round1", ctx.cfg.round1, ctx.output("mine0", "negatives"))
    record["summary"]["result_label"] = "round 1 (zero-shot negatives)"
    return record


def stage_mine0(ctx: StageContext) -> dict:
    """Round 1's negatives without BM25: the zero-shot retriever's, mined in the index its
    dev evaluation built, its queries encoded as that evaluation encoded them."""
    retriever = ctx.cfg.round1.retriever
    return _mine(ctx, "mine0", "zeroshot", pooling=retriever.pooling, similarity=retriever.similarity)


def mine_job(ctx: StageContext, stage: str, retriever_stage: str, **encoding: str) -> MineConfig:
    """Mining with ``retriever_stage``'s export over its index, searched as the dev
    evaluations are (the same pool, searchers and nprobe); ``encoding``: the pooling and
    similarity its evaluation used, where the export does not record them (zero-shot)."""
    cfg = ctx.cfg
    return MineConfig(
        index=ctx.output(retriever_stage, "index"),
        **Queries.values_of(cfg.data.train),
        output=ctx.folder(stage),
        **MiningSettings.values_of(cfg.mine),
        nprobe=cfg.eval.nprobe,
        encoder=EncoderSettings(
            model=ctx.output(retriever_stage, "export"),
            precision=cfg.eval.precision,
            **Lengths.values_of(cfg.data),
            **encoding,
        ),
        pool=cfg.eval.pool,
        searchers=cfg.eval.searchers,
    )


def _mine(ctx: StageContext, stage: str, retriever_stage: str, **encoding: str) -> dict:
    summary = run_mining(mine_job(ctx, stage, retriever_stage, **encoding))
    return {
        "outputs": {"negatives": summary["negatives"], "run": summary["run"], "tevatron": summary["tevatron"]},
        "summary": summary,
    }


def stage_mine1(ctx: StageContext) -> dict:
    return _mine(ctx, "mine1", "round1")


def stage_round2(ctx: StageContext) -> dict:
    return _retriever_stage(ctx, "round2", ctx.cfg.round2, ctx.output("mine1", "negatives"))


def stage_mine2(ctx: StageContext) -> dict:
    return _mine(ctx, "mine2", "round2")


def reranker_job(ctx: StageContext) -> RerankConfig:
    cfg, stage = ctx.cfg, ctx.cfg.reranker
    init = stage.init or ctx.encoder_init()
    train = copy.deepcopy(stage.train)
    train.output = ctx.folder("reranker")
    query_len = cfg.data.query_max_len
    return RerankConfig(
        data=FinetuneDataConfig(
            **Queries.values_of(cfg.data.train),
            negatives=ctx.output("mine2", "negatives"),
            query_max_len=query_len,
            passage_max_len=min(cfg.data.passage_max_len, stage.max_len - query_len),
        ),
        corpus=corpus_section(ctx.corpus, ctx.prepared_corpus(init)),
        model=EncoderInit(init=init),
        reranker=RerankerConfig(**{f.name: getattr(stage, f.name) for f in fields(RerankerConfig)}),
        eval=RerankEvalConfig(run=""),
        pool=stage.pool,
        train=train,
        ray=cfg.ray,
    )


def stage_reranker(ctx: StageContext) -> dict:
    summary = run_reranker_training(reranker_job(ctx))
    return {"outputs": {"export": summary["export_dir"]}, "summary": summary}


def score_job(
    ctx: StageContext, stage: str, run: str, queries: Queries, depth: int, include_positives: bool
) -> RerankScoreConfig:
    return RerankScoreConfig(
        model=ctx.output("reranker", "export"),
        run=run,
        corpus=ctx.cfg.data.corpus,
        **Queries.values_of(queries),
        text=ctx.corpus.text_folder,
        include_positives=include_positives,
        depth=depth,
        output=ctx.folder(stage),
        queries_per_task=ctx.cfg.reranker.queries_per_task,
        pool=ctx.cfg.reranker.pool,
    )


def _score(ctx: StageContext, stage: str, run: str, queries: Queries, depth: int, include_positives: bool) -> dict:
    return run_scoring(score_job(ctx, stage, run, queries, depth, include_positives))


def stage_rerank(ctx: StageContext) -> dict:
    """The round-2 dev run with its top ``dev_depth`` re-ordered by the re-ranker and the
    rest kept in round-2 order below them, so every metric is over the same ranking depth
    as the retriever rows (a re-ranked top-30 alone would cap R@100 at R@30)."""

    cfg = ctx.cfg
    first_stage_uri = ctx.output("round2", "run")
    summary = _score(
        ctx,
        "rerank",
        first_stage_uri,
        cfg.data.dev,
        cfg.reranker.dev_depth,
        include_positives=False,
    )
    reranked = read_trec_run(summary["run"])
    merged: dict[str, dict[str, float]] = {}
    for qid, ranked in read_trec_run(first_stage_uri).items():
        top = [doc for doc, _, _ in reranked.get(qid, [])]
        in_top = set(top)
        order = top + [doc for doc, _, _ in ranked if doc not in in_top]
        merged[qid] = {doc: float(len(order) - i) for i, doc in enumerate(order)}  # rank as score
    merged_uri = storage.join(ctx.folder("rerank"), "merged.run.trec")
    write_trec_run(merged, merged_uri, tag="rerank")
    values = evaluate(read_qrels(cfg.data.dev.qrels, query_ids=set(merged)), merged, JOB_MEASURES.values())
    return {
        "outputs": {"run": merged_uri, "reranked_top": summary["run"]},
        "metrics": {name: values[m] for name, m in JOB_MEASURES.items()},
        "summary": summary,
    }


def _sample_run(run_uri: str, n_queries: int, seed: int, out_uri: str) -> str:
    """The run cut to a seeded sample of its queries (all of them when ``n_queries`` is 0),
    in two streamed passes: the query ids, then the kept lines."""

    if n_queries <= 0:
        return run_uri
    qids = sorted({text.split()[0] for _, _, text in read_lines(run_uri) if text.strip()})
    keep = set(np.random.default_rng(seed).permutation(qids)[:n_queries].tolist())
    with storage.open_output(out_uri) as out:
        for _, _, text in read_lines(run_uri):
            if text.strip() and text.split()[0] in keep:
                out.write((text + "\n").encode("utf-8"))
    return out_uri


def stage_teacher(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    candidates = _sample_run(
        ctx.output("mine2", "run"),
        cfg.reranker.teacher_queries,
        cfg.distill.train.seed,
        storage.join(ctx.folder("teacher"), "candidates.trec"),
    )
    summary = _score(
        ctx,
        "teacher",
        candidates,
        cfg.data.train,
        cfg.reranker.teacher_depth,
        include_positives=True,
    )
    return {"outputs": {"scores": summary["run"]}, "summary": summary}


def distill_init(ctx: StageContext) -> tuple[str, str]:
    """The student's initial checkpoint and the model whose tokenizer reads the corpus for it:
    round 2's export (``round2``; distillation runs after it, through the teacher that scored
    its run) with the retrievers' tokenizer, which round 2 kept, so the corpus is not
    prepared again; or the checkpoint given, or the retrievers' own, each with its own."""
    init = ctx.cfg.distill.init
    if init == ROUND2_INIT:
        return ctx.output("round2", "export"), ctx.encoder_init()
    init = init or ctx.encoder_init()
    return init, init


def distill_job(ctx: StageContext) -> DistillConfig:
    cfg, stage = ctx.cfg, ctx.cfg.distill
    init, tokens = distill_init(ctx)
    train = copy.deepcopy(stage.train)
    train.output = ctx.folder("distill")
    return DistillConfig(
        data=DistillDataConfig(
            **Queries.values_of(cfg.data.train),
            teacher_scores=ctx.output("teacher", "scores"),
            teacher_depth=stage.teacher_best,
            **TeacherDraw.values_of(stage),
            **Lengths.values_of(cfg.data),
        ),
        corpus=replace(corpus_section(ctx.corpus, ctx.prepared_corpus(tokens)), tokenizer=tokens),
        model=EncoderInit(init=init),
        retriever=ctx.retriever(stage.retriever, init),
        distill=copy.deepcopy(stage.loss),
        eval=EvalConfig(queries="", qrels=""),
        train=train,
        ray=cfg.ray,
    )


def stage_distill(ctx: StageContext) -> dict:
    _, tokens = distill_init(ctx)
    summary = run_distillation(distill_job(ctx))
    evaluation = ctx.evaluate(summary["export_dir"], storage.join(ctx.folder("distill"), "eval"), tokens)
    return {
        "outputs": {"export": summary["export_dir"], "run": evaluation["run"]},
        "metrics": evaluation["metrics"],
        "summary": {"train": summary, "eval": evaluation},
    }


# -- the recipe as one table --------------------------------------------------------------


@dataclass(frozen=True)
class RecipeStage:
    name: str
    run: Callable[[StageContext], dict]
    after: tuple[str, ...]  # the stages it reads ("pretrain" only where that stage is on)
    sections: Callable[[RecipeConfig], dict]  # the config values it computes with
    result: str = ""  # its row in results.md, for an evaluated stage
    # The values only its dev evaluation reads: a change evaluates it again, its model reused.
    evaluation: Callable[[RecipeConfig], dict] = lambda cfg: {}


def _init(cfg: RecipeConfig) -> dict:
    return {} if cfg.pretrain.enabled else {"init": cfg.model.init}


def _without(section, *names: str) -> dict:
    return {k: v for k, v in to_dict(section).items() if k not in names}


def _trained(cfg: RecipeConfig) -> dict:
    """What a retriever stage's model is made from, of the shared sections: every data setting
    but the dev queries, the initial model."""
    return dict(data=_without(cfg.data, "dev"), **_init(cfg))


def _dev_evaluation(cfg: RecipeConfig) -> dict:
    """What only a retriever stage's dev evaluation reads: the dev queries and how it searches."""
    return dict(data={"dev": cfg.data.dev}, eval=cfg.eval)


def _mined(cfg: RecipeConfig) -> dict:
    """What mined negatives are made from: the mining, the training queries, and the search
    settings of the index the retriever's evaluation built (all but the dev evaluation's k)."""
    return dict(mine=cfg.mine, data=_without(cfg.data, "dev"), eval=_without(cfg.eval, "k"))


def _round1(cfg: RecipeConfig) -> dict:
    """Round 1 is made from BM25's settings, or (without) from mine0's record."""
    if cfg.mine.bm25_negatives:
        return dict(stage=cfg.round1, bm25=[cfg.mine.bm25_depth, cfg.mine.bm25_count], **_trained(cfg))
    return dict(stage=cfg.round1, negatives="mine0", **_trained(cfg))


# Distillation settings added after runs were recorded, at the values that mean "as before":
# left out of the stage's identity there, so a finished distillation is still reused.
DISTILL_AS_BEFORE = {"teacher_deep": 0, "teacher_margin": None}
DISTILL_LOSS_AS_BEFORE = {"teacher_loss": "kl"}


def _distilled(cfg: RecipeConfig) -> dict:
    stage = to_dict(cfg.distill)
    for settings, as_before in ((stage, DISTILL_AS_BEFORE), (stage["loss"], DISTILL_LOSS_AS_BEFORE)):
        for key, value in as_before.items():
            if settings[key] == value:
                del settings[key]
    return dict(stage=stage, **_trained(cfg))


def _not_mined(cfg: RecipeConfig) -> dict:
    return dict(data={"dev": cfg.data.dev}, eval={"k": cfg.eval.k})


def _dev_queries(cfg: RecipeConfig) -> dict:
    """The dev queries, for a stage that never reads them (older runs recorded them)."""
    return dict(data={"dev": cfg.data.dev})


RECIPE = (
    RecipeStage("pretrain", stage_pretrain, (), lambda c: dict(job=c.pretrain.job)),
    RecipeStage("bm25", stage_bm25, (), lambda c: dict(data=c.data, k=c.eval.k), "BM25"),
    RecipeStage(
        "zeroshot",
        stage_zeroshot,
        ("pretrain",),
        lambda c: dict(retriever=c.round1.retriever, data=c.data, eval=c.eval, **_init(c)),
        "zero-shot",
    ),
    RecipeStage("mine0", stage_mine0, ("zeroshot",), _mined, evaluation=_not_mined),
    RecipeStage(
        "round1",
        stage_round1,
        ("pretrain", "mine0"),
        _round1,
        "round 1 (BM25 negatives)",
        _dev_evaluation,
    ),
    RecipeStage("mine1", stage_mine1, ("round1",), _mined, evaluation=_not_mined),
    RecipeStage(
        "round2",
        stage_round2,
        ("pretrain", "mine1"),
        lambda c: dict(stage=c.round2, **_trained(c)),
        "round 2 (mined negatives)",
        _dev_evaluation,
    ),
    RecipeStage("mine2", stage_mine2, ("round2",), _mined, evaluation=_not_mined),
    RecipeStage(
        "reranker",
        stage_reranker,
        ("pretrain", "mine2"),
        lambda c: dict(
            data=_without(c.data, "dev"),
            reranker=[c.reranker.init, c.reranker.group_size, c.reranker.max_len],
            train=c.reranker.train,
            **_init(c),
        ),
        evaluation=_dev_queries,
    ),
    RecipeStage(
        "rerank",
        stage_rerank,
        ("reranker", "round2"),
        lambda c: dict(dev_depth=c.reranker.dev_depth, data=c.data, eval=c.eval),
        "re-ranker (round-2 top-k)",
    ),
    RecipeStage(
        "teacher",
        stage_teacher,
        ("reranker", "mine2"),
        lambda c: dict(
            data=_without(c.data, "dev"),
            depth=c.reranker.teacher_depth,
            queries=c.reranker.teacher_queries,
            seed=c.distill.train.seed,
        ),
        evaluation=_dev_queries,
    ),
    RecipeStage(
        "distill",
        stage_distill,
        ("pretrain", "teacher"),
        _distilled,
        "distillation",
        _dev_evaluation,
    ),
)
STAGES = tuple(stage.name for stage in RECIPE)


def enabled_stages(cfg: RecipeConfig) -> list[str]:
    return [
        s
        for s in STAGES
        if (s != "pretrain" or cfg.pretrain.enabled)
        and (s != "bm25" or cfg.bm25.enabled)
        and (s != "mine0" or not cfg.mine.bm25_negatives)
        and (s not in RERANK_STAGES or cfg.reranker.enabled)
        and (s not in DISTILL_STAGES or cfg.distill.enabled)
    ]


def recipe_units(
    cfg: RecipeConfig, manifest: RunManifest, functions: dict[str, Callable[[StageContext], dict]] | None = None
) -> list[Unit]:
    """The enabled stages as units of the stage engine (``functions`` replaces stages' work by name)."""
    ctx = StageContext(cfg, manifest)
    run = {**{s.name: s.run for s in RECIPE}, **(functions or {})}
    enabled = enabled_stages(cfg)
    return [
        Unit(
            s.name,
            functools.partial(run[s.name], ctx),
            s.after,
            s.sections(cfg),
            (ctx.folder(s.name),),
            s.evaluation(cfg),
        )
        for s in RECIPE
        if s.name in enabled
    ]


def run_recipe(cfg: RecipeConfig, stage_functions: dict[str, Callable[[StageContext], dict]] | None = None) -> dict:
    """Run the stages this invocation needs; returns the summary of the whole run."""
    cfg.output = storage.resolve(cfg.output).uri
    storage.check_reachable(cfg.output)
    cfg.check_inputs("--")  # run_job ran it before Ray; a caller of this function may not have
    enabled = enabled_stages(cfg)
    manifest = RunManifest(cfg.output, MANIFEST, former_name=FORMER_MANIFEST)
    units = recipe_units(cfg, manifest, stage_functions)
    write_run_files(cfg, cfg.output)
    redo = enabled[enabled.index(cfg.start_from) :] if cfg.start_from else []
    ran = run_units(
        manifest, units, "[recipe] stage", redo=redo, only=cfg.only, stop_after=cfg.stop_after, retries=cfg.retries
    )
    final = export_final(cfg, manifest)
    results = write_results(cfg.output, manifest, final)
    print(closing_lines(cfg, manifest, ran, final), file=sys.stderr, flush=True)
    return {
        "job": "recipe",
        "output": cfg.output,
        "final": final,
        "ran": ran,
        "skipped": [s for s in STAGES if manifest.done(s) and s not in ran],
        "results": results,
        "stages": {s: {k: r[k] for k in ("seconds", "metrics", "outputs")} for s, r in manifest.data["stages"].items()},
    }


RESULT_ROWS = tuple((s.name, s.result) for s in RECIPE if s.result)
RETRIEVER_STAGES = ("round1", "round2", "distill")  # each exports a dense retriever it evaluated
FINAL = "final"  # the run's folder of the chosen retriever
CHOSEN = "chosen.json"  # written last into it: which stage's export it is a copy of


def export_final(cfg: RecipeConfig, manifest: RunManifest) -> dict | None:
    """Copy the chosen retriever's export to ``<output>/final``: the stage ``--final.stage``
    pins, else the recorded retriever stage best on ``--final.metric`` (the first of equals,
    in recipe order). A copy already there of the same export is kept. None while no
    retriever stage is recorded."""
    stages = manifest.data["stages"]
    recorded = [s for s in RETRIEVER_STAGES if s in stages and "export" in stages[s]["outputs"]]
    scored = [s for s in recorded if cfg.final.metric in stages[s].get("metrics", {})]
    if cfg.final.stage:
        if cfg.final.stage not in recorded:
            return None
        stage = cfg.final.stage
    elif scored:
        stage = max(scored, key=lambda s: stages[s]["metrics"][cfg.final.metric])  # max keeps the first of equals
    else:
        return None
    source = stages[stage]["outputs"]["export"]
    final = {
        "stage": stage,
        "chosen_by": "--final.stage" if cfg.final.stage else f"best dev {cfg.final.metric}",
        "metrics": stages[stage].get("metrics", {}),
        "source": source,
        "source_version": storage.version(source),
        "export": storage.join(cfg.output, FINAL),
    }
    marker = storage.join(final["export"], CHOSEN)
    if storage.exists(marker) and storage.read_json(marker) == final:
        return final
    storage.delete_dir(final["export"])
    storage.copy_dir(source, final["export"])
    storage.write_json(marker, final)
    print(f"[recipe] final: {stage} ({final['chosen_by']}), copied to {final['export']}", file=sys.stderr, flush=True)
    return final


RESULT_METRICS = ("MRR@10", "R@10", "R@100", "R@1000", "nDCG@10")


def results_table(manifest: RunManifest, final: dict | None) -> list[str]:
    """The dev metrics of each evaluated stage, and the final retriever: the head of
    ``results.md``, and what the recipe prints as it ends."""
    lines = [
        "| stage | " + " | ".join(RESULT_METRICS) + " | wall time (s) |",
        "|---|" + "---:|" * (len(RESULT_METRICS) + 1),
    ]
    stages = manifest.data["stages"]
    for stage, label in RESULT_ROWS:
        if stage in stages and stages[stage].get("metrics"):
            label = stages[stage].get("summary", {}).get("result_label", label)
            metrics = stages[stage]["metrics"]
            cells = [f"{metrics[m]:.4f}" if m in metrics else "" for m in RESULT_METRICS]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {stages[stage]['seconds']:.0f} |")
    if final:
        label = dict(RESULT_ROWS)[final["stage"]]
        lines += ["", f"Final retriever: **{label}** ({final['chosen_by']}), in `{final['export']}`."]
    return lines


def closing_lines(cfg: RecipeConfig, manifest: RunManifest, ran: list[str], final: dict | None) -> str:
    """What the recipe prints on stderr as it ends: the results, and which stages this run
    ran, found recorded (skipped), or left out (switched off)."""
    enabled = enabled_stages(cfg)
    recorded = [s for s in enabled if manifest.done(s) and s not in ran]
    off = [s for s in STAGES if s not in enabled and s != "mine0"]  # (mine0 stands in for BM25's negatives)
    said = [f"[recipe] ran: {', '.join(ran) or 'nothing'}"]
    if recorded:
        said.append(f"recorded before, skipped: {', '.join(recorded)}")
    if off:
        said.append(f"switched off: {', '.join(off)}")
    return "\n".join([*results_table(manifest, final), "", "; ".join(said)])


def write_results(output: str, manifest: RunManifest, final: dict | None = None) -> str:
    """``results.md``: a row per evaluated stage, the final retriever and how it was chosen,
    and every stage's wall time."""
    lines = results_table(manifest, final)
    stages = manifest.data["stages"]
    lines += ["", "| stage | wall time (s) | outputs |", "|---|---:|---|"]
    for stage in STAGES:
        if stage in stages:
            outputs = ", ".join(f"{k}: `{v}`" for k, v in stages[stage]["outputs"].items())
            lines.append(f"| {stage} | {stages[stage]['seconds']:.0f} | {outputs} |")
    uri = storage.join(output, "results.md")
    storage.write_bytes(uri, ("\n".join(lines) + "\n").encode())
    evaluated = {label: stages[s]["metrics"] for s, label in RESULT_ROWS if s in stages and stages[s].get("metrics")}
    if evaluated:
        plot_metrics(evaluated, RESULT_METRICS, storage.join(output, "metrics.png"), "dev metrics per stage")
    return uri


def cli_args(argv: list[str]) -> list[str]:
    """``--from STAGE`` is the issue's spelling; ``from`` cannot be a dataclass field."""
    return [
        "--start_from" if a == "--from" else "--start_from=" + a[7:] if a.startswith("--from=") else a for a in argv
    ]
