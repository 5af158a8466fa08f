"""`ray job submit --working-dir . -- python jobs/pretrain.py` against a local head.

The head runs with `--block` in its own temp dir, so the test stops exactly the Ray it
started (never `ray stop`, which would kill every Ray process of the user). The same run
checks that credentials in the job's environment end up in none of its outputs or logs.
"""

from __future__ import annotations

import json
import os
import shlex
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
    env = dict(
        os.environ, RAY_AUTH_MODE="disabled", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    env.pop("RAY_ADDRESS", None)
    dashboard = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rdh-", dir="/tmp")  # short: Ray's socket paths have a length limit
    log = open(os.path.join(temp_dir, "head.log"), "w")
    head = subprocess.Popen(
        [
            shutil.which("ray", path=env["PATH"]),
            "start",
            "--head",
            "--block",
            f"--port={free_port()}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            "--num-cpus=4",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=true",
            # Fresh ports for the head's agents: the suite's in-process Ray may already hold
            # the default ones, and then this head's job agent never comes up.
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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
    yield address, env, temp_dir
    os.killpg(head.pid, signal.SIGTERM)
    try:
        # A graceful head shutdown took ~30 s in CI; the whole group (this test's own head,
        # its own temp dir) may be killed once the job's logs have been read.
        head.wait(timeout=8)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    log.close()
    shutil.rmtree(temp_dir, ignore_errors=True)


# Distinctive fake credentials: shaped like real ones, so that code which special-cases
# AWS keys treats them as such, and found by a plain byte search wherever they are copied.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIARAYDENSEFAKE7Q2Z",
    "AWS_SECRET_ACCESS_KEY": "raydenseFAKEsecret/k9Xq2+Wm4Lp8Rt6Vb3Nc7Yh1Jd5Gs0Fa",
    "AWS_SESSION_TOKEN": "raydenseFAKEsessionToken//8vN3kQ1xZ7mB4cL9pW2sD6gH0jT5yR",
}


def files_containing(paths, secrets) -> dict[str, list[str]]:
    """Every file under ``paths`` whose bytes hold one of ``secrets``, with the secrets'
    names. Binary files (checkpoints, pickles, PNGs) are searched too."""
    needles = {name: value.encode() for name, value in secrets.items()}
    found = {}
    for root in paths:
        for path in [Path(root)] if Path(root).is_file() else Path(root).rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                hits = [name for name, needle in needles.items() if needle in data]
                if hits:
                    found[str(path)] = hits
    return found


def test_submitted_pretrain_job_succeeds_and_prints_its_summary(ray_head, tmp_path):
    address, env, ray_temp_dir = ray_head
    out = tmp_path / "run"
    pretrain = [
        "python",
        "jobs/pretrain.py",
        "--corpus.output",
        str(tmp_path / "corpus"),
        "--corpus.vocab_size",
        "2000",
        "--train.output",
        str(out),
        "--train.max_steps",
        "6",
        "--train.log_every",
        "2",
        "--train.checkpoint_every",
        "3",
        "--train.micro_batch_size",
        "8",
        "--model.hidden_size",
        "32",
        "--model.num_layers",
        "2",
        "--model.num_heads",
        "2",
        "--model.intermediate_size",
        "64",
        "--data.max_len",
        "64",
    ]
    # The job gets the credentials as a cluster job would get keys for an S3-compatible
    # store; the entrypoint refuses to start without them, so the scan below cannot pass
    # because they never arrived.
    present = " && ".join(f'test -n "${name}"' for name in FAKE_CREDENTIALS)
    runtime_env = {
        "excludes": ["runs/", ".git/", ".venv/", "*.egg-info/", "__pycache__/"],
        "env_vars": FAKE_CREDENTIALS,
    }
    submit = [
        "ray",
        "job",
        "submit",
        "--address",
        address,
        "--working-dir",
        str(REPO),
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        "sh",
        "-c",
        f"{present} && exec {shlex.join(pretrain)}",
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

    # No credential in anything the run wrote or logged: the run folder (config.yaml,
    # summary, history, checkpoints with DeepSpeed state and trainer state, export), the
    # prepared corpus, the job's logs as `ray job submit` streamed them, and the log files
    # of the job's driver and of every worker process (the Ray Train workers among them).
    for name in (
        "config.yaml",
        "summary.json",
        "history.json",
        "checkpoints/data_position.json",
        "checkpoints/checkpoint_000000006/trainer_state.json",
    ):
        assert (out / name).is_file(), name
    logs = Path(ray_temp_dir) / "session_latest" / "logs"
    process_logs = sorted(logs.glob("job-driver-*")) + sorted(logs.glob("worker-*"))
    assert any(b'"step": 6' in p.read_bytes() for p in process_logs), (
        "the training log lines are not among the scanned logs"
    )
    job_output = tmp_path / "job-output.txt"
    job_output.write_text(output)
    leaks = files_containing([tmp_path, *process_logs], FAKE_CREDENTIALS)
    assert not leaks, leaks
    # The scan itself finds what it looks for, in binary files too.
    canary = tmp_path / "canary" / "state.bin"
    canary.parent.mkdir()
    canary.write_bytes(b"\x00\x80" + FAKE_CREDENTIALS["AWS_SESSION_TOKEN"].encode() + b"\xff")
    assert files_containing([tmp_path], FAKE_CREDENTIALS) == {str(canary): ["AWS_SESSION_TOKEN"]}
