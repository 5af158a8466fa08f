"""The multi-round recipe as one job: stages, a run manifest, skip / --only / --from.

Stages, in order (``STAGES``); each reads the outputs of earlier ones from the manifest:

- ``pretrain``   (optional) continue pre-training the initial checkpoint on the corpus;
- ``bm25``       BM25 on the dev queries (the baseline row of the results);
- ``zeroshot``   the initial encoder, untrained for retrieval, on the dev queries;
- ``round1``     fine-tune with BM25 negatives, then evaluate (encode, index, search);
- ``mine1``      mine the training queries' negatives in the round-1 index;
- ``round2``     fine-tune again from the pre-trained checkpoint on those negatives, evaluate;
- ``mine2``      mine the round-2 index (re-ranker negatives, and the teacher's candidates);
- ``reranker``   train the cross-encoder on the round-2 negatives;
- ``rerank``     re-rank the round-2 dev run with it (the re-ranker row of the results);
- ``teacher``    score the training queries' round-2 candidates: the distillation targets;
- ``distill``    train a retriever on KL(teacher || student) + alpha * CE, evaluate.

The manifest (``<output>/pipeline.json``) records each finished stage: its outputs, metrics
and wall time, written atomically after the stage. A rerun skips recorded stages and resumes
an interrupted one from its own checkpoints (trainers) or finished shards (encoding). A
stage run again by ``--only`` or ``--from`` starts from an empty folder. Each record keeps
the settings the stage ran with (``stage_settings``); a rerun whose config changes them runs
that stage again from an empty folder, and every stage that reads it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np

from models.biencoder import BiEncoderConfig
from models.distillation import DistillationConfig
from models.reranker import RerankerConfig
from pipeline.core import model_ref, storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.errors import ConfigError
from pipeline.core.plots import plot_metrics
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.core.sample import (
    SAMPLE_CORPUS,
    SAMPLE_DEV_QRELS,
    SAMPLE_DEV_QUERIES,
    SAMPLE_TRAIN_QRELS,
    SAMPLE_TRAIN_QUERIES,
)
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus import iter_documents
from pipeline.data.records import read_lines
from pipeline.data.runs import read_trec_run, write_trec_run
from pipeline.retrieval.bm25 import bm25_run, build_index
from pipeline.retrieval.encode import EncoderSettings
from pipeline.retrieval.evaluate import EvalConfig, EvaluateJobConfig, run_evaluation
from pipeline.retrieval.metrics import JOB_MEASURES, evaluate
from pipeline.retrieval.mine import MineConfig, run_mining
from pipeline.retrieval.rerank_scoring import RerankScoreConfig, run_scoring
from pipeline.training.distill import DistillConfig, DistillDataConfig, run_distillation
from pipeline.training.finetune import (
    EncoderInit,
    FinetuneConfig,
    FinetuneCorpusConfig,
    FinetuneDataConfig,
    run_finetuning,
)
from pipeline.training.pretrain import PretrainConfig, run_pretraining
from pipeline.training.rerank import (
    RerankConfig,
    RerankEvalConfig,
    run_reranker_training,
)
from pipeline.training.train_config import TrainConfig
from pipeline.workflows.manifest import RunManifest, unit_settings

STAGES = (
    "pretrain",
    "bm25",
    "zeroshot",
    "round1",
    "mine1",
    "round2",
    "mine2",
    "reranker",
    "rerank",
    "teacher",
    "distill",
)
RERANK_STAGES = ("mine2", "reranker", "rerank", "teacher", "distill")
MANIFEST = "pipeline.json"


@dataclass
class RecipeData:
    corpus: str = field(default=SAMPLE_CORPUS, metadata={"help": "BEIR corpus.jsonl (local or s3://)"})
    train_queries: str = field(default=SAMPLE_TRAIN_QUERIES, metadata={"help": "training queries (BEIR jsonl)"})
    train_qrels: str = field(default=SAMPLE_TRAIN_QRELS, metadata={"help": "their qrels (TSV with a header)"})
    dev_queries: str = field(default=SAMPLE_DEV_QUERIES, metadata={"help": "evaluation queries"})
    dev_qrels: str = field(default=SAMPLE_DEV_QRELS, metadata={"help": "their qrels"})
    query_max_len: int = field(default=32, metadata={"help": "query tokens, [CLS] and [SEP] included"})
    passage_max_len: int = field(default=128, metadata={"help": "passage tokens, [CLS] and [SEP] included"})
    docs_per_shard: int = field(default=20000, metadata={"help": "passages per corpus / embedding shard"})


@dataclass
class RecipeModel:
    init: str = field(
        default="runs/pretrain-condenser/export",
        metadata={
            "help": "initial encoder (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME); with the pretrain stage, what it starts from is --pretrain.* and this is ignored"
        },
    )


@dataclass
class PretrainStage:
    enabled: bool = field(
        default=True,
        metadata={
            "help": "run the pre-training stage (its settings: --pretrain.job.*); false = start from --model.init"
        },
    )
    job: PretrainConfig = field(default_factory=PretrainConfig)


@dataclass
class RetrieverStage:
    retriever: BiEncoderConfig = field(default_factory=lambda: BiEncoderConfig(pooling="mean"))
    # The embedded recipe: 100 steps of 16 queries, enough to move the tiny model.
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            micro_batch_size=16, max_steps=100, lr=5e-4, checkpoint_every=50, cpus_per_worker=2
        )
    )


@dataclass
class MineStage:
    depth: int = field(default=200, metadata={"help": "candidates retrieved per training query"})
    count: int = field(default=30, metadata={"help": "negatives kept per query"})
    skip_top: int = field(
        default=0, metadata={"help": "ignore the best-ranked N candidates (likely unjudged positives)"}
    )
    bm25_depth: int = field(default=200, metadata={"help": "round 1: BM25 candidates per query"})
    bm25_count: int = field(default=30, metadata={"help": "round 1: BM25 negatives kept per query"})


@dataclass
class EvalStage:
    k: int = field(default=1000, metadata={"help": "passages retrieved per dev query (capped at the corpus size)"})
    index: str = field(
        default="Flat", metadata={"help": "FAISS factory of the evaluation / mining index (Flat = exact)"}
    )
    nprobe: int = field(default=32, metadata={"help": "IVF lists searched per query"})
    precision: Literal["auto", "fp32", "fp16", "bf16"] = field(
        default="auto",
        metadata={
            "help": "encoding precision: auto (fp16 on GPU, fp32 on CPU), fp32, fp16 or bf16 (bf16 autocast also speeds up CPUs with AMX)"
        },
    )
    pool: ActorConfig = field(default_factory=ActorConfig)


@dataclass
class RerankerStage:
    enabled: bool = field(default=True, metadata={"help": "run mine2, reranker, rerank, teacher and distill"})
    init: str = field(
        default="", metadata={"help": "cross-encoder initial checkpoint; empty = the retrievers' initial encoder"}
    )
    group_size: int = field(default=8, metadata={"help": "passages per query: 1 positive + n-1 round-2 negatives"})
    max_len: int = field(default=192, metadata={"help": "query + passage tokens"})
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            micro_batch_size=8, max_steps=100, lr=1e-4, checkpoint_every=50, cpus_per_worker=2
        )
    )
    dev_depth: int = field(default=100, metadata={"help": "round-2 dev candidates re-ranked per query"})
    teacher_depth: int = field(
        default=32, metadata={"help": "round-2 training candidates the teacher scores per query"}
    )
    teacher_queries: int = field(
        default=0,
        metadata={
            "help": "training queries the teacher scores (a seeded sample; distillation trains on these); 0 = all"
        },
    )
    pool: ActorConfig = field(default_factory=ActorConfig)


@dataclass
class DistillStage:
    loss: DistillationConfig = field(default_factory=DistillationConfig)
    init: str = field(
        default="",
        metadata={"help": "student's initial checkpoint; empty = the pre-trained encoder (as rounds 1 and 2)"},
    )
    retriever: BiEncoderConfig = field(default_factory=lambda: BiEncoderConfig(pooling="mean"))
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            micro_batch_size=16, max_steps=100, lr=5e-4, checkpoint_every=50, cpus_per_worker=2
        )
    )


@dataclass
class PipelineConfig:
    output: str = field(
        default="runs/pipeline",
        metadata={"help": "run folder (local or s3://): every stage's outputs, pipeline.json, results.md"},
    )
    data: RecipeData = field(default_factory=RecipeData)
    model: RecipeModel = field(default_factory=RecipeModel)
    pretrain: PretrainStage = field(default_factory=PretrainStage)
    round1: RetrieverStage = field(default_factory=RetrieverStage)
    mine: MineStage = field(default_factory=MineStage)
    round2: RetrieverStage = field(default_factory=RetrieverStage)
    reranker: RerankerStage = field(default_factory=RerankerStage)
    distill: DistillStage = field(default_factory=DistillStage)
    eval: EvalStage = field(default_factory=EvalStage)
    only: str = field(default="", metadata={"help": "run just this stage again (its inputs must be recorded)"})
    start_from: str = field(
        default="", metadata={"help": "forget this stage and every later one, then run from it (CLI: --from)"}
    )
    stop_after: str = field(default="", metadata={"help": "stop once this stage is recorded"})
    ray: RayConfig = field(default_factory=RayConfig)


# -- the run manifest --------------------------------------------------------------------


def stage_settings(cfg: PipelineConfig) -> dict[str, dict]:
    """Each stage's settings: the config values it computes with, and the stages it reads."""
    data, ev, mine, reranker = cfg.data, cfg.eval, cfg.mine, cfg.reranker
    start = ("pretrain",) if cfg.pretrain.enabled else ()
    init = {} if cfg.pretrain.enabled else {"init": cfg.model.init}
    evaluated = dict(data=data, eval=ev)
    inputs: dict[str, tuple[tuple[str, ...], dict]] = {
        "pretrain": ((), dict(job=cfg.pretrain.job)),
        "bm25": ((), dict(data=data, k=ev.k)),
        "zeroshot": (start, dict(retriever=cfg.round1.retriever, **evaluated, **init)),
        "round1": (start, dict(stage=cfg.round1, bm25=[mine.bm25_depth, mine.bm25_count], **evaluated, **init)),
        "mine1": (("round1",), dict(mine=mine, **evaluated)),
        "round2": (start + ("mine1",), dict(stage=cfg.round2, **evaluated, **init)),
        "mine2": (("round2",), dict(mine=mine, **evaluated)),
        "reranker": (
            start + ("mine2",),
            dict(
                data=data,
                reranker=[reranker.init, reranker.group_size, reranker.max_len],
                train=reranker.train,
                **init,
            ),
        ),
        "rerank": (("reranker", "round2"), dict(dev_depth=reranker.dev_depth, **evaluated)),
        "teacher": (
            ("reranker", "mine2"),
            dict(
                data=data, depth=reranker.teacher_depth, queries=reranker.teacher_queries, seed=cfg.distill.train.seed
            ),
        ),
        "distill": (start + ("teacher",), dict(stage=cfg.distill, **evaluated, **init)),
    }
    settings: dict[str, dict] = {}
    for stage in STAGES:  # upstream first
        after, sections = inputs[stage]
        settings[stage] = unit_settings({a: settings[a] for a in after}, **sections)
    return settings


