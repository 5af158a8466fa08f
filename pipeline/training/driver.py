"""The driver's side of training: :func:`fit` runs a task on a Ray Train TorchTrainer.

It checks first that a cluster could hold the workers, recognises a run that already
finished (a rerun starts no worker), sets aside a checkpoint registry naming a folder
that is gone, hands the workers their sealed settings and datasets, keeps Ctrl-C the
job's, and raises a worker's deterministic error as what it was. Re-running with the
same output resumes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import ray.train
import ray.train.torch
from ray import cloudpickle
from ray.train.torch import TorchTrainer

from pipeline.core import sealed, storage
from pipeline.core.capacity import CapacityWait, WorkerGroupWait
from pipeline.core.entry import stop_signal
from pipeline.core.errors import CapacityError, ConfigError, StorageError
from pipeline.core.runtime import autoscales, placement_problem
from pipeline.data.position import RAY_SNAPSHOT, checkpoint_folders, restorable_checkpoint
from pipeline.data.stream import configure_data_context
from pipeline.training.deepspeed_config import deepspeed_config
from pipeline.training.engine import TrainTask
from pipeline.training.failures import USER_ERROR, fed_user_error, forget_user_error, raise_user_error
from pipeline.training.train_config import TrainConfig
from pipeline.training.worker import STOP_REQUEST, train_worker

REPORT_POLL_S = 0.1


HEALTH_POLLS_PER_S = 20  # the controller's polls of all workers together, at most (once past 2 workers)


def health_check_interval(workers: int) -> float:
    """Seconds between Ray Train's health checks of each worker: ``REPORT_POLL_S`` for a
    couple of workers, then longer so that the controller polls the group about
    ``HEALTH_POLLS_PER_S`` times a second (128 workers: 6.4 s, where 0.1 s would be 1,280
    polls a second), and at most 10 s."""
    return round(min(10.0, max(REPORT_POLL_S, workers / HEALTH_POLLS_PER_S)), 3)


# How long the driver waits, after SIGTERM, for the workers' checkpoint (STOP_REQUEST).
STOP_GRACE_VAR = "RAYDENSE_STOP_GRACE_S"


def _fit_interruptibly(trainer: TorchTrainer, capacity: WorkerGroupWait | None = None, stop_request: str = ""):
    """``trainer.fit()`` on a thread of its own. On the main thread, Ray Train installs a
    SIGINT handler that turns Ctrl-C into an aborted run, which the job then reports as a
    failure (exit 1, Ray's advice, no resume hint). Here Ctrl-C stays Python's
    KeyboardInterrupt in the main thread: the job exits 130 with the resume hint at once, and
    the run's actors end with the driver (what was checkpointed stays). ``capacity``: on an
    autoscaling cluster, where Ray Train would retry its workers' placement for ever, the
    run ends with a :class:`CapacityError` once they waited their ``capacity_wait_s``.
    SIGTERM (a pod's eviction, ``ray job stop``) writes ``stop_request`` first, where the
    workers see it at their next preemption check, save a checkpoint and end: the rerun
    then redoes none of the steps since the last periodic checkpoint."""
    outcome: dict = {}
    # Set when fit returns. Not thread.join: a join interrupted by Ctrl-C or SIGTERM leaves
    # the thread looking finished (is_alive() False) while fit still runs (CPython).
    ended = threading.Event()

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            outcome["error"] = exc
        finally:
            ended.set()

    started = _train_controllers() if capacity is not None else set()
    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    try:
        while not ended.wait(0.5):  # a timed wait: Ctrl-C interrupts it
            if capacity is not None:
                capacity.check()
    except KeyboardInterrupt:
        if stop_request and stop_signal() == "SIGTERM":
            storage.write_json(stop_request, {"signal": "SIGTERM", "at": time.time()})
            ended.wait(float(os.environ.get(STOP_GRACE_VAR, "25")))
        # The run's actors go now: left to the interpreter's exit, the workers train on for
        # seconds and their forwarded lines follow the resume hint.
        ray.shutdown()
        raise
    except CapacityError:
        for controller in _train_controllers() - started:
            ray.kill(ray._private.worker.global_worker.core_worker.get_actor_handle(ray.ActorID.from_hex(controller)))
        capacity.remove_waiting()  # type: ignore[union-attr]  # raised by it
        ended.wait(30)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _fit_past_storage_faults(trainer: TorchTrainer, capacity: WorkerGroupWait | None, stop_request: str):
    """:func:`_fit_interruptibly`, again while Ray Train's controller dies of a transient
    storage fault. Its constructor checks the run's bucket once, outside any retry (a
    HeadBucket answered 503 on a busy S3 ended the run on ActorDiedError), and it writes its
    checkpoint registry with the SDK's retries alone, which a storm outlasts (an UploadPart
    answered SlowDown ended the run on ControllerError). The next fit resumes from the
    registered checkpoint. A fit that failed otherwise (its workers past ``max_failures``)
    is not started again."""
    failed: dict = {}

    def attempt():
        try:
            return _fit_interruptibly(trainer, capacity, stop_request)
        except ray.exceptions.ActorDiedError:
            raise  # storage.retrying takes it when its cause is transient
        except Exception as exc:  # noqa: BLE001 - raised below, never retried
            if isinstance(exc, ray.train.ControllerError) and storage.is_transient(exc):
                raise  # storage.retrying takes it
            failed["error"] = exc
            return None

    result = storage.retrying("start Ray Train's controller (it checks the run's storage)", attempt)
    if "error" in failed:
        raise failed["error"]
    return result


def _train_controllers() -> set[str]:
    """The ids of this job's Ray Train controllers not dead: the one a run started is ended
    with it when its workers were never placed (its placement group goes with it)."""
    job = ray.get_runtime_context().get_job_id()
    return {
        actor_id
        for actor_id, actor in ray._private.state.actors().items()
        if actor["ActorClassName"].endswith("TrainController") and actor["JobID"] == job and actor["State"] != "DEAD"
    }


def worker_resources(train: TrainConfig) -> dict[str, float]:
    return {"CPU": train.cpus_per_worker, "GPU": 1.0 if train.use_gpu else 0.0}


def _capacity_wait(train: TrainConfig) -> WorkerGroupWait | None:
    """The wait for the workers on an autoscaling cluster (a fixed one has
    ``resource_wait_s``, which Ray Train's own start timeout carries)."""
    if not autoscales() or train.capacity_wait_s <= 0:
        return None
    wait = CapacityWait(
        "Ray Train workers",
        train.num_workers,
        worker_resources(train),
        train.capacity_wait_s,
        setting="--train.capacity_wait_s",
    )
    return WorkerGroupWait(wait)


def check_placement(train: TrainConfig) -> None:
    """Fail before any work when no cluster could ever hold the workers (Ray Train would wait
    and retry for ever): called where a trainer starts, and again by :func:`fit`."""
    problem = placement_problem(worker_resources(train), train.num_workers)
    if problem:
        raise ConfigError(
            f"--train.num_workers {train.num_workers} x (--train.cpus_per_worker {train.cpus_per_worker:g}"
            f"{', a GPU' if train.use_gpu else ''}): {problem}"
        )
    if ray.is_initialized() and not autoscales():
        # Ray Data's ingest tasks need a CPU beside the workers: without one, every worker
        # waits for its first batch for ever, silently.
        total = ray.cluster_resources().get("CPU", 0.0)
        taken = train.num_workers * train.cpus_per_worker
        if total - taken < 1:
            raise ConfigError(
                f"--train.num_workers {train.num_workers} x --train.cpus_per_worker {train.cpus_per_worker:g} "
                f"take {taken:g} of this cluster's {total:g} CPUs, leaving none for Ray Data's ingest tasks "
                "(the workers would wait for data for ever): lower either, or give a local Ray more logical "
                "CPUs (--ray.num_cpus)"
            )


def _sealed_for_workers(worker_config: dict) -> dict:
    """The workers' config as bytes. Ray Train ships train_loop_config to its controller too,
    which would unpickle the task and so import its whole stack (torch, transformers,
    DeepSpeed, the models) only to pass it on: 6-9 s of every run's start on 2 cores, before
    the workers are even asked for. Bytes pass through it untouched."""
    return {"pickled": cloudpickle.dumps(worker_config)}


@dataclass
class FitResult:
    metrics: dict[str, Any]
    checkpoint: str | None
    run_dir: str
    history: list[dict]  # every log entry, as each was reported to Ray Train


def fit(
    train: TrainConfig,
    task: TrainTask,
    dataset_factory: Callable | list[Callable],
    run_dir: str,
    name: str = "checkpoints",
    replay_batches: int = 0,
    hparams: dict | None = None,
) -> FitResult:
    """Run the loop on a Ray Train TorchTrainer. Re-running with the same output resumes.
    ``hparams``: the job's whole config, logged (redacted) by the trackers; default ``train``."""
    configure_data_context()
    # Each ray.train.report (every log step) waits until Ray Train's controller has taken the
    # previous one, and the controller polls every 2 s by default: log windows shorter than
    # that would throttle training (measured: 1.3 s a step at log_every 1). The controller
    # also notices a finished worker group only at its next poll: a run that reports nothing
    # took 8.5 s at 0.5 s polling and 6.7 s at 0.1 s on 2 cores. Ray passes the driver's
    # value on to the controller; a value the user set wins.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(health_check_interval(train.num_workers)))
    check_placement(train)
    restorable_checkpoint(run_dir, warn=True)  # a run whose every checkpoint is damaged stops here
    forget_gone_checkpoints(run_dir)
    done = finished_run(run_dir, train)
    if done is not None:
        return done
    failures = ray.train.FailureConfig(max_failures=train.max_failures)
    if train.resource_wait_s > 0 and not autoscales():
        # A fixed cluster whose nodes could hold the workers, but other work holds the
        # resources: wait this long for them, once, instead of Ray Train's minute-long
        # waits retried for ever. (Worker failures once started are max_failures' business.)
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(train.resource_wait_s)
        failures = ray.train.FailureConfig(max_failures=train.max_failures, controller_failure_limit=0)
    loc = storage.resolve(train.output)
    resources = {"CPU": train.cpus_per_worker}
    worker_config = {
        "train": train,
        "task": task,
        "run_dir": run_dir,
        "deepspeed": deepspeed_config(train, train.num_workers),
        "replay_batches": replay_batches,
        "hparams": hparams,
        "seal_key": _seal_key(run_dir),
    }
    # Datasets read one after another (a fine-tuning run's epochs): Ray Data runs each only
    # when the workers start reading it.
    parts = dataset_factory if isinstance(dataset_factory, list) else [dataset_factory]
    datasets = {"train": parts[0]} if len(parts) == 1 else {f"train_{i:04d}": part for i, part in enumerate(parts)}
    worker_config["datasets"] = list(datasets)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config=_sealed_for_workers(worker_config),
        scaling_config=ray.train.ScalingConfig(
            num_workers=train.num_workers, use_gpu=train.use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=loc.path if storage.is_s3(train.output) else loc.uri,
            storage_filesystem=storage.sdk_retrying_filesystem() if storage.is_s3(train.output) else None,
            failure_config=failures,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=train.keep_checkpoints),
            # Ray Train's INFO lines are its bookkeeping (resources requested, a worker group
            # started, advice about a RunConfig(name) raydense does not expose on every
            # resume); a retry's cause still shows in the worker's own error lines.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
        datasets=datasets,
    )
    marker = storage.join(run_dir, USER_ERROR)
    forget_user_error(marker)
    stop_request = storage.join(run_dir, STOP_REQUEST) if train.preemption_check_s > 0 else ""
    if stop_request:
        storage.delete_file(stop_request)  # the stop of an earlier attempt
    try:
        result = _fit_past_storage_faults(trainer, _capacity_wait(train), stop_request)
    except ray.train.TrainingFailedError as exc:
        raise_user_error(marker)
        fed = fed_user_error(exc, run_dir)  # a worker's error that reached no marker
        if fed is not None:
            raise fed from None
        raise
    raise_user_error(marker)
    checkpoint = result.checkpoint.path if result.checkpoint else None
    history = (result.return_value or {}).get("history", [])
    done = FitResult(dict(result.metrics or {}), checkpoint, run_dir, history)
    storage.write_json(
        storage.join(run_dir, FINISHED),
        {"checkpoint_dir_name": restorable_checkpoint(run_dir), **asdict(done)},
    )
    return done


