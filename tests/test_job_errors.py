"""A user's mistake, tried as a new user would from the command line: one clear line that
names the bad value, exit code 2, no traceback (RAYDENSE_DEBUG=1 shows it; the mechanism,
crashes included: tests/test_config.py). The jobs run in this process, on the tests' Ray."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_each_kind_of_user_error_exits_2_with_one_line_naming_the_value(tmp_path, shared_ray, monkeypatch, capsys):
    bad_queries = tmp_path / "queries.jsonl"
    bad_queries.write_text('{"_id": "q1", "text": "fine"}\n{"_id": "q2", "text": \n')
    corpus = str(REPO / "data" / "bible-sample")
    cases = {
        "config value": (
            ["jobs.bm25_negatives", "--corpus", "c", "--queries", "q", "--qrels", "r", "--depth", "10"],
            "count (30) must not exceed depth (10)",
        ),
        "missing file": (
            ["jobs.bm25_negatives", "--corpus", str(tmp_path / "nowhere.jsonl"), "--queries", "q", "--qrels", "r"],
            f"{tmp_path / 'nowhere.jsonl'}: no such file or directory",
        ),
        "bad reference": (
            ["jobs.encode", "--corpus", corpus, "--encoder.model", str(tmp_path / "no-model")],
            str(tmp_path / "no-model"),
        ),
        "bad input data": (
            ["jobs.bm25_negatives", "--corpus", corpus, "--queries", str(bad_queries), "--qrels", str(bad_queries)],
            "queries.jsonl line 2",
        ),
    }
    monkeypatch.delenv("RAYDENSE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    for kind, (argv, named) in cases.items():
        job = importlib.import_module(argv[0])
        monkeypatch.setattr(sys, "argv", [job.__file__, *argv[1:]])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            job.main()  # as `python jobs/....py ...` runs it: argv from the command line
        out, err = capsys.readouterr()
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert exited.value.code == 2, (kind, err[-2000:])
        assert "Traceback" not in err and len(errors) == 1 and named in errors[0], (kind, err[-2000:])
        assert out == "", kind  # no summary: stdout's last line is a finished job's
