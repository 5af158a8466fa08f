"""The recipe's stage bookkeeping: skip, resume, --only, --from, with stand-in stages.

The stand-ins do what a real stage does to its folder (write progress, read it back on a
resume), so these tests pin the manifest logic without paying for training.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from pipeline.core import storage
from pipeline.core.actor_pool import ActorConfig
from pipeline.core.config import check_inputs, parse_config, to_dict
from pipeline.core.errors import ConfigError
from pipeline.core.sections import Queries
from pipeline.data.corpus_store import CorpusStore
from pipeline.data.shards import PreparedCorpus
from pipeline.workflows.manifest import RunManifest
from pipeline.workflows.recipe import (
    MANIFEST,
    RecipeConfig,
    cli_args,
    run_recipe,
)
from pipeline.workflows.recipe import STAGES as ALL_STAGES  # noqa: E402

# The stages a run with the defaults and distillation on goes through: mine0 runs only
# in place of BM25's negatives (the switch's own test below).
STAGES = tuple(s for s in ALL_STAGES if s != "mine0")


class Killed(BaseException):
    """Stands for the process dying: nothing after it runs (not an Exception, so nothing in
    the process, the recipe's stage retries included, can catch it)."""


def fake_stages(calls: list, kill_at: tuple[str, str] | None = None):
    """Stages that count their calls, resume from a progress file, and can die: at a
    stage's start (``(stage, "start")``: between stages) or after half its work
    (``(stage, "middle")``)."""

    def make(stage):
        def run(ctx):
            folder = ctx.folder(stage)
            os.makedirs(folder, exist_ok=True)
            progress = os.path.join(folder, "progress.json")
            done_units = json.load(open(progress)) if os.path.exists(progress) else []
            calls.append((stage, list(done_units)))
            if kill_at == (stage, "start"):
                raise Killed(stage)
            for unit in range(4):
                if unit in done_units:
                    continue
                if kill_at == (stage, "middle") and unit == 2:
                    raise Killed(stage)
                done_units.append(unit)
                json.dump(done_units, open(progress, "w"))
            # A stage reads what the previous stage on recorded (and fails if it is missing).
            before = [s for s in ALL_STAGES[: ALL_STAGES.index(stage)] if ctx.manifest.done(s)]
            previous = before[-1] if before else None
            upstream = ctx.output(previous, "file") if previous else None
            return {"outputs": {"file": progress, "upstream": upstream}, "metrics": {"MRR@10": 0.1}}

        return run

    return {s: make(s) for s in ALL_STAGES}


def cfg_for(tmp_path, **kw) -> RecipeConfig:
    cfg = RecipeConfig(output=str(tmp_path / "run"))
    cfg.distill.enabled = True  # the whole table of stages
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


def test_full_run_records_every_stage_and_a_rerun_does_nothing(tmp_path, capsys):
    """The run ends with its results table on stderr and what it ran; the rerun with what
    it found recorded, and the stages switched off."""
    calls = []
    summary = run_recipe(cfg_for(tmp_path), fake_stages(calls))
    said = capsys.readouterr().err.splitlines()
    assert "| round 2 (mined negatives) | 0.1000 |" in "\n".join(said)
    assert said[-1] == f"[recipe] ran: {', '.join(STAGES)}"
    assert [c[0] for c in calls] == list(STAGES)
    assert summary["ran"] == list(STAGES)
    manifest = RunManifest(str(tmp_path / "run"), MANIFEST)
    assert all(manifest.done(s) for s in STAGES)
    results = open(tmp_path / "run" / "results.md").read()
    assert "| round 2 (mined negatives) | 0.1000 |" in results and "| distill |" in results
    # The same table as a picture: a panel per metric, a bar per evaluated stage.
    from PIL import Image

    with Image.open(tmp_path / "run" / "metrics.png") as png:
        assert png.format == "PNG" and png.size[0] > png.size[1] > 100

    calls.clear()
    summary = run_recipe(cfg_for(tmp_path), fake_stages(calls))
    assert calls == [] and summary["ran"] == [] and summary["skipped"] == list(STAGES)
    assert (
        capsys.readouterr().err.splitlines()[-1]
        == f"[recipe] ran: nothing; recorded before, skipped: {', '.join(STAGES)}"
    )
    without_distillation = cfg_for(tmp_path)
    without_distillation.distill.enabled = False
    run_recipe(without_distillation, fake_stages(calls))
    assert capsys.readouterr().err.splitlines()[-1].endswith("; switched off: teacher, distill")


def test_killed_between_stages_the_rerun_starts_at_the_next_stage(tmp_path):
    calls = []
    with pytest.raises(Killed):
        run_recipe(cfg_for(tmp_path), fake_stages(calls, kill_at=("mine1", "start")))
    assert [c[0] for c in calls] == list(STAGES[: STAGES.index("mine1") + 1])
    before = RunManifest(str(tmp_path / "run"), MANIFEST).data["stages"]["round1"]

    calls.clear()
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    assert [c[0] for c in calls] == list(STAGES[STAGES.index("mine1") :])
    assert RunManifest(str(tmp_path / "run"), MANIFEST).data["stages"]["round1"] == before  # untouched


def test_killed_mid_stage_the_rerun_resumes_that_stage(tmp_path):
    calls = []
    with pytest.raises(Killed):
        run_recipe(cfg_for(tmp_path), fake_stages(calls, kill_at=("round2", "middle")))
    calls.clear()
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    # round2 resumed with its first two units done, and did only the other two.
    assert calls[0] == ("round2", [0, 1])
    assert [c[0] for c in calls] == list(STAGES[STAGES.index("round2") :])
    assert json.load(open(tmp_path / "run" / "round2" / "progress.json")) == [0, 1, 2, 3]


def test_only_redoes_one_stage_from_scratch_and_keeps_the_rest(tmp_path):
    calls = []
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    later = RunManifest(str(tmp_path / "run"), MANIFEST).data["stages"]["distill"]
    calls.clear()
    summary = run_recipe(cfg_for(tmp_path, only="round1"), fake_stages(calls))
    assert calls == [("round1", [])]  # a fresh folder: no progress resumed
    assert summary["ran"] == ["round1"]
    assert RunManifest(str(tmp_path / "run"), MANIFEST).data["stages"]["distill"] == later


def test_from_forgets_that_stage_and_every_later_one(tmp_path):
    calls = []
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    calls.clear()
    run_recipe(cfg_for(tmp_path, start_from="mine2"), fake_stages(calls))
    assert calls == [(s, []) for s in STAGES[STAGES.index("mine2") :]]


def test_a_changed_setting_redoes_that_stage_and_what_reads_it_from_scratch(tmp_path, capsys):
    calls = []
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    kept = RunManifest(str(tmp_path / "run"), MANIFEST).data["stages"]

    # The reranker's learning rate: the reranker, and the stages that read it (the dev
    # re-ranking, the teacher, and the distillation trained on the teacher's scores).
    calls.clear()
    cfg = cfg_for(tmp_path)
    cfg.reranker.train.lr = 3e-4
    run_recipe(cfg, fake_stages(calls))
    assert calls == [(s, []) for s in ("reranker", "rerank", "teacher", "distill")]  # fresh folders
    printed = capsys.readouterr().out
    assert "stage reranker: its settings changed (train.lr: 0.0001 -> 0.0003)" in printed
    after = RunManifest(str(tmp_path / "run"), MANIFEST).data["stages"]
    assert after["round2"] == kept["round2"] and after["reranker"] != kept["reranker"]

    # Where or how a stage runs is not what it computes: a resume elsewhere changes nothing.
    calls.clear()
    cfg.reranker.train.cpus_per_worker, cfg.reranker.pool.actors, cfg.eval.pool.actors = 8, 4, 4
    cfg.round1.train.checkpoint_every = 7
    run_recipe(cfg, fake_stages(calls))
    assert calls == []

    # The dev re-ranking depth touches that stage alone; the retrieval data every stage but
    # pre-training, which reads its own corpus settings.
    cfg.reranker.dev_depth = 50
    run_recipe(cfg, fake_stages(calls))
    assert [c[0] for c in calls] == ["rerank"]
    calls.clear()
    cfg.data.passage_max_len = 64
    run_recipe(cfg, fake_stages(calls))
    assert [c[0] for c in calls] == list(STAGES[1:])


def test_a_stage_killed_midway_resumes_with_its_settings_and_restarts_with_others(tmp_path, capsys):
    calls = []
    with pytest.raises(Killed):
        run_recipe(cfg_for(tmp_path), fake_stages(calls, kill_at=("round2", "middle")))
    cfg = cfg_for(tmp_path)
    cfg.round2.train.lr = 3e-4
    calls.clear()
    run_recipe(cfg, fake_stages(calls))
    # Its half-done folder belonged to the old learning rate: not resumed, started afresh.
    assert calls[0] == ("round2", [])
    assert "stage round2: its settings changed (stage.train.lr: 0.0005 -> 0.0003)" in capsys.readouterr().out
    assert json.load(open(tmp_path / "run" / "round2" / "progress.json")) == [0, 1, 2, 3]


def test_a_run_killed_while_discarding_stale_stages_finishes_discarding_them(tmp_path, monkeypatch):
    run_recipe(cfg_for(tmp_path), fake_stages([]))
    cfg = cfg_for(tmp_path)
    cfg.reranker.train.lr = 3e-4
    deleted = []
    delete_dir = storage.delete_dir

    def dies_after_one(uri):
        if deleted:
            raise Killed(uri)
        deleted.append(uri)
        delete_dir(uri)

    monkeypatch.setattr(storage, "delete_dir", dies_after_one)
    with pytest.raises(Killed):
        run_recipe(cfg, fake_stages([]))
    monkeypatch.undo()
    # One folder is gone while every record is still there: the next run, even with the old
    # settings back, must not trust those records, nor resume the folders still standing.
    assert deleted == [str(tmp_path / "run" / "distill")]
    assert all(RunManifest(str(tmp_path / "run"), MANIFEST).done(s) for s in STAGES)
    calls = []
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    assert calls == [(s, []) for s in ("reranker", "rerank", "teacher", "distill")]


def test_records_from_before_settings_are_kept(tmp_path):
    run_recipe(cfg_for(tmp_path), fake_stages([]))
    manifest = RunManifest(str(tmp_path / "run"), MANIFEST)
    for record in manifest.data["stages"].values():
        del record["settings"]
    manifest.save("distill", manifest.data["stages"]["distill"])
    calls = []
    cfg = cfg_for(tmp_path)
    cfg.round1.train.lr = 1.0
    run_recipe(cfg, fake_stages(calls))
    assert calls == []


def test_only_without_the_inputs_it_needs_names_the_missing_stage(tmp_path):
    with pytest.raises(ConfigError, match="stage 'round1' has not run yet"):
        run_recipe(cfg_for(tmp_path, only="mine1"), fake_stages([]))
    manifest = tmp_path / "run" / "recipe.json"
    assert not manifest.exists() or not json.loads(manifest.read_text())["started"]  # no stage left half begun


def test_bad_stage_names_and_disabled_stages(tmp_path):
    with pytest.raises(ValueError, match="--only mine3: not a stage"):
        run_recipe(cfg_for(tmp_path, only="mine3"), fake_stages([]))
    cfg = cfg_for(tmp_path)
    cfg.reranker.enabled = False
    cfg.pretrain.enabled = False
    calls = []
    stages = fake_stages(calls)
    stages["bm25"] = lambda ctx: {"outputs": {"file": ""}, "metrics": {"MRR@10": 0.2}}  # no pretrain upstream
    run_recipe(cfg, stages)
    assert [c[0] for c in calls] == ["zeroshot", "round1", "mine1", "round2"]


def test_the_initial_checkpoint_is_checked_only_without_the_pretrain_stage(tmp_path):
    """The recipe's --model.init (the trainers' section) is what the retrievers start from
    only without the pretrain stage: with it, a checkpoint that is not there yet is no error.
    Mutation: every section checked whatever the recipe runs."""
    cfg = cfg_for(tmp_path)
    cfg.model.init = str(tmp_path / "not-there")
    check_inputs(cfg)
    cfg.pretrain.enabled = False
    with pytest.raises(ConfigError, match=r"^--model\.init .*not-there"):
        check_inputs(cfg)


def test_stop_after_and_the_from_spelling():
    assert cli_args(["--from", "round2", "--from=mine1", "--only", "x"]) == [
        "--start_from",
        "round2",
        "--start_from=mine1",
        "--only",
        "x",
    ]


def test_stop_after_stops_there(tmp_path):
    calls = []
    run_recipe(cfg_for(tmp_path, stop_after="round1"), fake_stages(calls))
    assert [c[0] for c in calls] == list(STAGES[: STAGES.index("round1") + 1])


def test_shipped_recipes_load_and_the_embedded_one_is_the_default():
    recipes = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "recipes")
    embedded = parse_config(RecipeConfig, ["--config", os.path.join(recipes, "embedded.yaml")])
    assert to_dict(embedded) == to_dict(RecipeConfig())
    for name in sorted(os.listdir(recipes)):
        if name.startswith("compare-"):  # jobs/compare.py's configs: tests/workflows/test_compare.py
            continue
        cfg = parse_config(RecipeConfig, ["--config", os.path.join(recipes, name)])
        assert cfg.data.corpus and cfg.round1.train.max_steps + cfg.round1.train.epochs > 0, name


