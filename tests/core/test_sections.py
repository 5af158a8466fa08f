"""Settings declared once (pipeline/core/sections.py): a job changes a shared option's
default without declaring it again, and the recipe's query sets moved into sections without
breaking the keys users and recorded runs have."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.core.config import parse_config
from pipeline.core.sample import SAMPLE_TRAIN_QRELS, SAMPLE_TRAIN_QUERIES
from pipeline.core.sections import Collection, Output, Queries


def _help(cls, name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def test_with_defaults_changes_defaults_and_keeps_the_help():
    @dataclasses.dataclass
    class Job(
        Output.with_defaults(output="runs/job", notes={"output": "its files"}), Collection.with_defaults(corpus="")
    ):
        depth: int = 10

    job = Job()
    assert (job.output, job.corpus, job.queries, job.depth) == ("runs/job", "", Collection().queries, 10)
    assert _help(Job, "output") == f"{_help(Output, 'output')}; its files"
    assert _help(Job, "corpus") == _help(Collection, "corpus")
    # the shared section's own defaults are untouched, and a job's values pass as the section's
    assert Output().output != "runs/job" and Collection().corpus
    assert Queries.values_of(Job(queries="q.jsonl")) == {"queries": "q.jsonl", "qrels": Collection().qrels}
    with pytest.raises(TypeError, match="no field"):
        Output.with_defaults(outptu="x")


def test_the_recipe_query_sets_are_sections_and_the_old_keys_still_work(tmp_path, capsys):
    from pipeline.workflows.recipe import RecipeConfig
    from pipeline.workflows.units import unit_settings

    cfg = RecipeConfig()
    assert cfg.data.train == Queries(SAMPLE_TRAIN_QUERIES, SAMPLE_TRAIN_QRELS) and cfg.data.dev == Queries()
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  train_queries: t.jsonl\n  dev_qrels: d.tsv\n")
    cfg = parse_config(RecipeConfig, ["--config", str(old), "--data.train_qrels", "t.tsv"])
    assert cfg.data.train == Queries("t.jsonl", "t.tsv") and cfg.data.dev.qrels == "d.tsv"
    notes = capsys.readouterr().err
    assert "note: --data.train_qrels is now --data.train.qrels" in notes
    assert "'data.train_queries' in config file" in notes and "is now 'data.train.queries'" in notes
    # A stage's recorded settings keep the keys runs recorded before the move: an upgraded
    # run's finished stages still match.
    settings = unit_settings(data=cfg.data)
    assert settings["data.train_queries"] == "t.jsonl" and settings["data.dev_qrels"] == "d.tsv"
    assert not any(key.startswith(("data.train.", "data.dev.")) for key in settings)
