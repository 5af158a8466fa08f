"""Where a training run's metrics go while it runs: the run folder's ``history.json``,
Ray Train (every rank reports; Ray keeps rank 0's), and the trackers the config opts into.

Trackers (``--train.tracker``, several allowed), written by rank 0 only:

- ``tensorboard``: event files under ``<output>/tensorboard`` (on S3: written locally and
  uploaded after every log step);
- ``wandb`` and ``mlflow``: imported only when chosen; their credentials and endpoints come
  from their own environment variables (``WANDB_API_KEY``, ``WANDB_MODE``, ``WANDB_PROJECT``;
  ``WANDB_DIR``; ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``), never from the
  config. Ray passes these variables from the driver to the workers (``RayConfig``).

Each gets the run's config, secrets redacted, as hyper-parameters.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from pipeline.core import storage
from pipeline.core.config import redact


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-4}}`` -> ``{"train.lr": 1e-4}``; lists as strings."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


class _TensorBoard:
    def __init__(self, output: str, hparams: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.destination = storage.join(output, "tensorboard")
        self.remote = storage.is_s3(output)
        self.local = tempfile.mkdtemp(prefix="raydense-tb-") if self.remote else storage.resolve(self.destination).path
        self.writer = SummaryWriter(self.local)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(flatten(hparams).items())))

    def log(self, entry: dict, step: int) -> None:
        for key, value in entry.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.flush()
        if self.remote:
            storage.upload_dir(self.local, self.destination)

    def close(self) -> None:
        self.writer.close()
        if self.remote:
            storage.upload_dir(self.local, self.destination)


class _Wandb:
    def __init__(self, output: str, hparams: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "raydense"),
            name=os.path.basename(output.rstrip("/")),
            config=hparams,
            # Its local files (the whole run in offline mode): WANDB_DIR, else a temporary folder,
            # not the worker's working directory.
            dir=os.environ.get("WANDB_DIR") or tempfile.mkdtemp(prefix="raydense-wandb-"),
            resume="allow",
        )

    def log(self, entry: dict, step: int) -> None:
        self.run.log({k: v for k, v in entry.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, output: str, hparams: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "raydense"))
        self.run = mlflow.start_run(run_name=os.path.basename(output.rstrip("/")))
        params = flatten(hparams)
        mlflow.log_params({k: ("" if v is None else v) for k, v in params.items()})

    def log(self, entry: dict, step: int) -> None:
        numbers = {k: float(v) for k, v in entry.items() if k != "step" and isinstance(v, (int, float))}
        self.mlflow.log_metrics(numbers, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_OPEN = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}


class RunLog:
    """Rank 0's sink for the loop's log entries: ``history.json`` rewritten as it grows (the
    same file the run leaves at its end) and every chosen tracker."""

    def __init__(self, output: str, trackers: list[str], hparams: dict, history: list[dict]):
        self.history_uri = storage.join(output, "history.json")
        self.history = history
        self.trackers = [_OPEN[name](output, redact(hparams)) for name in trackers]

    def log(self, entry: dict) -> None:
        storage.write_json(self.history_uri, self.history)
        for tracker in self.trackers:
            tracker.log(entry, entry["step"])

    def close(self) -> None:
        storage.write_json(self.history_uri, self.history)
        for tracker in self.trackers:
            tracker.close()