def test_the_eval_and_reranker_pools_reach_every_stage_whole(tmp_path, monkeypatch):
    """A recipe whose pools set GPUs: every evaluation (zero-shot, rounds 1 and 2,
    distillation), both minings and both scorings receive the pool as configured, not
    just its actor count (the stages' jobs stubbed; what they are handed is recorded)."""
    from pipeline.workflows import recipe, stages

    cfg = cfg_for(tmp_path)
    cfg.eval.pool = ActorConfig(actors=3, use_gpu=True, gpus_per_actor=0.5, cpus_per_actor=4)
    cfg.eval.precision = "bf16"
    cfg.reranker.pool = ActorConfig(actors=2, use_gpu=True, cpus_per_actor=2)
    handed: list[tuple[str, object]] = []

    def evaluation(job):
        handed.append(("evaluate", job))
        return {"run": f"{job.output}/run.trec", "metrics": {"MRR@10": 0.1}}

    def mining(job):
        handed.append(("mine", job))
        return {k: f"{job.output}/{k}" for k in ("negatives", "run", "tevatron")}

    def scoring(job):
        handed.append(("score", job))
        return {"run": f"{job.output}/run.trec", "metrics": {"MRR@10": 0.1}}

    def training(job):
        return {"export_dir": f"{job.train.output}/export"}

    for module, name, fake in [
        (stages, "run_evaluation", evaluation),
        (recipe, "run_mining", mining),
        (recipe, "run_scoring", scoring),
        (stages, "run_finetuning", training),
        (recipe, "run_distillation", training),
        (recipe, "_sample_run", lambda run, *args: run),
    ]:
        monkeypatch.setattr(module, name, fake)
    # The corpus folders, not preparing them (the stand-in trainers prepare nothing).
    monkeypatch.setattr(CorpusStore, "prepared", lambda store, tokenizer: PreparedCorpus(store.folder(tokenizer), {}))
    monkeypatch.setattr(CorpusStore, "prepare", lambda store, folder, tokenizer: PreparedCorpus(folder, {}))
    ctx = recipe.StageContext(cfg, RunManifest(cfg.output, MANIFEST))
    monkeypatch.setattr(CorpusStore, "docs", lambda store: 5000)
    ctx.manifest.save("pretrain", {"outputs": {"export": "s3://b/pretrain/export"}})
    ctx.manifest.save("reranker", {"outputs": {"export": "s3://b/reranker/export"}})
    for stage in ("zeroshot", "round1", "mine1", "round2", "mine2", "teacher", "distill"):
        ctx.manifest.save(stage, getattr(recipe, f"stage_{stage}")(ctx))
    recipe._score(ctx, "rerank", "s3://b/round2/run.trec", Queries("q", "r"), 10, include_positives=False)

    kinds = [kind for kind, _ in handed]
    assert kinds == ["evaluate", "evaluate", "mine", "evaluate", "mine", "score", "evaluate", "score"]
    for kind, job in handed:
        expected = cfg.reranker.pool if kind == "score" else cfg.eval.pool
        assert job.pool == expected, kind
    assert all(job.encoder.precision == "bf16" for kind, job in handed if kind == "evaluate")
    # Every evaluation reads the run's corpus prepared with the pre-trained encoder's
    # tokenizer (every model here starts from it): none prepares its own.
    prepared = ctx.corpus.folder("s3://b/pretrain/export")
    assert [job.corpus for kind, job in handed if kind == "evaluate"] == [prepared] * 4
    assert all(job.encoder.precision == "bf16" for kind, job in handed if kind == "mine")