def plan_stages(cfg: PipelineConfig, manifest: RunManifest, settings: dict[str, dict]) -> list[str]:
    """The stages this invocation runs, in order. Those to redo from scratch (--only, --from,
    or recorded or started with other settings) lose their folders and records first."""
    enabled = [
        s
        for s in STAGES
        if (s != "pretrain" or cfg.pretrain.enabled) and (s not in RERANK_STAGES or cfg.reranker.enabled)
    ]
    for flag, name in (("--only", cfg.only), ("--from", cfg.start_from), ("--stop_after", cfg.stop_after)):
        if name and name not in enabled:
            raise ConfigError(f"{flag} {name}: not a stage of this recipe (stages: {', '.join(enabled)})")
    if cfg.only and cfg.start_from:
        raise ConfigError("--only and --from exclude each other")
    folder = StageContext(cfg, manifest).folder
    folders = lambda stage: [folder(stage)]
    if cfg.only:
        manifest.discard_stale({cfg.only: settings[cfg.only]}, folders, "[pipeline] stage", redo=[cfg.only])
        return [cfg.only]
    redo = enabled[enabled.index(cfg.start_from) :] if cfg.start_from else []
    manifest.discard_stale({s: settings[s] for s in enabled}, folders, "[pipeline] stage", redo=redo)
    todo = [s for s in enabled if not manifest.done(s)]
    if cfg.stop_after:
        todo = [s for s in todo if enabled.index(s) <= enabled.index(cfg.stop_after)]
    return todo


