"""One driver per run (pipeline/core/lease.py): a second driver on a live lease is refused
naming the first, a stale lease is taken over, --force takes a live one; locally and on S3
(conditional writes), a busy S3 included. And a job's process as a user meets it: refused
with exit 2 before any work, and stopped by SIGTERM as by Ctrl-C (exit 143)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from pipeline.core import storage
from pipeline.core.errors import LeaseHeld
from pipeline.core.lease import LEASE, DriverLease, lease_uri
from tests.faulty_s3 import FaultPlan, FaultyS3
from tests.helpers import stopped_by_sigterm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path, s3_endpoint, s3_bucket):
    return str(tmp_path / "run") if request.param == "local" else f"s3://{s3_bucket}/run"


def test_a_second_driver_is_refused_naming_the_first(output):
    """Mutation: ``create`` that overwrites (no If-None-Match / O_EXCL) lets both in."""
    first = DriverLease(output)
    assert first.acquire() == ""
    try:
        with pytest.raises(LeaseHeld, match=rf"another driver is running this run: pid {os.getpid()} on .*--force"):
            DriverLease(output).acquire()
        assert storage.exists(storage.join(storage.resolve(output).uri, LEASE))
    finally:
        first.release()
    assert not storage.exists(storage.join(storage.resolve(output).uri, LEASE))
    again = DriverLease(output)
    assert again.acquire() == ""  # a released lease is free
    again.release()


def test_a_stale_lease_is_taken_over_saying_so_and_its_holder_learns_it(output, monkeypatch):
    monkeypatch.setenv("RAYDENSE_LEASE_HEARTBEAT_S", "3600")  # the first never renews: it looks dead
    monkeypatch.setenv("RAYDENSE_LEASE_STALE_S", "1")
    first = DriverLease(output)
    first.acquire()
    time.sleep(1.5)
    second = DriverLease(output)
    note = second.acquire()
    assert "took the run over" in note and "past RAYDENSE_LEASE_STALE_S" in note
    assert not first.renew() and first.lost_to is not None and first.lost_to.token == second.holder.token
    first.release()  # leaves the new holder's lease alone
    assert second.renew()
    second.release()


def test_force_takes_a_live_lease(output, monkeypatch):
    monkeypatch.setenv("RAYDENSE_LEASE_HEARTBEAT_S", "3600")
    first = DriverLease(output)
    first.acquire()
    with pytest.raises(LeaseHeld):
        DriverLease(output).acquire()
    forced = DriverLease(output, force=True)
    assert "--force" in forced.acquire()
    assert not first.renew()
    forced.release()
    first.release()


def test_the_lease_holds_on_a_busy_s3(s3_endpoint, s3_bucket, monkeypatch):
    """Resets after the write landed: a create whose answer was lost is found to be ours (its
    token), not refused as another driver's. Mutation: without the token check, a driver
    refuses its own run."""
    proxy = FaultyS3(s3_endpoint, FaultPlan(error_rate=0.2, reset_rate=0.25, seed=3)).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("RAYDENSE_LEASE_HEARTBEAT_S", "3600")
    try:
        for attempt in range(8):
            lease = DriverLease(f"s3://{s3_bucket}/busy-{attempt}")
            lease.acquire()
            with pytest.raises(LeaseHeld):
                DriverLease(f"s3://{s3_bucket}/busy-{attempt}").acquire()
            assert lease.renew()
            lease.release()
        assert proxy.counts.resets > 0
    finally:
        proxy.stop()


def test_a_file_output_has_its_lease_beside_it():
    assert lease_uri("s3://b/runs/bm25/negatives.jsonl") == "s3://b/runs/bm25/negatives.jsonl.driver.lease.json"
    assert lease_uri("s3://b/runs/recipe") == "s3://b/runs/recipe/driver.lease.json"


# A job as small as one can be: the real entry (run_job), a Ray section (so Ray's own
# signal handlers are in place, as in every job), a run that takes a while.
STUB_JOB = textwrap.dedent(
    """
    import sys, time
    from dataclasses import dataclass, field
    sys.path.insert(0, {root!r})
    from pipeline.core.entry import run_job
    from pipeline.core.runtime import RayConfig

    @dataclass
    class SleepConfig:
        output: str = ""
        seconds: float = 60
        ray: RayConfig = field(default_factory=lambda: RayConfig(num_cpus=1))

    def run(cfg):
        print("working", flush=True)
        time.sleep(cfg.seconds)
        return {{"slept": cfg.seconds}}

    run_job(SleepConfig, run, "a job that sleeps")
    """
)


def _start(script, output, *extra):
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(script), "--output", output, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for(process, word: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if word in line:
            return
        if process.poll() is not None:
            raise AssertionError(f"the job ended ({process.returncode}): {process.stderr.read()[-2000:]}")
    raise AssertionError(f"no {word!r} within {limit_s} s")


@pytest.mark.ray
def test_a_second_job_on_a_running_output_exits_2_and_sigterm_stops_the_first_like_ctrl_c(tmp_path):
    """The second driver is refused before any work (exit 2, one line naming the first, no
    Ray started); SIGTERM ends the first as Ctrl-C does: exit 143, the resume hint, no native
    stack dump (Ray's handler printed ``*** SIGTERM received`` and exited 134). Mutations:
    no lease in run_job (the second runs); no SIGTERM handler after Ray starts (exit 134)."""
    script = tmp_path / "sleep_job.py"
    script.write_text(STUB_JOB.format(root=ROOT))
    output = str(tmp_path / "run")
    first = _start(script, output)
    try:
        _wait_for(first, "working")
        second = _start(script, output, "--seconds", "0")
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and f"pid {first.pid}" in lines[0], err
        assert "Traceback" not in err and "working" not in out
        err = stopped_by_sigterm(first, timeout_s=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert "Traceback" not in err
    assert not os.path.exists(os.path.join(output, LEASE))  # released on the way out


def test_a_lease_deleted_under_its_driver_is_taken_again_not_lost(output):
    """A job that clears its own output folder (an overwrite) deletes the lease with it: the
    next heartbeat writes it again. Mutation: counting a missing lease as lost stopped the
    job (as Ctrl-C) at its next heartbeat."""
    lease = DriverLease(output)
    lease.acquire()
    storage.delete_file(lease.uri)
    assert lease.renew() and lease.lost_to is None
    assert storage.exists(lease.uri)
    with pytest.raises(LeaseHeld):
        DriverLease(output).acquire()
    lease.release()