def test_a_run_folder_from_before_the_rename_keeps_its_records(tmp_path):
    """Run folders written when the manifest was ``pipeline.json`` resume as they are."""
    run_recipe(cfg_for(tmp_path), fake_stages([]))
    os.rename(tmp_path / "run" / MANIFEST, tmp_path / "run" / "pipeline.json")
    calls = []
    summary = run_recipe(cfg_for(tmp_path), fake_stages(calls))
    assert calls == [] and summary["skipped"] == list(STAGES)
    assert RunManifest(str(tmp_path / "run"), MANIFEST).done("distill")  # now under its new name


def test_every_data_file_a_shipped_config_names_is_in_the_repository():
    """The real recipes run from a clone: the files they read lie under data/ (Nave, gzipped)."""
    import yaml

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    configs = [os.path.join(root, "jobs", "recipes", n) for n in os.listdir(os.path.join(root, "jobs", "recipes"))]
    configs += [os.path.join(root, "bench", "configs", n) for n in os.listdir(os.path.join(root, "bench", "configs"))]

    def paths(value):
        if isinstance(value, dict):
            for item in value.values():
                yield from paths(item)
        elif isinstance(value, str) and value.startswith(("data/", "../", "/")):
            yield value

    named = {p: c for c in configs for p in paths(yaml.safe_load(open(c)))}
    assert any(p.startswith("data/nave/") for p in named)
    for path, config in named.items():
        assert path.startswith("data/") and os.path.isfile(os.path.join(root, path)), (config, path)


