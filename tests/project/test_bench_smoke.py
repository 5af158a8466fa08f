"""Every benchmark in bench/ runs: each script as a command, in its ``--smoke`` mode (tiny
sizes, bench/smoke.py), so that one that no longer runs with today's code fails here, not
when someone next needs its figures. A script added to bench/ is picked up by name; one
without a smoke mode fails (argparse refuses ``--smoke``). Run before a release (``pytest -m
bench_smoke``, README): together about 40 minutes of Ray starts and job processes, past CI's
time; CI's suite checks that each script imports and parses its options
(test_bench_scripts.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.bench_smoke
# The folder's helpers, not benchmarks: the smoke settings, the results files' writer, and the
# README's renderer (whose check is tests/project/test_docs.py).
HELPERS = {"smoke.py", "record.py", "figures.py"}
SCRIPTS = sorted(p.name for p in (REPO / "bench").glob("*.py") if p.name not in HELPERS)


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """``argv`` from the repository root, its temporary files in a folder removed after it:
    a short one, as Ray's socket paths under it have a length limit."""
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        return subprocess.run(
            argv,
            cwd=REPO,
            env={**os.environ, "RAY_AUTH_MODE": "disabled", "TMPDIR": tmp, **env},
            capture_output=True,
            text=True,
            timeout=1200,  # bench_distill's smoke runs the recipe to its teacher: 601 s beside another (cut at 600)
        )


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_runs_in_its_smoke_mode(script, tmp_path):
    """The script exits 0 and writes its results file. Its first run failed on a real rot:
    bench_pretrain.py's plain loop called ``task.loss``, which ``PretrainTask`` no longer
    has (AttributeError); so would the ``prepare_corpus(parallelism=...)`` it once called."""
    results = tmp_path / "results.json"
    done = run([sys.executable, f"bench/{script}", "--smoke", "--json", str(results)])
    assert done.returncode == 0, f"{script} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
    figures = json.loads(results.read_text())
    assert figures, "an empty results file"


def test_the_gpu_lease_script_runs_its_smoke_steps(tmp_path):
    """bench/gpu_lease.sh with SMOKE=1 runs its commands at tiny sizes on this CPU: the
    quickest step, through the script's own step runner, exits 0."""
    done = run(["bash", "bench/gpu_lease.sh"], SMOKE="1", STEPS="gradcache", OUT=str(tmp_path), PY=sys.executable)
    log = (tmp_path / "all.log").read_text()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "== gradcache rc=0" in log, log[-4000:]
    assert json.loads((tmp_path / "gradcache.json").read_text())