# -- stages ------------------------------------------------------------------------------


@dataclass
class StageContext:
    cfg: PipelineConfig
    manifest: RunManifest

    def folder(self, stage: str) -> str:
        return storage.join(self.cfg.output, stage)

    def output(self, stage: str, key: str) -> str:
        return self.manifest.record(stage)["outputs"][key]

    def encoder_init(self) -> str:
        """What the retrievers start from: the pre-training export, or the initial checkpoint."""
        if self.cfg.pretrain.enabled:
            return self.output("pretrain", "export")

        return model_ref.check(self.cfg.model.init, "--model.init")

    def prepared_corpus(self, init: str) -> str:
        """One prepared corpus per tokenizer, shared by the stages that use it."""
        return storage.join(self.cfg.output, "corpus", hashlib.sha1(init.encode()).hexdigest()[:10])


def evaluate_dev(
    data: RecipeData, settings: EvalStage, model: str, folder: str, k: int, pooling: str = "", normalize: bool = False
) -> dict:
    """Dev metrics of a retriever through the distributed path: encode on actors, index, search."""

    return run_evaluation(
        EvaluateJobConfig(
            model=model,
            corpus=data.corpus,
            queries=data.dev_queries,
            qrels=data.dev_qrels,
            pooling=pooling,
            normalize=normalize,
            index=settings.index,
            k=k,
            output=folder,
            pool=settings.pool,
            max_len=data.passage_max_len,
            query_max_len=data.query_max_len,
            nprobe=settings.nprobe,
            docs_per_shard=data.docs_per_shard,
            precision=settings.precision,
        )
    )