def test_a_failed_stage_is_run_again_but_a_user_error_is_not(tmp_path, capsys):
    """A stage that dies (a lost node) is run again, up to ``retries`` times, and recorded
    once it succeeds; a user error fails at once, and so does the last allowed failure."""
    from pipeline.core.errors import InputError
    from pipeline.workflows.units import Unit, run_units

    attempts = {"flaky": 0, "bad": 0, "broken": 0}

    def flaky():
        attempts["flaky"] += 1
        if attempts["flaky"] < 3:
            raise RuntimeError("ActorDiedError: the node died")
        return {"outputs": {"x": "ok"}}

    def bad():
        attempts["bad"] += 1
        raise InputError("queries.jsonl line 2: malformed JSON")

    def broken():
        attempts["broken"] += 1
        raise RuntimeError("still broken")

    manifest = RunManifest(str(tmp_path), "recipe.json")
    assert run_units(manifest, [Unit("flaky", flaky)], "[t]", retries=2) == ["flaky"]
    assert attempts["flaky"] == 3 and manifest.done("flaky")
    assert capsys.readouterr().err.count("[t] flaky: failed (RuntimeError: ActorDiedError") == 2
    with pytest.raises(InputError):
        run_units(manifest, [Unit("bad", bad)], "[t]", retries=2)
    with pytest.raises(RuntimeError, match="still broken"):
        run_units(manifest, [Unit("broken", broken)], "[t]", retries=1)
    assert (attempts["bad"], attempts["broken"]) == (1, 2)


