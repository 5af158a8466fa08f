"""`ray job submit --working-dir . -- python jobs/pretrain.py` against a local head.

The head runs with `--block` in its own temp dir, so the test stops exactly the Ray it
started (never `ray stop`, which would kill every Ray process of the user).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    env = dict(os.environ, RAY_AUTH_MODE="disabled",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    dashboard = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rdh-", dir="/tmp")  # short: Ray's socket paths have a length limit
    log = open(os.path.join(temp_dir, "head.log"), "w")
    head = subprocess.Popen(
        [shutil.which("ray", path=env["PATH"]), "start", "--head", "--block", f"--port={free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=4",
         f"--temp-dir={temp_dir}", "--include-dashboard=true",
         # Fresh ports for the head's agents: the suite's in-process Ray may already hold
         # the default ones, and then this head's job agent never comes up.
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--ray-client-server-port={free_port()}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.time() + 120
    while time.time() < deadline:
        probe = subprocess.run(["ray", "job", "list", "--address", address], env=env, capture_output=True)
        if probe.returncode == 0:
            break
        assert head.poll() is None, open(os.path.join(temp_dir, "head.log")).read()
        time.sleep(1)
    else:
        pytest.fail("the Ray head did not come up")
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    log.close()
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_submitted_pretrain_job_succeeds_and_prints_its_summary(ray_head, tmp_path):
    address, env = ray_head
    out = tmp_path / "run"
    submit = [
        "ray", "job", "submit", "--address", address, "--working-dir", str(REPO),
        "--runtime-env-json", json.dumps({"excludes": ["runs/", ".git/", ".venv/", "*.egg-info/", "__pycache__/"]}),
        "--", "python", "jobs/pretrain.py",
        "--corpus.output", str(tmp_path / "corpus"), "--corpus.vocab_size", "2000",
        "--train.output", str(out), "--train.max_steps", "6", "--train.log_every", "2",
        "--train.checkpoint_every", "3", "--train.micro_batch_size", "8",
        "--model.hidden_size", "32", "--model.num_layers", "2", "--model.num_heads", "2",
        "--model.intermediate_size", "64", "--data.max_len", "64",
    ]
    deadline = time.time() + 120
    while True:
        done = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        output = done.stdout + done.stderr
        # The head's job agent can come up after its dashboard answers (seen on a loaded
        # machine): the submission is refused, not started, so trying again is safe.
        if "No available agent to submit job" not in output or time.time() > deadline:
            break
        time.sleep(2)
    assert done.returncode == 0, output[-4000:]
    assert "succeeded" in output, output[-4000:]
    summaries = []
    for line in done.stdout.splitlines():
        try:
            obj = json.loads(line.strip())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("job") == "pretrain":
            summaries.append(obj)
    assert summaries, output[-4000:]
    summary = summaries[-1]
    assert summary["steps"] == 6
    assert summary["export_dir"] == str(out / "export")
    assert (out / "export" / "config.json").exists() and (out / "loss_curve.png").exists()
