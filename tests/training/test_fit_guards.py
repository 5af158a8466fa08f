"""The driver's guards around Ray Train, checked without a Ray Train run (each in a second):
a finished run's rerun starts no trainer, and Ctrl-C never meets Ray Train's own SIGINT
handler. The long checks run both through ``jobs/pretrain.py`` as a command
(tests/training/test_pretrain_ray.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline.core import storage
from pipeline.training import driver
from pipeline.training.train_config import TrainConfig


def test_a_finished_runs_rerun_starts_no_trainer_and_trains_zero_steps(tmp_path, monkeypatch):
    """Mutation: the ``finished_run`` check left out of ``fit`` builds a TorchTrainer here."""
    run_dir = str(tmp_path / "run")
    record = {"checkpoint_dir_name": None, "metrics": {"steps": 6}, "checkpoint": None, "run_dir": run_dir}
    storage.write_json(storage.join(run_dir, driver.FINISHED), {**record, "history": [{"step": 6}]})

    def no_trainer(*args, **kwargs):
        raise AssertionError("a TorchTrainer was built for a finished run")

    monkeypatch.setattr(driver, "TorchTrainer", no_trainer)
    monkeypatch.setattr(driver, "check_placement", lambda train: None)  # no cluster to ask here
    done = driver.fit(TrainConfig(max_steps=6, output=str(tmp_path)), None, [], run_dir)
    assert done.metrics["steps"] == 6 and done.metrics["steps_this_attempt"] == 0


class _BlockingTrainer:
    """Stands in for a TorchTrainer: ``fit`` says which thread it ran on, then blocks as a
    long run does. Ray Train registers its SIGINT handler only on the main thread."""

    def __init__(self):
        self.on_main_thread: bool | None = None

    def fit(self):
        self.on_main_thread = threading.current_thread() is threading.main_thread()
        time.sleep(60)


def test_ctrl_c_during_fit_is_the_jobs_keyboard_interrupt_at_once(monkeypatch):
    """Mutation: ``trainer.fit()`` called on the main thread (where Ray Train's handler would
    turn Ctrl-C into an aborted run, exit 1, no hint): ``on_main_thread`` is True, and the
    interrupt waits for fit."""
    shut = []
    monkeypatch.setattr(driver.ray, "shutdown", lambda: shut.append(True))
    trainer = _BlockingTrainer()
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        driver._fit_interruptibly(trainer)
    assert trainer.on_main_thread is False
    assert time.monotonic() - started < 30 and shut == [True]  # the run's actors go with it