def test_the_final_export_is_the_best_retriever_stage_or_the_pinned_one(tmp_path, capsys):
    """Distillation made worse than round 2 (as a run at lr 0 or one step would be): the
    recipe's final export is round 2's model, named in its summary and results.md. Pinned
    with --final.stage, it is the pinned stage's; a rerun with the same choice copies
    nothing again, and one whose stage was retrained (new weights in the same folder) copies
    them. Mutation: ``source_version`` dropped from the final's record keeps the old copy."""
    calls = []
    stages = fake_stages(calls)
    mrr = {"round1": 0.30, "round2": 0.40, "distill": 0.35}
    weights = {name: f"{name} weights" for name in mrr}

    def retriever(name, default):
        def run(ctx):
            recorded = default(ctx)
            export = os.path.join(ctx.folder(name), "export")
            os.makedirs(export, exist_ok=True)
            open(os.path.join(export, "model.safetensors"), "w").write(weights[name])
            return recorded | {"outputs": {**recorded["outputs"], "export": export}, "metrics": {"MRR@10": mrr[name]}}

        return run

    for name in mrr:
        stages[name] = retriever(name, stages[name])
    final = tmp_path / "run" / "final"
    summary = run_recipe(cfg_for(tmp_path), stages)
    assert summary["final"]["stage"] == "round2" and summary["final"]["chosen_by"] == "best dev MRR@10"
    assert (final / "model.safetensors").read_text() == "round2 weights"
    results = (tmp_path / "run" / "results.md").read_text()
    assert f"Final retriever: **round 2 (mined negatives)** (best dev MRR@10), in `{final}`." in results

    pinned = cfg_for(tmp_path)
    pinned.final.stage = "distill"
    assert run_recipe(pinned, stages)["final"]["stage"] == "distill"
    assert (final / "model.safetensors").read_text() == "distill weights"
    capsys.readouterr()
    run_recipe(pinned, stages)
    assert "[recipe] final:" not in capsys.readouterr().err  # the same export: not copied again
    weights["distill"] = "distill weights, retrained"
    pinned.distill.train.lr *= 2  # the stage's identity changed: it runs again, into its folder
    run_recipe(pinned, stages)
    assert (final / "model.safetensors").read_text() == "distill weights, retrained"
    pinned.final.stage = "rerank"
    with pytest.raises(ConfigError, match="--final.stage rerank: not a retriever stage of this recipe"):
        run_recipe(pinned, stages)


def test_the_default_recipe_leaves_distillation_to_be_asked_for():
    """No distillation measured on Nave beats round 2, so teacher and distill run only with
    --distill.enabled (the MS MARCO recipe, the papers' settings, turns it on)."""
    from pipeline.core.config import parse_config
    from pipeline.workflows.recipe import enabled_stages

    assert enabled_stages(RecipeConfig())[-2:] == ["reranker", "rerank"]
    on = parse_config(RecipeConfig, ["--distill.enabled", "true"])
    assert enabled_stages(on)[-2:] == ["teacher", "distill"]
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "recipes", "msmarco.yaml")
    msmarco = parse_config(RecipeConfig, ["--config", recipe])
    assert "distill" in enabled_stages(msmarco)


def test_retriever_pooling_is_the_embedded_toys_own_else_left_to_the_init(tmp_path):
    """The embedded recipe pre-trains the tiny model, whose [CLS] is collapsed: its retriever
    stages pool the mean (the embedded example's own setting). A recipe that pre-trains a
    real model, or starts from a checkpoint, leaves ``auto`` for the trainer to resolve from
    that checkpoint ([CLS] for a Condenser export); an explicit setting is kept."""
    from types import SimpleNamespace

    from pipeline.workflows.recipe import StageContext

    export = str(tmp_path / "run" / "pretrain" / "export")
    manifest = SimpleNamespace(record=lambda stage: {"outputs": {"export": export}})
    embedded = StageContext(cfg_for(tmp_path), manifest)
    assert embedded.cfg.round1.retriever.pooling == "auto"
    assert embedded.retriever(embedded.cfg.round1.retriever, export).pooling == "mean"
    assert embedded.retriever(replace(embedded.cfg.round1.retriever, pooling="cls"), export).pooling == "cls"
    real = cfg_for(tmp_path)
    real.pretrain.job.model.init = "google-bert/bert-base-uncased"
    assert StageContext(real, manifest).retriever(real.round1.retriever, export).pooling == "auto"
    msmarco = parse_config(
        RecipeConfig,
        ["--config", os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "recipes", "msmarco.yaml")],
    )
    assert StageContext(msmarco, manifest).retriever(msmarco.round1.retriever, export).pooling == "cls"


