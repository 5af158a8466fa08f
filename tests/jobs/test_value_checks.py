"""Every numeric option of every job is checked as it is read, before any work: a value
below what the option can mean is refused at once, naming the option and where the value
came from. Found by sweeping every job's options, not by listing the checked ones: an
option added without its bounds fails here."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from pipeline.core.config import _schema, parse_config
from pipeline.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

# Options whose 0 is an ordinary value that their help need not explain: a count that may
# be none, a seed, ZeRO's stage 0. Any other int option whose help does not say what 0
# means ("0 = ...") must refuse 0.
ZERO_IS_A_VALUE = frozenset(
    {
        "seed",
        "zero_stage",
        "max_failures",
        "retries",
        "restarts",
        "max_retries",
        "skip_top",
        "bm25_count",
        "prefetch_batches",
        "max_steps",  # with epochs set (TrainConfig refuses both 0)
    }
)


def job_configs() -> dict[str, type]:
    """Each job's config class, as its ``run_job`` call names it."""
    configs = {}
    for path in sorted((REPO / "jobs").glob("*.py")):
        call = next(
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "run_job"
        )
        configs[path.stem] = getattr(importlib.import_module(f"jobs.{path.stem}"), call.args[0].id)
    return configs


# What a job needs on its command line before any option of it parses.
REQUIRED = {"analyze": ["--checkpoints", "some/checkpoint"]}


def numeric_options(cls: type) -> dict:
    leaves, _ = _schema(cls)
    return {name: leaf for name, leaf in leaves.items() if leaf.tp in (int, float)}


@pytest.mark.parametrize("job", sorted(job_configs()))
def test_every_numeric_option_refuses_what_it_cannot_mean_as_it_is_read(job):
    """-1 for every numeric option, and 0 for every int option whose help gives 0 no
    meaning (and that is not a count that may be none), are refused by ``parse_config``
    (which runs before ``check_inputs`` and Ray) naming the option. Mutation: the bounds
    check left out of ``config._build`` (the way ``--k 0`` reached Ray and failed after 76 s)
    lets dozens of them through."""
    cls = job_configs()[job]
    parse_config(cls, REQUIRED.get(job, []))  # the job's defaults parse: a refusal below is the value's
    accepted = []
    for name, leaf in numeric_options(cls).items():
        leaf_name = name.rsplit(".", 1)[-1]
        bad = [-1] + ([0] if leaf.tp is int and "0 =" not in leaf.help and leaf_name not in ZERO_IS_A_VALUE else [])
        for value in bad:
            try:
                parse_config(cls, [*REQUIRED.get(job, []), f"--{name}", str(value)])
            except ConfigError as exc:
                # Named: a bound's error names the option; a section's own check its field.
                assert leaf_name in str(exc), (name, str(exc))
                continue
            accepted.append(f"--{name} {value} ({leaf.help[:60]})")
    assert not accepted, f"{job}: accepted without a check: " + "; ".join(accepted)


@pytest.mark.parametrize("job", sorted(job_configs()))
def test_a_value_an_options_help_gives_a_meaning_is_accepted(job):
    """An option whose help says what 0 means ("0 = all") takes 0. Mutation: ``min 1`` on
    ``data.teacher_depth`` (whose 0 is all candidates) refuses the recipe's own distillation
    config, as a first sweep of the bounds did."""
    cls = job_configs()[job]
    refused = []
    for name, leaf in numeric_options(cls).items():
        if "0 =" in leaf.help:
            try:
                parse_config(cls, [*REQUIRED.get(job, []), f"--{name}", "0"])
            except ConfigError as exc:
                if "invalid value for" in str(exc):  # its own bound (not a check across options)
                    refused.append(f"--{name} 0: {exc}")
    assert not refused, f"{job}: " + "; ".join(refused)


@pytest.mark.parametrize("job", sorted(job_configs()))
def test_a_jobs_resolved_config_reads_back(job, tmp_path):
    """What a job records and hands on (its resolved config as YAML, as the recipe writes a
    stage's config for its job) parses again: no default lies outside its own bounds."""
    from pipeline.core.config import dump_yaml

    cls = job_configs()[job]
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(parse_config(cls, REQUIRED.get(job, [])), redact_secrets=False))
    parse_config(cls, ["--config", str(path)])
