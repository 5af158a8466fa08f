"""Ray clusters that tests start for themselves: a head, and worker nodes that share no
filesystem with it, all on this machine.

Every process runs in its own session with ``--block``, so a test stops exactly the Ray it
started (never ``ray stop``, which would kill every Ray process of the user).
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
# What a job's working directory leaves behind (runs, the venv, VCS, caches).
WORKING_DIR_EXCLUDES = ["runs/", ".git/", ".venv/", "*.egg-info/", "__pycache__/", "build/"]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all held open while they are chosen (one at a time, the
    kernel handed the same port out twice, and a head failed on its own port clash)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def ray_env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ, RAY_AUTH_MODE="disabled", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


@dataclass
class Head:
    process: subprocess.Popen
    gcs_address: str  # what `ray start --address` joins
    job_address: str  # the dashboard, where `ray job submit` goes
    temp_dir: str
    env: dict[str, str]


def start_head(num_cpus: int, env: dict[str, str], extra_args: tuple[str, ...] = ()) -> Head:
    """A head node in its own session; ``extra_args`` go to ``ray start`` (an autoscaler)."""
    temp_dir = tempfile.mkdtemp(prefix="rdh-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port, dashboard, agent, agent_grpc, metrics, runtime_env, client = free_ports(7)
    log = open(os.path.join(temp_dir, "head.log"), "w")
    process = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--num-cpus={num_cpus}",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=true",
            # Fresh ports for the head's agents: the suite's in-process Ray may already hold
            # the default ones, and then this head's job agent never comes up.
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env}",
            f"--ray-client-server-port={client}",
            *extra_args,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    head = Head(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", temp_dir, env)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            probe = subprocess.run(
                [RAY, "job", "list", "--address", head.job_address], env=env, capture_output=True, timeout=60
            )
        except subprocess.TimeoutExpired:  # a dashboard that stopped answering: try again while time is left
            continue
        if probe.returncode == 0:
            return head
        if process.poll() is not None:
            raise RuntimeError(open(os.path.join(temp_dir, "head.log")).read())
        time.sleep(1)
    stop(process)
    raise RuntimeError("the Ray head did not come up")


def stop(process: subprocess.Popen, grace_s: float = 8) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s`` (a graceful Ray shutdown took
    ~30 s in CI; a test's own Ray may be killed once what it needs has been read)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def start_isolated_worker(
    head: Head, num_cpus: int, hidden: list[str], env: dict[str, str], ray_dir: str
) -> subprocess.Popen:
    """A worker node in its own mount namespace (``unshare -m``, root only), where each
    folder of ``hidden`` is an empty tmpfs: it shares no disk with the head but what it
    installed (the venv and the Python it runs on). A worker node keeps its Ray files under
    the head's temp dir path; there, it sees ``ray_dir`` (a folder of this machine the head
    never looks into), so that a test can read the worker node's logs."""
    venv = sys.prefix
    stage = tempfile.mkdtemp(prefix="rdw-venv-", dir="/var/tmp")  # outside every hidden folder
    lines = ["set -e", "mount --make-rprivate /"]
    covered = [h for h in hidden if os.path.commonpath([venv, h]) == h]
    if covered:  # the venv lives inside a hidden folder (e.g. the checkout): carry it across
        lines.append(f"mount --bind {shlex.quote(venv)} {shlex.quote(stage)}")
    for folder in sorted(hidden, key=len):
        lines.append(f"mkdir -p {shlex.quote(folder)} && mount -t tmpfs tmpfs {shlex.quote(folder)}")
    if covered:
        lines.append(f"mkdir -p {shlex.quote(venv)} && mount --bind {shlex.quote(stage)} {shlex.quote(venv)}")
    lines.append(
        f"mkdir -p {shlex.quote(head.temp_dir)} && mount --bind {shlex.quote(ray_dir)} {shlex.quote(head.temp_dir)}"
    )
    lines.append("cd /")
    lines.append(
        shlex.join(
            [
                RAY,
                "start",
                "--block",
                f"--address={head.gcs_address}",
                f"--num-cpus={num_cpus}",
                "--disable-usage-stats",
            ]
        )
    )
    log = open(os.path.join(ray_dir, "worker-node.log"), "w")
    process = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", "\n".join(lines)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    process.staging_dir = stage  # empty on this side of the mount namespace: removed by cleanup()
    return process


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL every process of the session ``process`` leads (a node that
    :func:`start_isolated_worker` started), as a lost spot instance ends: its raylet, object
    store and every worker process at once. Ray gives each worker process a process group of
    its own, so a node's processes are found by session, not by group. Killed again until
    none is left: a process forked while pkill ran (a worker the raylet was starting) is
    missed by it, and lived on once in CI."""
    session = str(process.pid)
    subprocess.run(["pkill", "-KILL", "-s", session], check=False)
    process.wait()  # the session's leader is this process's child: reaped here, not by init
    deadline = time.time() + 10  # SIGKILLed processes take a moment to exit and be reaped
    while subprocess.run(["pkill", "-KILL", "-s", session], check=False).returncode == 0:
        if time.time() > deadline:
            alive = subprocess.run(["pgrep", "-a", "-s", session], capture_output=True, text=True).stdout
            raise RuntimeError(f"processes of the killed node (session {session}) still alive:\n{alive}")
        time.sleep(0.1)


def installed_source() -> list[str]:
    """Where this venv imports raydense from outside the checkout: the source folder of an
    editable install, or the installed packages' folders."""
    where = subprocess.run(
        [sys.executable, "-c", "import models, pipeline; print(pipeline.__path__[0]); print(models.__path__[0])"],
        capture_output=True,
        text=True,
        cwd="/",
        env=dict(os.environ, PYTHONPATH=""),
    )
    folders = where.stdout.split() if where.returncode == 0 else []
    roots = {os.path.dirname(f) for f in folders}
    # An editable install imports from a checkout: hide all of it; an installed copy sits in
    # site-packages beside torch: hide just its packages.
    return sorted(roots if all((Path(r) / "pyproject.toml").exists() for r in roots) else folders)