def test_every_stage_job_built_from_one_recipe_shares_its_sections(tmp_path, monkeypatch):
    """Each stage's job config, built from jobs/recipes/msmarco.yaml as the stages build
    them (nothing run): the sections the stages share are the recipe's own objects (the
    encoder pool and searchers, Ray) or carry its values (the lengths, the query sets, the
    prepared corpus of the encoder's tokenizer), so no stage searches, cuts or reads
    differently from another."""
    from types import SimpleNamespace

    from pipeline.core.sections import Lengths
    from pipeline.retrieval.evaluate import SearchSettings
    from pipeline.retrieval.mine import MiningSettings
    from pipeline.workflows import recipe

    path = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "recipes", "msmarco.yaml")
    cfg = parse_config(
        RecipeConfig,
        [
            "--config",
            path,
            "--output",
            str(tmp_path / "run"),
            "--data.query_max_len",
            "24",
            "--distill.teacher_best",
            "16",
        ],
    )
    outputs = {"export": "s3://b/x/export", "index": "s3://b/x/index", "negatives": "s3://b/x/neg.jsonl"}
    outputs |= {"scores": "s3://b/teacher/run.trec", "run": "s3://b/x/run.trec"}
    ctx = recipe.StageContext(cfg, SimpleNamespace(record=lambda stage: {"outputs": outputs}))
    monkeypatch.setattr(CorpusStore, "docs", lambda store: 8_841_823)  # counted when staged: not here
    init = ctx.encoder_init()
    prepared = ctx.prepared_corpus(init)
    data = cfg.data
    jobs = {
        "round1": recipe._finetune_config(ctx, "round1", cfg.round1, init, "bm25"),
        "round2": recipe._finetune_config(ctx, "round2", cfg.round2, init, "s3://b/mine1/neg.jsonl"),
        "mine": recipe.mine_job(ctx, "mine1", "round1"),
        "reranker": recipe.reranker_job(ctx),
        "teacher": recipe.score_job(ctx, "teacher", "run", data.train, 32, True),
        "rerank": recipe.score_job(ctx, "rerank", "run", data.dev, 100, False),
        "distill": recipe.distill_job(ctx),
        "eval": ctx.evaluation("s3://b/round1/export", "s3://b/round1/eval", init),
    }
    lengths = Lengths.values_of(data)
    for name in ("round1", "round2", "distill"):
        assert Lengths.values_of(jobs[name].data) == lengths, name
    for name in ("mine", "eval"):
        assert Lengths.values_of(jobs[name].encoder) == lengths, name
    # Searching: the evaluation is the recipe's eval section; mining searches with its objects.
    search = SearchSettings.values_of(jobs["eval"])
    assert search == {**SearchSettings.values_of(cfg.eval), "k": ctx.eval_k()}
    for name in ("eval", "mine"):
        assert jobs[name].pool is cfg.eval.pool and jobs[name].searchers is cfg.eval.searchers, name
        assert jobs[name].nprobe == cfg.eval.nprobe and jobs[name].encoder.precision == cfg.eval.precision
    for name in ("teacher", "rerank"):
        assert jobs[name].pool is cfg.reranker.pool, name
    for name in ("round1", "round2", "reranker", "distill"):
        assert jobs[name].ray is cfg.ray, name
        assert jobs[name].corpus.output == prepared and jobs[name].model.init == init, name
    assert jobs["eval"].corpus == prepared  # evaluated on the corpus the trainers prepared
    for name in ("mine", "teacher", "round1", "round2", "reranker", "distill"):
        job = jobs[name] if name in ("mine", "teacher") else jobs[name].data
        assert Queries.values_of(job) == Queries.values_of(data.train), name
    for name in ("eval", "rerank"):
        assert Queries.values_of(jobs[name]) == Queries.values_of(data.dev), name
    assert MiningSettings.values_of(jobs["mine"]) == MiningSettings.values_of(cfg.mine)
    assert jobs["teacher"].text == jobs["rerank"].text == ctx.corpus.text_folder
    # distillation reads the teacher's scores, its negatives from the teacher's best candidates
    assert (jobs["distill"].data.teacher_scores, jobs["distill"].data.teacher_depth) == (outputs["scores"], 16)