def _evaluate(ctx: StageContext, model: str, folder: str, pooling: str = "", normalize: bool = False) -> dict:
    return evaluate_dev(ctx.cfg.data, ctx.cfg.eval, model, folder, _eval_k(ctx), pooling, normalize)


def _eval_k(ctx: StageContext) -> int:
    return eval_k(ctx.manifest, ctx.cfg.data.corpus, ctx.cfg.eval.k)


def eval_k(manifest: RunManifest, corpus: str, k: int) -> int:
    """``k`` capped at the corpus size, which is counted once per run and kept in the manifest."""

    if "corpus_docs" not in manifest.data:
        manifest.data["corpus_docs"] = sum(1 for _ in iter_documents(corpus))
    return min(k, manifest.data["corpus_docs"])


def stage_pretrain(ctx: StageContext) -> dict:
    job = copy.deepcopy(ctx.cfg.pretrain.job)
    job.train.output = ctx.folder("pretrain")
    if not job.corpus.output or job.corpus.output == type(job.corpus)().output:
        job.corpus.output = storage.join(ctx.folder("pretrain"), "corpus")
    summary = run_pretraining(job)
    return {"outputs": {"export": summary["export_dir"]}, "summary": summary}


def stage_bm25(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    queries = read_queries(cfg.data.dev_queries)
    with build_index(cfg.data.corpus, storage.join(ctx.folder("bm25"), "text-shards")) as index:
        run = bm25_run(index, queries, depth=_eval_k(ctx))
    run_uri = storage.join(ctx.folder("bm25"), "run.trec")
    write_trec_run(run, run_uri, tag="bm25")
    values = evaluate(read_qrels(cfg.data.dev_qrels, query_ids=set(queries)), run, JOB_MEASURES.values())
    return {"outputs": {"run": run_uri}, "metrics": {n: values[m] for n, m in JOB_MEASURES.items()}}


def stage_zeroshot(ctx: StageContext) -> dict:
    retriever = ctx.cfg.round1.retriever
    summary = _evaluate(
        ctx,
        ctx.encoder_init(),
        ctx.folder("zeroshot"),
        pooling=retriever.pooling,
        normalize=retriever.similarity == "cos",
    )
    return {"outputs": {"run": summary["run"]}, "metrics": summary["metrics"], "summary": summary}


def finetune_config(
    data: RecipeData,
    settings: RetrieverStage,
    *,
    init: str,
    negatives: str,
    output: str,
    prepared_corpus: str,
    ray: RayConfig,
    queries: str = "",
    qrels: str = "",
    bm25_depth: int = 200,
    bm25_count: int = 30,
):
    """The fine-tuning job of one retriever stage (``queries`` / ``qrels``: a subset of the
    training queries instead of ``data``'s)."""

    train = copy.deepcopy(settings.train)
    train.output = output
    return FinetuneConfig(
        data=FinetuneDataConfig(
            queries=queries or data.train_queries,
            qrels=qrels or data.train_qrels,
            negatives=negatives,
            bm25_depth=bm25_depth,
            bm25_count=bm25_count,
            query_max_len=data.query_max_len,
            passage_max_len=data.passage_max_len,
        ),
        corpus=FinetuneCorpusConfig(input=data.corpus, output=prepared_corpus, docs_per_shard=data.docs_per_shard),
        model=EncoderInit(init=init),
        retriever=copy.deepcopy(settings.retriever),
        eval=EvalConfig(queries="", qrels=""),  # evaluated by the caller, through the distributed path
        train=train,
        ray=ray,
    )


def _finetune_config(ctx: StageContext, stage: str, settings: RetrieverStage, init: str, negatives: str):
    return finetune_config(
        ctx.cfg.data,
        settings,
        init=init,
        negatives=negatives,
        output=ctx.folder(stage),
        prepared_corpus=ctx.prepared_corpus(init),
        ray=ctx.cfg.ray,
        bm25_depth=ctx.cfg.mine.bm25_depth,
        bm25_count=ctx.cfg.mine.bm25_count,
    )


def _retriever_stage(ctx: StageContext, stage: str, settings: RetrieverStage, negatives: str) -> dict:
    summary = run_finetuning(_finetune_config(ctx, stage, settings, ctx.encoder_init(), negatives))
    evaluation = _evaluate(ctx, summary["export_dir"], storage.join(ctx.folder(stage), "eval"))
    return {
        "outputs": {
            "export": summary["export_dir"],
            "run": evaluation["run"],
            "index": storage.join(ctx.folder(stage), "eval", "index"),
        },
        "metrics": evaluation["metrics"],
        "summary": {"train": summary, "eval": evaluation},
    }


def stage_round1(ctx: StageContext) -> dict:
    return _retriever_stage(ctx, "round1", ctx.cfg.round1, "bm25")


def _mine(ctx: StageContext, stage: str, retriever_stage: str) -> dict:
    cfg = ctx.cfg
    summary = run_mining(
        MineConfig(
            index=ctx.output(retriever_stage, "index"),
            queries=cfg.data.train_queries,
            qrels=cfg.data.train_qrels,
            output=ctx.folder(stage),
            depth=cfg.mine.depth,
            count=cfg.mine.count,
            skip_top=cfg.mine.skip_top,
            nprobe=cfg.eval.nprobe,
            encoder=EncoderSettings(
                model=ctx.output(retriever_stage, "export"),
                max_len=cfg.data.passage_max_len,
                query_max_len=cfg.data.query_max_len,
                precision=cfg.eval.precision,
            ),
            pool=cfg.eval.pool,
        )
    )
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


def stage_reranker(ctx: StageContext) -> dict:
    cfg, stage = ctx.cfg, ctx.cfg.reranker
    init = stage.init or ctx.encoder_init()
    train = copy.deepcopy(stage.train)
    train.output = ctx.folder("reranker")
    query_len = cfg.data.query_max_len
    summary = run_reranker_training(
        RerankConfig(
            data=FinetuneDataConfig(
                queries=cfg.data.train_queries,
                qrels=cfg.data.train_qrels,
                negatives=ctx.output("mine2", "negatives"),
                query_max_len=query_len,
                passage_max_len=min(cfg.data.passage_max_len, stage.max_len - query_len),
            ),
            corpus=FinetuneCorpusConfig(
                input=cfg.data.corpus, output=ctx.prepared_corpus(init), docs_per_shard=cfg.data.docs_per_shard
            ),
            model=EncoderInit(init=init),
            reranker=RerankerConfig(group_size=stage.group_size, max_len=stage.max_len),
            eval=RerankEvalConfig(run=""),
            pool=stage.pool,
            train=train,
            ray=cfg.ray,
        )
    )
    return {"outputs": {"export": summary["export_dir"]}, "summary": summary}


def _score(
    ctx: StageContext, stage: str, run: str, queries: str, qrels: str, depth: int, include_positives: bool
) -> dict:
    return run_scoring(
        RerankScoreConfig(
            model=ctx.output("reranker", "export"),
            run=run,
            queries=queries,
            corpus=ctx.cfg.data.corpus,
            qrels=qrels,
            include_positives=include_positives,
            depth=depth,
            output=ctx.folder(stage),
            pool=ctx.cfg.reranker.pool,
        )
    )


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
        cfg.data.dev_queries,
        cfg.data.dev_qrels,
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
    values = evaluate(read_qrels(cfg.data.dev_qrels, query_ids=set(merged)), merged, JOB_MEASURES.values())
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
        cfg.data.train_queries,
        cfg.data.train_qrels,
        cfg.reranker.teacher_depth,
        include_positives=True,
    )
    return {"outputs": {"scores": summary["run"]}, "summary": summary}