FINISHED = "finished.json"


def _seal_key(run_dir: str) -> sealed.SealKey:
    """The key this run's checkpoints are signed and checked with, said once where it was
    generated on this machine: a rerun on another one cannot resume from them."""
    key = sealed.seal_key(run_dir)
    if key.source != f"${sealed.KEY_ENV}" and storage.is_s3(run_dir) and not _GENERATED_KEY_SAID:
        _GENERATED_KEY_SAID.append(run_dir)
        print(
            f"warning: checkpoints under {run_dir} are signed with a key generated on this machine "
            f"({key.source}): a rerun elsewhere cannot resume from them; set {sealed.KEY_ENV} "
            "(on a cluster, its Secret: docs/deploy.md)",
            file=sys.stderr,
            flush=True,
        )
    return key


_GENERATED_KEY_SAID: list[str] = []  # once a process: a recipe fits many times


def forget_gone_checkpoints(run_dir: str) -> None:
    """Ray Train's registry of a run's checkpoints (``RAY_SNAPSHOT``) naming a folder that is
    gone (deleted by hand, or by a storage lifecycle rule) would stop its controller at
    start, with advice about a setting raydense does not expose. It is set aside: Ray Train
    starts a new registry, and the run resumes from the checkpoint our own pointer and the
    listing give (:func:`restorable_checkpoint`, which named what it passed over)."""
    uri = storage.join(run_dir, RAY_SNAPSHOT)
    if not storage.exists(uri):
        return
    try:
        registered = {r["checkpoint_dir_name"] for r in storage.read_json(uri).get("checkpoint_results", [])}
    except (StorageError, KeyError, TypeError, AttributeError, ValueError):
        return  # a registry of another Ray version: Ray Train reads it, or says why not
    if registered - set(checkpoint_folders(run_dir)):
        storage.write_bytes(uri + ".set-aside", storage.read_bytes(uri))
        storage.delete_file(uri)