def test_changed_evaluation_settings_evaluate_again_and_never_retrain(tmp_path, capsys):
    """A dev evaluation's settings (its k, its dev queries) are no part of what made a model:
    the retriever stages run again over their kept folders (a finished training resumes at
    zero steps, so only the evaluation runs: the stand-ins find their progress whole), no
    stage below them is redone, and the new metrics replace the old. Mutation: the
    evaluation sections back in the stages' identity (as before): round 1, round 2 and the
    distillation start from empty folders, that is, retrain."""
    calls = []
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    whole = [0, 1, 2, 3]

    calls.clear()
    cfg = cfg_for(tmp_path)
    cfg.eval.k = 50
    run_recipe(cfg, fake_stages(calls))
    # BM25's, the zero-shot and the re-ranking stages are evaluations themselves: run afresh.
    assert calls == [
        ("bm25", []),
        ("zeroshot", []),
        ("round1", whole),
        ("mine1", whole),
        ("round2", whole),
        ("mine2", whole),
        ("rerank", []),
        ("distill", whole),
    ]
    printed = capsys.readouterr().out
    assert "stage round1: its evaluation settings changed (eval.k: 1000 -> 50): evaluating it again" in printed
    recorded = RunManifest(str(tmp_path / "run"), MANIFEST).data["stages"]
    assert recorded["round1"]["settings"]["eval.k"] == 50

    calls.clear()
    cfg.data.dev = Queries(queries=cfg.data.train.queries, qrels=cfg.data.train.qrels)
    run_recipe(cfg, fake_stages(calls))
    assert [stage for stage, progress in calls if progress != whole] == ["bm25", "zeroshot", "rerank"]
    assert "reranker" in [stage for stage, _ in calls]  # recorded with its dev queries once: run over its folder

    calls.clear()
    cfg.round1.train.lr = 3e-4  # what makes a model still retrains it, and what reads it
    run_recipe(cfg, fake_stages(calls))
    assert ("round1", []) in calls and ("round2", []) in calls


def test_a_run_recorded_before_the_evaluation_split_is_still_current(tmp_path):
    """Runs recorded before each stage's evaluation settings were set apart took an upstream
    stage's fingerprint over all its settings: those fingerprints still count as unchanged,
    so a finished run of an older raydense resumes with nothing to redo. Mutation: without
    ``legacy_after``, every stage below the first rerun."""
    from pipeline.workflows.recipe import recipe_units
    from pipeline.workflows.units import settings_of

    run_recipe(cfg_for(tmp_path), fake_stages([]))
    manifest = RunManifest(str(tmp_path / "run"), MANIFEST)
    for stage, now in settings_of(recipe_units(cfg_for(tmp_path), manifest)).items():
        record = manifest.data["stages"][stage]
        record["settings"].update(now.legacy_after)  # what an older raydense recorded
        manifest.save(stage, record)
    calls = []
    run_recipe(cfg_for(tmp_path), fake_stages(calls))
    assert calls == []


def test_bm25_switched_off_runs_neither_bm25_stage_and_round1_trains_on_the_zero_shot_negatives(tmp_path, monkeypatch):
    """--bm25.enabled false drops the BM25 row; --mine.bm25_negatives false mines round 1's
    negatives in the zero-shot index (mine0, its queries encoded as the zero-shot
    evaluation's were) and round 1 trains on them, its row named so. The defaults keep
    round 1's recorded settings (a finished run still matches). Mutation: round 1 given
    "bm25" whatever the switch trains on BM25's negatives."""
    from pipeline.workflows import recipe
    from pipeline.workflows.recipe import RECIPE, StageContext, mine_job, stage_round1
    from pipeline.workflows.units import unit_settings

    cfg = cfg_for(tmp_path)
    cfg.bm25.enabled, cfg.mine.bm25_negatives = False, False
    calls = []
    run_recipe(cfg, fake_stages(calls))
    assert [c[0] for c in calls] == [s for s in ALL_STAGES if s != "bm25"]
    assert ALL_STAGES.index("zeroshot") < ALL_STAGES.index("mine0") < ALL_STAGES.index("round1")
    default = cfg_for(tmp_path)
    round1 = next(s for s in RECIPE if s.name == "round1")
    assert round1.sections(default)["bm25"] == [default.mine.bm25_depth, default.mine.bm25_count]
    assert unit_settings(**round1.sections(default)) != unit_settings(**round1.sections(cfg))

    manifest = RunManifest(str(tmp_path / "run"), MANIFEST)
    manifest.save("mine0", {"outputs": {"negatives": "/mined/negatives.jsonl"}})
    manifest.save("zeroshot", {"outputs": {"export": "/init", "index": "/zeroshot/index"}})
    ctx = StageContext(cfg, manifest)
    seen = []
    monkeypatch.setattr(
        recipe, "_retriever_stage", lambda c, s, st, negatives: seen.append(negatives) or {"summary": {}}
    )
    assert stage_round1(ctx)["summary"]["result_label"] == "round 1 (zero-shot negatives)"
    assert seen == ["/mined/negatives.jsonl"]
    job = mine_job(ctx, "mine0", "zeroshot", pooling="mean", similarity="cos")
    assert (job.index, job.encoder.model, job.encoder.pooling, job.encoder.similarity) == (
        "/zeroshot/index",
        "/init",
        "mean",
        "cos",
    )


