"""The whole recipe on Ray, shrunk: a tiny random BERT, 120 passages, 40 training and 12
dev queries, two steps per trainer. Every stage runs for real (Ray Train + DeepSpeed
trainers, encoder / scorer actors, FAISS shards); the test checks what each stage hands the
next and that the results table is what ir_measures says of each stage's run."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModel

from pipeline.core.actor_pool import ActorConfig
from pipeline.data.beir import positives, read_qrels, read_queries
from pipeline.data.runs import read_trec_run
from pipeline.retrieval.rerank_scoring import PairScorer, RerankScoreConfig, run_scoring
from pipeline.training.train_config import TrainConfig
from pipeline.workflows.recipe import STAGES, PipelineConfig, run_pipeline
from tests.helpers import ir_measures_of_run, retrieval_collection, save_tiny_bert

pytestmark = pytest.mark.ray

N_DOCS, N_TRAIN, N_DEV = 120, 40, 12


def _config(tmp_path, data: dict, init: str) -> PipelineConfig:
    cfg = PipelineConfig(output=str(tmp_path / "run"))
    cfg.pretrain.enabled = False
    cfg.model.init = init
    for key in ("corpus", "train_queries", "train_qrels", "dev_queries", "dev_qrels"):
        setattr(cfg.data, key, data[key])
    cfg.data.query_max_len, cfg.data.passage_max_len, cfg.data.docs_per_shard = 12, 32, 60

    def steps(mbs):
        return TrainConfig(
            micro_batch_size=mbs, max_steps=2, lr=1e-3, checkpoint_every=100, cpus_per_worker=1, log_every=1
        )

    for stage in (cfg.round1, cfg.round2, cfg.distill):
        stage.retriever.group_size, stage.train = 4, steps(8)
    cfg.reranker.group_size, cfg.reranker.max_len, cfg.reranker.train = 4, 44, steps(4)
    cfg.reranker.dev_depth, cfg.reranker.teacher_depth, cfg.reranker.teacher_queries = 10, 8, 24
    cfg.reranker.pool.actors = cfg.eval.pool.actors = 1
    cfg.mine.depth, cfg.mine.count, cfg.mine.bm25_depth, cfg.mine.bm25_count = 20, 5, 20, 5
    cfg.eval.k = 50
    return cfg


def _ranked(run_uri: str) -> dict[str, list[str]]:
    return {q: [d for d, _, _ in ranked] for q, ranked in read_trec_run(run_uri).items()}


def test_recipe_end_to_end_then_rerun_and_only(tmp_path, ray_session):
    data = retrieval_collection(tmp_path / "data", N_DOCS, N_TRAIN, N_DEV)
    init = save_tiny_bert(str(tmp_path / "init"), data["texts"])
    cfg = _config(tmp_path, data, init)
    summary = run_pipeline(cfg)
    stages = [s for s in STAGES if s != "pretrain"]
    assert summary["ran"] == stages

    # Each retriever-stage row is what ir_measures computes from that stage's run file.
    records = summary["stages"]
    for stage in ("bm25", "zeroshot", "round1", "round2", "rerank", "distill"):
        expected = ir_measures_of_run(records[stage]["outputs"]["run"], data["dev_qrels"])
        assert records[stage]["metrics"] == pytest.approx(expected, abs=1e-9), stage
    results = open(summary["results"]).read()
    for label in ("BM25", "zero-shot", "round 1", "round 2", "re-ranker", "distillation"):
        assert f"| {label}" in results

    # Round 2 restarts from the initial encoder, on round 1's mined negatives, none judged.
    round2 = yaml.safe_load(open(tmp_path / "run" / "round2" / "config.yaml"))
    assert round2["model"]["init"] == init
    assert round2["data"]["negatives"] == records["mine1"]["outputs"]["negatives"]
    for line in open(records["mine1"]["outputs"]["negatives"]):
        row = json.loads(line)
        assert len(row["negatives"]) == 5 and f"d{row['query_id'][1:]}" not in row["negatives"]

    # The re-ranked run: its top 10 are the re-ranker's order, the rest keep round 2's.
    round2_run, merged = _ranked(records["round2"]["outputs"]["run"]), _ranked(records["rerank"]["outputs"]["run"])
    reranked_top = _ranked(records["rerank"]["outputs"]["reranked_top"])
    for qid, order in merged.items():
        assert order[:10] == reranked_top[qid] and sorted(order[:10]) == sorted(round2_run[qid][:10])
        assert order[10:] == round2_run[qid][10:]

    # The teacher scored a sample of 24 training queries: each query's top 8 of the round-2
    # mining run plus its positive, every pair exactly once, with the scores the exported
    # cross-encoder gives in this process.

    teacher = read_trec_run(records["teacher"]["outputs"]["scores"])
    mined = _ranked(records["mine2"]["outputs"]["run"])
    assert len(teacher) == 24
    for qid, scored in teacher.items():
        assert sorted(d for d, _, _ in scored) == sorted(set(mined[qid][:8]) | {f"d{qid[1:]}"})
    scorer = PairScorer(records["reranker"]["outputs"]["export"])
    queries, passages = read_queries(data["train_queries"]), dict(zip((f"d{i}" for i in range(N_DOCS)), data["texts"]))
    qids = sorted(teacher)[:3]
    direct = scorer.score([queries[q] for q in qids], [[d for d, _, _ in teacher[q]] for q in qids], passages)
    for qid, values in zip(qids, direct):
        assert [s for _, s, _ in teacher[qid]] == pytest.approx(values.tolist(), abs=1e-4)

    # The re-ranker learned: every encoder tensor of its export moved away from the
    # checkpoint it started from (two steps at lr 1e-3).
    initial = AutoModel.from_pretrained(init).state_dict()
    trained = AutoModel.from_pretrained(records["reranker"]["outputs"]["export"]).state_dict()
    moved = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert len(moved) >= 0.9 * len(initial), f"only {len(moved)} of {len(initial)} tensors changed"

    # include_positives adds the judged positives the first stage missed to what is scored
    # (the teacher's use), but the re-ranked metrics still rank the first-stage candidates.
    # The rerank stage scored round 2's dev top 10 without them: score it again with them.
    scored = {False: json.load(open(tmp_path / "run" / "rerank" / "summary.json"))}
    scored[True] = run_scoring(
        RerankScoreConfig(
            model=records["reranker"]["outputs"]["export"],
            run=records["round2"]["outputs"]["run"],
            queries=data["dev_queries"],
            corpus=data["corpus"],
            qrels=data["dev_qrels"],
            depth=cfg.reranker.dev_depth,
            include_positives=True,
            output=str(tmp_path / "score-with-positives"),
            pool=ActorConfig(actors=1),
        )
    )
    assert scored[True]["positives_added"] > 0 and scored[False]["positives_added"] == 0
    assert scored[True]["pairs"] == scored[False]["pairs"] + scored[True]["positives_added"]
    assert scored[True]["metrics"] == pytest.approx(scored[False]["metrics"], abs=1e-9)
    assert scored[True]["first_stage_metrics"] == scored[False]["first_stage_metrics"]
    without, with_positives = (read_trec_run(scored[b]["run"]) for b in (False, True))
    for qid, ranked in without.items():
        extra = {d for d, _, _ in with_positives[qid]} - {d for d, _, _ in ranked}
        assert extra <= set(positives(read_qrels(data["dev_qrels"]).get(qid, {})))

    # Distillation logged KL + alpha * CE, alpha 0.2 by default.
    history = json.load(open(tmp_path / "run" / "distill" / "history.json"))
    assert history and all(h["loss"] == pytest.approx(h["kl"] + 0.2 * h["ce"], rel=1e-5) for h in history)

    # A rerun does nothing; --only reruns one stage and leaves the others' records alone.
    again = run_pipeline(_config(tmp_path, data, init))
    assert again["ran"] == [] and again["skipped"] == stages
    only = _config(tmp_path, data, init)
    only.only = "rerank"
    redone = run_pipeline(only)
    assert redone["ran"] == ["rerank"]
    assert redone["stages"]["rerank"]["metrics"] == pytest.approx(records["rerank"]["metrics"])
    assert redone["stages"]["distill"] == records["distill"]