def finished_run(run_dir: str, train: TrainConfig) -> FitResult | None:
    """The result of a run that already trained to ``train.max_steps``, as recorded when it
    finished, with ``steps_this_attempt`` 0 (None: there are steps to train). A rerun of a
    finished run then starts no worker. A checkpoint saved since, or a higher
    ``--train.max_steps``, makes it a run to resume."""
    uri = storage.join(run_dir, FINISHED)
    if not storage.exists(uri):
        return None
    record = storage.read_json(uri)
    name = record.pop("checkpoint_dir_name")
    done = FitResult(**record)
    steps = done.metrics.get("steps", 0)
    exported = [v for k, v in done.metrics.items() if k.endswith("_dir") and isinstance(v, str)]
    if name != restorable_checkpoint(run_dir) or train.max_steps > steps:
        return None
    if not all(storage.list_files(path) for path in exported):
        return None  # its export is gone: the workers write it again from the checkpoint
    print(
        f"{run_dir}: finished at step {steps} ({name}); nothing to train "
        f"(a --train.max_steps above {steps} trains on from there)",
        file=sys.stderr,
        flush=True,
    )
    done.metrics |= {
        "steps_this_attempt": 0,
        "already_finished": True,
        "resumed_from": {"checkpoint": name, "step": steps},
    }
    return done
