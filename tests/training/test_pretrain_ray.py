"""Pre-training on Ray Train + DeepSpeed: worker failure, re-run resume. (Two ZeRO-2 workers
streaming one epoch from S3, every document once, run in the two-node recipe test.)"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import signal
import threading
import time

import pytest
from conftest import synthetic_docs, write_jsonl

from models.backbone import BackboneConfig
from pipeline.data.position import DataPosition, restorable_checkpoint
from pipeline.data.prepare import PrepareConfig
from pipeline.training.pretrain import PretrainConfig, StreamConfig, run_pretraining
from pipeline.training.train_config import TrainConfig
from tests.helpers import drain_for_preemption, read_trace_entries, rows_in_the_final_model, stopped_by_sigterm
from tests.pace import bound_s

pytestmark = pytest.mark.ray


def tiny_config(corpus_input: str, corpus_out: str, train_out: str, **train) -> PretrainConfig:
    cfg = PretrainConfig()
    cfg.corpus = PrepareConfig(input=corpus_input, output=corpus_out, vocab_size=120, docs_per_shard=30)
    cfg.data = StreamConfig(max_len=32, pack=False)
    cfg.model = BackboneConfig(hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64, max_position=64)
    cfg.train = TrainConfig(
        output=train_out, num_workers=2, zero_stage=2, lr=1e-3, log_every=2, data_trace=True, **train
    )
    return cfg


def _train_worker_pids() -> list[int]:
    """This Ray session's train workers: the RayTrainWorker processes under this session's
    raylet (other Ray sessions on the machine, e.g. another test run, have train workers too;
    the state API would need the dashboard, which the test Ray does not start)."""
    import psutil
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    raylets = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "raylet" in " ".join(p.info["cmdline"] or [])[:200] and session in " ".join(p.info["cmdline"] or [])
    ]
    pids = []
    for raylet in raylets:
        for proc in raylet.children(recursive=True):
            try:
                title = " ".join(proc.cmdline()) + " " + proc.name()
            except psutil.NoSuchProcess:
                continue
            if "RayTrainWorker" in title:
                pids.append(proc.pid)
    return sorted(pids)


@pytest.mark.runs_long  # two Ray Train runs, one losing a worker: 136 s in CI's suite (stop 93)
def test_killed_worker_resumes_from_checkpoint_without_losing_documents(tmp_path, ray_session):
    docs = synthetic_docs(72, seed=5)
    out = str(tmp_path / "run")
    cfg = tiny_config(
        write_jsonl(tmp_path / "raw.jsonl", docs),
        str(tmp_path / "corpus"),
        out,
        micro_batch_size=6,
        max_steps=12,
        epochs=2,  # the stream ends with the 12th step: every row of both epochs, shuffled
        checkpoint_every=3,
        keep_checkpoints=100,
        max_failures=2,
        tracker=["tensorboard"],
        profile_steps=2,
    )
    assert cfg.train.data_trace and cfg.train.grad_accum == 1  # one micro-step per step below
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run_pretraining(cfg)), daemon=True)
    runner.start()
    run_dir = os.path.join(out, "checkpoints")
    deadline = time.time() + bound_s(300)
    while runner.is_alive() and time.time() < deadline:
        if os.path.exists(os.path.join(run_dir, "checkpoint_manager_snapshot.json")) and restorable_checkpoint(run_dir):
            break
        time.sleep(0.2)
    assert restorable_checkpoint(run_dir), (
        f"no checkpoint was registered (the run {'ended' if not runner.is_alive() else 'still runs'})"
    )
    victims = _train_worker_pids()
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)
    runner.join(timeout=bound_s(400))
    assert not runner.is_alive() and result, "the run did not finish after the failure"

    assert result["steps"] == 12 and result["restarts"] == 1
    (resume,) = result["resumes"]
    assert resume["rows_repeated"] == 0 and resume["rows_skipped"] == 0
    # The independent record: every worker logged the rows of each micro-batch it trained
    # on, flushed before each checkpoint (so the killed attempt's log survives up to its last
    # one). The model of the restored checkpoint trained on attempt 0's micro-steps before
    # that checkpoint's step, the resumed attempt on the rest: together they must hold every
    # document of each full epoch exactly once, whatever the data position says.
    restored_step = int(resume["checkpoint"].rsplit("_", 1)[1])
    entries = read_trace_entries(os.path.join(out, "checkpoints"))
    assert sorted(entries) == ["rank0-attempt0", "rank0-attempt1", "rank1-attempt0", "rank1-attempt1"]
    # Each worker's rows are shuffled within its buffer (the default, larger than this
    # corpus), so the order is no help: only the sets are checked.
    trained, before_checkpoint = rows_in_the_final_model(entries, restored_step)
    for epoch in range(2):  # 72 docs / 12 per step = 6 steps an epoch; 12 steps = 2 epochs
        assert sorted(trained[epoch]) == list(range(72)), f"epoch {epoch}: documents lost or repeated"
    assert all(len(set(rows)) == len(rows) for rows in trained.values())
    # In stream order most neighbours are consecutive rows of a shard; shuffled, few are.
    order = [r for _, epoch, rows in entries["rank0-attempt0"] if epoch == 0 for r in rows]
    assert sum(b == a + 1 for a, b in zip(order, order[1:])) < 0.2 * len(order)

    # The loop's own bookkeeping agrees: the restored checkpoint's data position is exactly
    # what the log says attempt 0 trained on before it.
    ckpt_dir = os.path.join(out, "checkpoints", resume["checkpoint"])
    restored = DataPosition()
    for name in os.listdir(ckpt_dir):
        if name.startswith("position_rank"):
            restored = restored.merge(DataPosition.from_json(json.load(open(os.path.join(ckpt_dir, name)))))
    for epoch in sorted(set(before_checkpoint) | set(restored.epochs)):
        assert restored.consumed(epoch).count() == len(before_checkpoint.get(epoch, []))
        assert restored.consumed(epoch).contains(before_checkpoint.get(epoch, [])).all()

    # Live metrics: every log step reached Ray Train (the result holds them, the killed
    # attempt's up to its checkpoint included) and history.json; TensorBoard's own reader
    # finds the same losses (the last value written for a step, as TensorBoard shows it).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = json.load(open(os.path.join(out, "history.json")))
    assert result["logged_steps"] == [e["step"] for e in history] == list(range(2, 13, 2))
    assert all(e["samples_per_s"] > 0 and e["tokens_per_s"] > 0 for e in history)
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged == pytest.approx({e["step"]: e["loss"] for e in history}, rel=1e-6)
    assert "config/text_summary" in events.Tags()["tensors"]  # the run config, as text

    # The profile of the run's last 2 steps, which the resumed attempt trained, by rank 0 only:
    # the operators by their own time, and a trace that Perfetto reads.
    table = open(os.path.join(out, "profile", "rank0.txt")).read()
    assert table.startswith("optimizer steps 11-12: 2 steps in ") and "Self CPU time total" in table
    trace = json.loads(gzip.decompress(open(os.path.join(out, "profile", "rank0.trace.json.gz"), "rb").read()))
    traced = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::linear" in traced
    # The table's operators are the trace's. (Not "aten::linear" by name: its own time is ~0,
    # so its rank among the table's 60 rows is a toss-up; it was left out once, in CI.)
    rows = [line.split()[0] for line in table.splitlines() if line.strip().startswith("aten::")]
    assert rows and set(rows) <= traced
    assert sorted(os.listdir(os.path.join(out, "profile"))) == ["rank0.trace.json.gz", "rank0.txt"]

    # (A finished run rerun with a larger budget continues: tests/training/test_resume.py.)


@pytest.mark.runs_long  # a drained node and a restarted run of 180 steps: 2-3 minutes in the suite
def test_a_preemption_notice_saves_a_checkpoint_the_restarted_run_resumes_from(tmp_path, local_cluster, monkeypatch):
    """The node both workers train on is drained with a 4 s deadline, as the autoscaler
    drains a spot node the cloud takes back, and a fresh node joins. On the notice every
    worker saves a checkpoint at that step (none was due: checkpoint_every is past the run);
    at the deadline Ray Train restarts the workers on the new node, and they resume from the
    notice's checkpoint: no step before it is trained twice, no document lost or repeated.
    With max_failures 0: a preemption is not a failure."""
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.2")  # Ray Train's default: 5 s
    spot = local_cluster.add_node(num_cpus=4)
    docs = synthetic_docs(72, seed=5)
    out = str(tmp_path / "run")
    cfg = tiny_config(
        write_jsonl(tmp_path / "raw.jsonl", docs),
        str(tmp_path / "corpus"),
        out,
        micro_batch_size=6,
        max_steps=180,  # 30 epochs of 6 steps
        checkpoint_every=1000,
        max_failures=0,
        preemption_check_s=0.001,  # asked after every step (any step is longer): seen within a step of the notice
    )
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run_pretraining(cfg)), daemon=True)
    runner.start()
    history, deadline = os.path.join(out, "history.json"), time.time() + bound_s(300)
    while runner.is_alive() and time.time() < deadline:  # rank 0 rewrites it at each log step
        with contextlib.suppress(OSError, ValueError):
            if json.load(open(history))[-1]["step"] >= 10:
                break
        time.sleep(0.1)
    assert runner.is_alive(), result
    drain_for_preemption(local_cluster.address, spot.node_id, deadline_s=4)
    local_cluster.add_node(num_cpus=4)
    runner.join(timeout=bound_s(400))
    assert not runner.is_alive() and result, "the run did not finish after the preemption"

    (notice,) = result["preemptions"]
    step = notice["step"]
    assert 10 <= step < 180 and notice["nodes"] == [spot.node_id] and notice["ranks"] == [0, 1]
    assert 0 < notice["deadline_in_s"] <= 4
    assert (result["steps"], result["restarts"]) == (180, 1)
    (resume,) = result["resumes"]
    assert resume == {
        "checkpoint": f"checkpoint_{step:09d}",
        "step": step,
        "stream_from": f"checkpoint_{step:09d}",
        "rows_repeated": 0,
        "rows_skipped": 0,
    }
    assert result["steps_this_attempt"] == 180 - step  # the steps after the notice, once
    entries = read_trace_entries(os.path.join(out, "checkpoints"))
    assert sorted(entries) == ["rank0-attempt0", "rank0-attempt1", "rank1-attempt0", "rank1-attempt1"]
    trained, _ = rows_in_the_final_model(entries, step)
    assert sorted(trained) == list(range(30))
    for epoch, rows in trained.items():
        assert sorted(rows) == list(range(72)), f"epoch {epoch}: documents lost or repeated"


def test_simlm_without_a_generator_trains_one_first_then_reuses_it(tmp_path, monkeypatch, capsys):
    """`--method simlm` with no --simlm.generator (as on the embedded default): a 2-layer MLM
    is trained on the same corpus and budget into <output>/generator, and the next run reuses
    the finished one. (On Ray Train, both runs on a cluster: tests/workflows/test_two_node.py.)"""
    from pipeline.training import pretrain

    out = str(tmp_path / "run")
    cfg = tiny_config(str(tmp_path / "raw.jsonl"), str(tmp_path / "corpus"), out, max_steps=3)
    cfg.method, cfg.model.init = "simlm", "base-model"
    trained = []

    def fake_pretraining(job):
        trained.append(job)
        export = os.path.join(job.train.output, "export")
        os.makedirs(export)
        open(os.path.join(export, "config.json"), "w").write("{}")
        return {"export_dir": export, "final_loss": 1.0}

    monkeypatch.setattr(pretrain, "run_pretraining", fake_pretraining)
    generator = os.path.join(out, "generator", "export")
    assert pretrain._auto_generator(cfg) == generator
    (job,) = trained
    assert (job.method, job.model.init, job.model.num_layers) == ("mlm", "", 2)
    assert job.model.hidden_size == cfg.model.hidden_size and job.corpus == cfg.corpus
    assert job.train.output == os.path.join(out, "generator") and job.train.max_steps == 3 and job.train.tracker == []
    assert cfg.model.init == "base-model" and cfg.train.output == out  # the SimLM run's own config is untouched
    assert "training a 2-layer MLM generator on the same corpus first" in capsys.readouterr().err
    assert pretrain._auto_generator(cfg) == generator and len(trained) == 1
    assert "reusing the generator trained before" in capsys.readouterr().err


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pretrain_until_sealed(tmp_path, *more: str):
    """``python jobs/pretrain.py`` of 60 steps (a checkpoint every 5; ``more`` options)
    started as a command and left running once its first checkpoint is sealed: (its
    command, run folder, env, process)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    command = [
        *(
            sys.executable,
            "jobs/pretrain.py",
            "--corpus.input",
            write_jsonl(tmp_path / "raw.jsonl", synthetic_docs(72)),
        ),
        *("--corpus.output", str(tmp_path / "corpus"), "--corpus.vocab_size", "120", "--data.max_len", "32"),
        *("--model.hidden_size", "32", "--model.num_layers", "2", "--model.num_heads", "2"),
        *("--model.intermediate_size", "64", "--train.output", str(out), "--train.num_workers", "1"),
        *("--train.micro_batch_size", "6", "--train.max_steps", "60", "--train.checkpoint_every", "5"),
        *more,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYDENSE_DEBUG")}
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + bound_s(240)
    while job.poll() is None and time.time() < deadline:
        if list((out / "checkpoints").glob("checkpoint_*/seal_*.json")):
            break
        time.sleep(0.2)
    assert job.poll() is None, job.communicate()[1][-3000:]
    return command, out, env, job


@pytest.mark.runs_long  # four runs of the job as a command: 2-2.5 minutes
def test_ctrl_c_exits_130_with_the_hint_and_reruns_resume_finish_and_pass_over_a_deleted_checkpoint(tmp_path):
    """`python jobs/pretrain.py` sent SIGINT (Ctrl-C) once its first checkpoint is sealed:
    it exits 130 within seconds, its last stderr line the resume hint, no traceback; the same
    command again resumes from a checkpoint and finishes; once more, it is done: no training
    worker, zero steps this attempt; with its newest checkpoint deleted, it resumes from the
    one before. Mutation: ``trainer.fit()`` on the
    main thread, where Ray Train's own SIGINT handler aborts the run: exit 1, "Received SIGINT.
    Gracefully aborting", no hint."""
    import subprocess

    command, out, env, job = _pretrain_until_sealed(tmp_path)
    repo = REPO
    job.send_signal(signal.SIGINT)
    interrupted = time.time()
    _, err = job.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert job.returncode == 130, err[-3000:]
    assert time.time() - interrupted < 30, "Ctrl-C did not stop the job at once"
    # No traceback of the job's own: Ray's actors forward theirs with a "(Name pid=...)" prefix
    # (Ray Train's placement-group cleaner prints one where another Ray runs on the host).
    own = [line for line in lines if line.startswith("Traceback")]
    assert lines[-1] == "interrupted: rerun the same command to resume" and not own, err[-3000:]

    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    (resume,) = summary["resumes"]
    assert summary["steps"] == 60 and resume["step"] >= 5, summary
    assert summary["steps_this_attempt"] == 60 - resume["step"]

    # Finished: the same command again starts no training worker and says so.
    again = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads(again.stdout.strip().splitlines()[-1])
    assert rerun["steps"] == 60 and rerun["steps_this_attempt"] == 0 and rerun["already_finished"], rerun
    assert rerun["resumed_from"]["step"] == 60 and rerun["resumes"] == summary["resumes"], rerun
    assert "finished at step 60" in again.stderr and "RayTrainWorker" not in again.stderr, again.stderr[-3000:]

    # Its newest checkpoint deleted (by hand, or a storage lifecycle rule): Ray Train's registry
    # still names it, which would stop Ray Train's controller. The rerun says it passed it
    # over, once, and trains the last steps again from the one before.
    newest = max((out / "checkpoints").glob("checkpoint_0*"))
    shutil.rmtree(newest)
    after = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert after.returncode == 0, after.stderr[-3000:]
    resumed = json.loads(after.stdout.strip().splitlines()[-1])
    assert after.stderr.count(f"checkpoint {newest} is gone: passed over") == 1, after.stderr[-3000:]
    assert resumed["steps"] == 60 and resumed["steps_this_attempt"] == 60 - resumed["resumes"][-1]["step"] > 0


@pytest.mark.runs_long  # three runs of the job as a command: about 2 minutes
def test_a_second_driver_is_refused_and_sigterm_stops_the_first_which_then_resumes(tmp_path):
    """The issue's case as a user meets it: a pre-training is running, and the same command is
    started again on the same output. The second exits 2 at once, naming the first, and
    trains nothing; SIGTERM (``ray job stop``, an eviction) ends the first as Ctrl-C does:
    exit 143, the hint, no native stack dump, but first the workers save a checkpoint at
    the step they were at; the rerun resumes from that step and finishes. Mutations: no
    lease (the second resumed the first's live checkpoint and trained beside it); Ray's
    SIGTERM handler left in place (exit 134, a stack dump); no stop request (no checkpoint
    saved after the signal: failed here only when no periodic one falls between the snapshot
    and the stop, as it usually does not)."""
    import subprocess

    command, out, env, job = _pretrain_until_sealed(tmp_path, "--train.preemption_check_s", "0.5")
    repo = REPO
    second = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    refused = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(refused) == 1 and f"pid {job.pid}" in refused[0] and "--force" in refused[0], second.stderr[-3000:]

    def saved() -> list[int]:
        return sorted(int(p.parent.name.split("_")[1]) for p in (out / "checkpoints").glob("checkpoint_*/seal_*.json"))

    before = saved()
    err = stopped_by_sigterm(job)
    after = saved()
    # The stop's own checkpoint is the last; periodic ones (every 5 steps) may come between
    # the snapshot and the moment the workers see the stop (CI saw 15 beside the stop's 17).
    new = sorted(set(after) - set(before))
    assert new and new[-1] == after[-1] > before[-1], (before, after, err[-3000:])
    assert all(step % 5 == 0 for step in new[:-1]), (before, after)
    assert not (out / "checkpoints" / "finished.json").exists()  # stopped, not finished
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    (resume,) = summary["resumes"]
    assert resume["step"] == after[-1], (resume, before, after)
    assert summary["steps"] == 60 and summary["steps_this_attempt"] == 60 - resume["step"]
