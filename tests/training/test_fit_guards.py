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
    # Python's own Ctrl-C, as a job's process starts with: a handler an earlier test left in
    # this worker's process swallowed the signal once (the suite beside two busy loops).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    trainer = _BlockingTrainer()
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        driver._fit_interruptibly(trainer)
    signal.signal(signal.SIGINT, previous)
    assert trainer.on_main_thread is False
    assert time.monotonic() - started < 30 and shut == [True]  # the run's actors go with it


class _ControllerDied(Exception):
    """Stands in for ray.exceptions.ActorDiedError (its constructor wants a Ray cause)."""


class _FakeTrainer:
    def __init__(self, failures: list[BaseException]):
        self.failures, self.fits = failures, 0

    def fit(self):
        self.fits += 1
        if self.failures:
            raise self.failures.pop(0)
        return "fitted"


def test_a_controller_killed_by_a_transient_storage_fault_is_started_again_and_nothing_else_is(monkeypatch):
    """Ray Train's controller checks the run's bucket in its constructor, outside any retry:
    on the busy S3 a HeadBucket answered 503 ended a fine-tuning on ActorDiedError. That fit
    is started again; a controller killed by a missing bucket, and a fit that failed past its
    workers' restarts, are not. Mutation: ``fit`` calling ``_fit_interruptibly`` directly
    fails the first case; ControllerError left to the last branch fails the throttled
    registry write's."""
    import ray
    import ray.train

    monkeypatch.setattr(ray.exceptions, "ActorDiedError", _ControllerDied)
    monkeypatch.setenv("RAYDENSE_S3_RETRY_SECONDS", "5")
    busy = "When testing for existence of bucket 'b': AWS Error UNKNOWN (HTTP status 503) during HeadBucket"
    trainer = _FakeTrainer([_ControllerDied(busy), _ControllerDied(busy)])
    assert driver._fit_past_storage_faults(trainer, None, "") == "fitted" and trainer.fits == 3

    missing = _ControllerDied("AWS Error NO_SUCH_BUCKET (HTTP status 404) during HeadBucket")
    trainer = _FakeTrainer([missing])
    with pytest.raises(_ControllerDied, match="NO_SUCH_BUCKET"):
        driver._fit_past_storage_faults(trainer, None, "")
    assert trainer.fits == 1

    trainer = _FakeTrainer([RuntimeError(f"training failed past max_failures: {busy}")])
    with pytest.raises(RuntimeError, match="max_failures"):
        driver._fit_past_storage_faults(trainer, None, "")
    assert trainer.fits == 1

    # The controller's own write of its checkpoint registry, past the SDK's retries in a storm
    # (bench_storage_faults' busy pre-training met it): started again; denied access is not.
    throttled = OSError("When uploading part for key 'run/checkpoint_manager_snapshot.json': AWS Error SLOW_DOWN")
    trainer = _FakeTrainer([ray.train.ControllerError(throttled)])
    assert driver._fit_past_storage_faults(trainer, None, "") == "fitted" and trainer.fits == 2
    trainer = _FakeTrainer([ray.train.ControllerError(OSError("AWS Error ACCESS_DENIED during PutObject"))])
    with pytest.raises(ray.train.ControllerError, match="ACCESS_DENIED"):
        driver._fit_past_storage_faults(trainer, None, "")
    assert trainer.fits == 1