def wait_for_nodes(head: Head, count: int, log: str, timeout_s: float = 120) -> None:
    script = "import ray; ray.init(address='auto'); print(sum(n['Alive'] for n in ray.nodes()))"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        # A head that died after it answered (Ray's "node timed out during startup" on an
        # overloaded machine) leaves ray.init retrying forever: fail with its log instead.
        if head.process.poll() is not None:
            raise RuntimeError(f"the head exited: {open(os.path.join(head.temp_dir, 'head.log')).read()[-3000:]}")
        try:
            probe = subprocess.run(
                [sys.executable, "-c", script],
                env=dict(head.env, RAY_ADDRESS=head.gcs_address),
                capture_output=True,
                text=True,
                cwd="/",
                timeout=max(1.0, min(60.0, deadline - time.time())),
            )
        except subprocess.TimeoutExpired:
            continue
        if probe.returncode == 0 and probe.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    tail = Path(log).read_text()[-3000:] if os.path.exists(log) else f"({log} was not written)"
    raise RuntimeError(f"fewer than {count} nodes joined: {tail}")


def submit_job(head: Head, entrypoint: list[str], env_vars: dict[str, str] | None = None, timeout_s: float = 900):
    """``ray job submit --working-dir <repo>``; returns the finished CompletedProcess."""
    runtime_env = {"excludes": WORKING_DIR_EXCLUDES, "env_vars": env_vars or {}}
    submit = [
        RAY,
        "job",
        "submit",
        "--address",
        head.job_address,
        "--working-dir",
        str(REPO),
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        *entrypoint,
    ]
    deadline = time.time() + 120
    while True:
        done = subprocess.run(submit, cwd=REPO, env=head.env, capture_output=True, text=True, timeout=timeout_s)
        # The head's job agent can come up after its dashboard answers (seen on a loaded
        # machine): the submission is refused, not started, so trying again is safe.
        if "No available agent to submit job" not in done.stdout + done.stderr or time.time() > deadline:
            return done
        time.sleep(2)


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


def job_summaries(stdout: str, job: str) -> list[dict]:
    """The JSON summary lines a job printed (its last stdout line is one)."""
    found = []
    for line in stdout.splitlines():
        try:
            obj = json.loads(line.strip())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("job") == job:
            found.append(obj)
    return found


def cleanup(head: Head, *workers: subprocess.Popen) -> None:
    for worker in workers:
        stop(worker)
        with contextlib.suppress(OSError):  # rmdir, never rmtree: it must be empty on this side
            os.rmdir(getattr(worker, "staging_dir", ""))
    stop(head.process)
    shutil.rmtree(head.temp_dir, ignore_errors=True)