def stage_distill(ctx: StageContext) -> dict:
    cfg, stage = ctx.cfg, ctx.cfg.distill
    init = stage.init or ctx.encoder_init()
    train = copy.deepcopy(stage.train)
    train.output = ctx.folder("distill")
    summary = run_distillation(
        DistillConfig(
            data=DistillDataConfig(
                queries=cfg.data.train_queries,
                qrels=cfg.data.train_qrels,
                query_max_len=cfg.data.query_max_len,
                passage_max_len=cfg.data.passage_max_len,
                teacher_scores=ctx.output("teacher", "scores"),
                teacher_depth=0,
            ),
            corpus=FinetuneCorpusConfig(
                input=cfg.data.corpus, output=ctx.prepared_corpus(init), docs_per_shard=cfg.data.docs_per_shard
            ),
            model=EncoderInit(init=init),
            retriever=copy.deepcopy(stage.retriever),
            distill=copy.deepcopy(stage.loss),
            eval=EvalConfig(queries="", qrels=""),
            train=train,
            ray=cfg.ray,
        )
    )
    evaluation = _evaluate(ctx, summary["export_dir"], storage.join(ctx.folder("distill"), "eval"))
    return {
        "outputs": {"export": summary["export_dir"], "run": evaluation["run"]},
        "metrics": evaluation["metrics"],
        "summary": {"train": summary, "eval": evaluation},
    }


