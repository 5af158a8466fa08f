"""Every benchmark in bench/ still imports and parses its options, checked in the suite in one
process (~10 s): a benchmark that imports a name the library no longer has, or whose options
no longer build, fails here on every CI run. Running each at tiny sizes (``--smoke``) takes
about 40 minutes of Ray and job start-ups, past CI's time; that is
tests/project/test_bench_smoke.py, run before a release (README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELPERS = {"smoke.py", "record.py", "figures.py"}  # as test_bench_smoke.py: not benchmarks

# Runs each script as __main__ with --help: argparse prints its options (--smoke among them,
# which bench/smoke.py adds) and exits 0 before any work.
PROBE = r"""
import contextlib, io, json, runpy, sys
failed = {}
for script in sys.argv[1:]:
    sys.argv, out = [script, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        failed[script] = "did work on --help instead of printing its options"
    except SystemExit as stop:
        if stop.code not in (0, None) or "--smoke" not in out.getvalue():
            failed[script] = f"--help exited {stop.code}, options: {out.getvalue()[-300:]!r}"
    except Exception as exc:
        failed[script] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def test_every_benchmark_imports_and_prints_its_options_with_smoke_among_them():
    """Mutation: rehearse_scale.py importing ``random_encoders`` (a renamed helper) from
    bench_mining_scale fails here with its ImportError."""
    scripts = sorted(str(p) for p in (REPO / "bench").glob("*.py") if p.name not in HELPERS)
    assert len(scripts) >= 20
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *scripts],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "bench") + os.pathsep + str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {}
