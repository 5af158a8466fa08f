"""The training loop's metric sinks (pipeline/training/tracking.py) with every tracker, each
read back with its own library: TensorBoard's event reader, W&B offline files, an MLflow
file store. (The loop's use of them on Ray Train: tests/training/test_pretrain_ray.py.)"""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

from pipeline.training.tracking import RunLog

ENTRIES = [{"step": s, "loss": 5.0 / s, "lr": 1e-4 * s, "tokens_per_s": 1000.0 + s} for s in (2, 4, 6)]
HPARAMS = {"train": {"lr": 1e-4, "tracker": ["tensorboard"]}, "s3": {"aws_secret_access_key": "hunter2"}}


def written(path: str, last: bytes, seconds: float = 30.0) -> bytes:
    """The bytes of a file that W&B's service process writes, once they hold ``last`` (or
    as they are after ``seconds``, for the assertions to judge): in one CI run the file held
    only its 7-byte header when read right after ``run.finish()`` returned."""
    deadline = time.monotonic() + seconds
    while True:
        records = open(path, "rb").read()
        if last in records or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_every_tracker_gets_every_entry_and_the_redacted_config(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "raydense-test")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the issue asks for a file-based store
    output = str(tmp_path / "run")
    history: list[dict] = []
    run_log = RunLog(output, ["tensorboard", "wandb", "mlflow"], HPARAMS, history)
    for entry in ENTRIES:
        history.append(entry)
        run_log.log(entry)
        # history.json is there as the run goes, not only at its end
        assert json.load(open(os.path.join(output, "history.json"))) == history
    (wandb_run,) = [t.run for t in run_log.trackers if hasattr(t, "wandb")]
    run_log.close()

    events = EventAccumulator(os.path.join(output, "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [e["step"] for e in ENTRIES]
    assert [e.value for e in scalars] == pytest.approx([e["loss"] for e in ENTRIES])

    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("raydense-test").experiment_id])
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [e["step"] for e in ENTRIES]
    assert [m.value for m in losses] == pytest.approx([e["loss"] for e in ENTRIES])
    assert run.data.params["train.lr"] == "0.0001" and run.data.params["s3.aws_secret_access_key"] == "***"

    # W&B offline: the run file it would sync holds every step's loss and the redacted config,
    # never the secret. (This wandb has no public reader for offline files: bytes are searched.)
    (offline,) = glob.glob(str(tmp_path / "wandb" / "**" / "offline-run-*" / "run-*.wandb"), recursive=True)
    records = written(offline, json.dumps(ENTRIES[-1]["loss"]).encode())
    assert b"hunter2" not in records and b"aws_secret_access_key" in records
    assert all(json.dumps(e["loss"]).encode() in records for e in ENTRIES)  # history values, as JSON
    assert wandb_run.config["s3"]["aws_secret_access_key"] == "***" and wandb_run.config["train"]["lr"] == 1e-4