STAGE_FUNCTIONS: dict[str, Callable[[StageContext], dict]] = {
    "pretrain": stage_pretrain,
    "bm25": stage_bm25,
    "zeroshot": stage_zeroshot,
    "round1": stage_round1,
    "mine1": stage_mine1,
    "round2": stage_round2,
    "mine2": stage_mine2,
    "reranker": stage_reranker,
    "rerank": stage_rerank,
    "teacher": stage_teacher,
    "distill": stage_distill,
}


def run_pipeline(cfg: PipelineConfig, stage_functions: dict[str, Callable[[StageContext], dict]] | None = None) -> dict:
    """Run the stages this invocation needs; returns the summary of the whole run."""
    functions = {**STAGE_FUNCTIONS, **(stage_functions or {})}
    cfg.output = storage.resolve(cfg.output).uri
    storage.check_reachable(cfg.output)
    manifest = RunManifest(cfg.output, MANIFEST)
    settings = stage_settings(cfg)
    todo = plan_stages(cfg, manifest, settings)
    write_run_files(cfg, cfg.output)
    ctx = StageContext(cfg, manifest)
    ran = []
    for stage in todo:
        manifest.run(stage, settings[stage], functools.partial(functions[stage], ctx), "[pipeline] stage")
        ran.append(stage)
    results = write_results(cfg.output, manifest)
    return {
        "job": "pipeline",
        "output": cfg.output,
        "ran": ran,
        "skipped": [s for s in STAGES if manifest.done(s) and s not in ran],
        "results": results,
        "stages": {s: {k: r[k] for k in ("seconds", "metrics", "outputs")} for s, r in manifest.data["stages"].items()},
    }


RESULT_ROWS = (
    ("bm25", "BM25"),
    ("zeroshot", "zero-shot"),
    ("round1", "round 1 (BM25 negatives)"),
    ("round2", "round 2 (mined negatives)"),
    ("rerank", "re-ranker (round-2 top-k)"),
    ("distill", "distillation"),
)
RESULT_METRICS = ("MRR@10", "R@10", "R@100", "R@1000", "nDCG@10")


def write_results(output: str, manifest: RunManifest) -> str:
    """``results.md``: a row per evaluated stage, and every stage's wall time."""
    lines = [
        "| stage | " + " | ".join(RESULT_METRICS) + " | wall time (s) |",
        "|---|" + "---:|" * (len(RESULT_METRICS) + 1),
    ]
    stages = manifest.data["stages"]
    for stage, label in RESULT_ROWS:
        if stage in stages and stages[stage].get("metrics"):
            metrics = stages[stage]["metrics"]
            cells = [f"{metrics[m]:.4f}" if m in metrics else "" for m in RESULT_METRICS]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {stages[stage]['seconds']:.0f} |")
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
