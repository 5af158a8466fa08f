"""A user's mistake, tried as a new user would from the command line: one clear line that
names the bad value, exit code 2, no traceback (RAYDENSE_DEBUG=1 shows it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_each_kind_of_user_error_exits_2_with_one_line_naming_the_value(tmp_path):
    bad_queries = tmp_path / "queries.jsonl"
    bad_queries.write_text('{"_id": "q1", "text": "fine"}\n{"_id": "q2", "text": \n')
    corpus = REPO / "data" / "bible-sample"
    cases = {
        "config value": (
            ["jobs/bm25_negatives.py", "--corpus", "c", "--queries", "q", "--qrels", "r", "--depth", "10"],
            "count (30) must not exceed depth (10)",
        ),
        "missing file": (
            ["jobs/bm25_negatives.py", "--corpus", str(tmp_path / "nowhere.jsonl"), "--queries", "q", "--qrels", "r"],
            f"{tmp_path / 'nowhere.jsonl'}: no such file or directory",
        ),
        "bad reference": (
            ["jobs/encode.py", "--corpus", str(corpus), "--encoder.model", str(tmp_path / "no-model")],
            str(tmp_path / "no-model"),
        ),
        "bad input data": (
            [
                "jobs/bm25_negatives.py",
                "--corpus",
                str(corpus),
                "--queries",
                str(bad_queries),
                "--qrels",
                str(bad_queries),
            ],
            "queries.jsonl line 2",
        ),
    }
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAYDENSE_DEBUG": "0"}
    runs = {
        kind: subprocess.Popen(
            [sys.executable, str(REPO / argv[0]), *argv[1:], "--ray.num_cpus", "1"],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kind, (argv, _) in cases.items()
    }
    for kind, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        argv, named = cases[kind]
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2, (kind, err[-2000:])
        assert "Traceback" not in err and len(errors) == 1 and named in errors[0], (kind, err[-2000:])
        assert out == "", kind  # no summary: stdout's last line is a finished job's