def test_a_student_started_from_round2_takes_its_export_and_the_encoders_prepared_corpus(tmp_path, monkeypatch):
    """``--distill.init round2``: the student's checkpoint is round 2's recorded export, and
    it reads the corpus prepared with the retrievers' tokenizer (which round 2 kept), so the
    corpus is not prepared again. Mutation: ``distill_init`` returning the export as the
    tokenizer too: a second preparation folder, and this fails."""
    from types import SimpleNamespace

    from pipeline.workflows import recipe

    cfg = parse_config(RecipeConfig, ["--output", str(tmp_path / "run"), "--distill.init", "round2"])
    exports = {
        stage: {"outputs": {"export": f"s3://b/{stage}/export", "scores": "s3://b/t/run.trec"}} for stage in ALL_STAGES
    }
    ctx = recipe.StageContext(cfg, SimpleNamespace(record=lambda stage: exports[stage]))
    job = recipe.distill_job(ctx)
    assert job.model.init == "s3://b/round2/export"
    assert job.corpus.output == ctx.prepared_corpus(ctx.encoder_init())
    assert job.corpus.tokenizer == ctx.encoder_init() == "s3://b/pretrain/export"
    assert (
        recipe.distill_job(recipe.StageContext(cfg_for(tmp_path), ctx.manifest)).model.init == "s3://b/pretrain/export"
    )


def test_a_student_from_round2_needs_round2s_shared_encoder():
    two_towers = parse_config(RecipeConfig, ["--distill.init", "round2", "--round2.retriever.shared_encoder", "false"])
    with pytest.raises(ConfigError, match="--distill.init round2 starts the student from round 2's export"):
        two_towers.check_inputs("--")


def test_a_student_built_from_a_retriever_export_starts_with_its_weights(tmp_path):
    """What ``init: round2`` trains from: the fine-tuning objective's model built from a
    retriever export (as ``GroupTask.build_model`` builds it) holds the export's weights,
    bit for bit, not the checkpoint round 2 started from (moved by 0.01 here)."""
    import torch
    from conftest import synthetic_docs
    from safetensors.torch import load_file

    from models.biencoder import BiEncoderConfig, ContrastiveObjective
    from tests.helpers import save_tiny_bert

    init = save_tiny_bert(str(tmp_path / "bert"), [d["text"] for d in synthetic_docs(20)])
    objective = ContrastiveObjective(BiEncoderConfig(pooling="cls"))
    trained = objective.build(init)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)  # round 2's training, in short
    objective.export(trained, str(tmp_path / "round2"), init)
    student = ContrastiveObjective(BiEncoderConfig(pooling="cls")).build(str(tmp_path / "round2"))
    saved = load_file(str(tmp_path / "round2" / "model.safetensors"))
    state = student.state_dict()
    assert saved and all(torch.equal(state[f"query_encoder.{k}"], v) for k, v in saved.items())


def test_distillations_new_settings_at_their_defaults_keep_a_finished_runs_record(tmp_path):
    """The teacher's mixed draw, its cleaning margin and the listwise loss, left at their
    defaults, give the distillation stage the settings a run recorded before they existed (a
    finished distillation is reused); set, each changes them. Mutation: the stage's section
    passed whole (``stage=c.distill``): the defaults differ from the record."""
    from pipeline.workflows.recipe import RECIPE
    from pipeline.workflows.units import unit_settings

    distill = next(s for s in RECIPE if s.name == "distill")
    cfg = cfg_for(tmp_path)
    now = unit_settings(**distill.sections(cfg))
    before = {
        k: v
        for k, v in now.items()
        if k not in ("stage.teacher_deep", "stage.teacher_margin", "stage.loss.teacher_loss")
    }
    assert now == before  # what a run recorded before the three settings
    for name, value in (("teacher_deep", 4), ("teacher_margin", 0.5)):
        changed = cfg_for(tmp_path)
        setattr(changed.distill, name, value)
        assert unit_settings(**distill.sections(changed))[f"stage.{name}"] == value
    listwise = cfg_for(tmp_path)
    listwise.distill.loss.teacher_loss = "listmle"
    assert unit_settings(**distill.sections(listwise))["stage.loss.teacher_loss"] == "listmle"
