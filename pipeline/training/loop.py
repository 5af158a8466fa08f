"""The one Ray Train + DeepSpeed training loop.

Every trainer (pre-training, fine-tuning, the re-ranker, distillation) differs only in the
*task* it hands this loop: how to build the model, turn a streamed batch into tensors,
and compute the loss, and how to export the result. The loop owns everything else:
DeepSpeed, the optimiser and schedule, logging, checkpoints with the data position,
resume, and the final export.

Checkpoint layout (one Ray Train checkpoint directory per save, ``checkpoint_<step>``)::

    state/...                   DeepSpeed engine: weights, optimiser (ZeRO shards per rank), schedule
    latest                      DeepSpeed's tag file
    trainer_state.json          step, tokens, loss history (rank 0)
    position_rank<r>.json       the corpus rows rank r consumed, per epoch

On the next worker-group start, the stream factory (pipeline.data.stream) reads the position
of the checkpoint Ray Train will restore: Ray's own registry names it; the pointer
``<run_dir>/data_position.json``, which rank 0 writes after each report, is the fallback.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import ray.train
import ray.train.torch
import torch
from ray import cloudpickle
from ray.train.torch import TorchTrainer

from models.batches import to_device
from models.compiled import compile_in_place
from models.memory import ACTIVATION_SHARE, OPTIMIZER_BYTES_PER_PARAM, ActivationCost, fitting_micro_batch, free_memory
from pipeline.core import storage
from pipeline.core.config import to_dict
from pipeline.core.entry import FULL_DISK, out_of_space, user_error
from pipeline.core.errors import ArtifactError, ConfigError, InputError, OutOfSpace, RaydenseError, StorageError
from pipeline.core.runtime import autoscales, placement_problem
from pipeline.data.position import RAY_SNAPSHOT, checkpoint_folders, read_position, restorable_checkpoint
from pipeline.data.stream import configure_data_context
from pipeline.training.checkpoints import Restored, TrainState, restore_checkpoint, save_checkpoint
from pipeline.training.deepspeed_config import deepspeed_config, import_deepspeed, skip_inference_comm_op
from pipeline.training.profiling import StepProfiler
from pipeline.training.tracking import RunLog
from pipeline.training.train_config import TrainConfig


class TrainTask(Protocol):
    """What a trainer plugs into the loop. Built on the worker, from picklable settings."""

    def build_model(self) -> torch.nn.Module: ...
    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]: ...
    def backward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and ``engine.backward`` for one micro-batch; returns (loss to log, extras)."""

    def consumed_rows(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]: ...
    def fit_to_memory(self, engine, available_bytes: int, micro_batch_size: int) -> dict:
        """Settings the task sizes from the memory its worker has free once the engine is
        up (coCondenser's gradient-cache chunk); returns them, to log."""

    def activation_cost(self, module: torch.nn.Module) -> ActivationCost | None:
        """What a micro-batch keeps for its backward, per stream row at its widest (measured
        on ``module``'s device); None where the micro-batch must not be split."""

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int: ...

    counter_names: tuple[str, ...]  # what counters() may return

    def counters(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        """Event counts to total over all workers for the summary (e.g. skipped documents)."""

    def export(self, model: torch.nn.Module, out_dir: str) -> dict[str, str]: ...


def consumed_source_rows(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, row) of every source row of a batch whose examples list theirs in ``source_rows``."""
    sources = list(batch["source_rows"])
    counts = np.array([len(s) for s in sources], dtype=np.int64)
    rows = np.concatenate(sources).astype(np.int64) if sources else np.zeros(0, np.int64)
    return np.repeat(np.asarray(batch["epoch"]), counts), rows


# -- configuration helpers (driver side) -------------------------------------------------


def linear_schedule(max_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    warmup = max(1, int(round(max_steps * warmup_ratio))) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup))

    return factor


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # An empty group (LoRA trains only 2-D adapters: no bias, no LayerNorm) is dropped by
    # DeepSpeed's ZeRO optimiser but not by the schedule built over it, which then fails.
    return [group for group in groups if group["params"]]


def step_seed(seed: int, rank: int, micro_step: int) -> int:
    """Per-(rank, micro-step) seed: corruption is reproducible, and differs across workers."""
    return (seed * 1_000_003 + rank * 7_919 + micro_step) % (2**63 - 1)


def size_micro_batch(engine, task: TrainTask, train: TrainConfig, available: int, kept: int) -> dict:
    """With ``train.size_micro_batch``, split a worker's rows per step (micro_batch_size x
    grad_accum) into the fewest equal micro-batches whose activations, measured by the task,
    fit this worker's ``available`` bytes beside the optimiser state still to come; ``kept``
    (a resumed run's micro-batch) stays while it fits. Every rank takes the smallest choice
    of any rank: DeepSpeed steps them together. Sets the engine's micro-batch and
    accumulation; returns them with the figures that chose them ({} when not sized)."""
    enabled = train.size_micro_batch == "on" or (train.size_micro_batch == "auto" and train.use_gpu)
    # ZeRO-3 partitions the module's parameters: a forward outside the engine's step, as
    # the measuring is, is not checked there.
    cost = task.activation_cost(engine.module) if enabled and engine.zero_optimization_stage() < 3 else None
    if cost is None:
        return {}
    step_rows = train.micro_batch_size * train.grad_accum
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    shards = engine.dp_world_size if engine.zero_optimization_stage() >= 1 else 1
    budget = available * ACTIVATION_SHARE - OPTIMIZER_BYTES_PER_PARAM * trainable / shards
    fits = kept > 0 and step_rows % kept == 0 and cost.bytes(kept) <= budget
    micro = torch.tensor([kept if fits else fitting_micro_batch(cost, budget, step_rows)], device=engine.device)
    torch.distributed.all_reduce(micro, op=torch.distributed.ReduceOp.MIN)
    micro = int(micro.item())
    # DeepSpeed reads both from its config at every micro-step; its ZeRO optimiser keeps its
    # own copy of the accumulation (for CPU offload).
    engine.set_train_micro_batch_size(micro)
    engine.set_train_batch_size(step_rows * engine.dp_world_size)
    if hasattr(engine.optimizer, "gradient_accumulation_steps"):
        engine.optimizer.gradient_accumulation_steps = step_rows // micro
    sized = {
        "micro_batch_size": micro,
        "grad_accum": step_rows // micro,
        "activation_mib_per_row": round(cost.per_item / 2**20, 3),
        "activation_budget_gib": round(budget / 2**30, 3),
        **({"kept_from": kept} if kept else {}),
    }
    if cost.bytes(1) > budget:
        log(
            f"warning: one row's activations ({cost.bytes(1) / 2**20:.1f} MiB) exceed this worker's "
            f"budget ({budget / 2**20:.1f} MiB, half its free memory less the optimiser state): it trains "
            "a row at a time and may still run out of memory; shorten the rows or free memory"
        )
    return sized


# -- the worker loop ---------------------------------------------------------------------


def training_batches(shard, train: TrainConfig, micro_batch_size: int):
    """A worker's micro-batches from its stream shard (a Ray ``DataIterator``), in stream
    order: the stream orders its rows itself, as a function of the data alone, so that a
    resumed run sees the order an uninterrupted one does (a local shuffle buffer would
    shuffle what is left after a resume differently)."""
    return shard.iter_batches(
        batch_size=micro_batch_size,
        batch_format="numpy",
        prefetch_batches=train.prefetch_batches,
        drop_last=False,
    )


def shard_batches(name: str, train: TrainConfig, micro_batch_size: int):
    """:func:`training_batches` of dataset ``name``'s shard, asked of Ray Train only now: each
    shard asked starts a split coordinator (an actor) for its dataset, so the datasets of
    later epochs cost nothing before their turn. Every rank asks in the same order."""
    return training_batches(ray.train.get_dataset_shard(name), train, micro_batch_size)


def chained(parts: list, batch_size: int) -> Iterator:
    """The batches of ``parts`` (each a zero-argument callable giving an iterator of numpy
    batches), one part after another, cut again into batches of ``batch_size`` rows across
    the parts' ends: an epoch's last rows share a batch with the next epoch's first, as in
    one stream. The next part is started, and its first batch fetched, in a thread once the
    current one's first batch is taken: an epoch's stream prepares itself while the one
    before it trains."""
    if len(parts) == 1:
        yield from parts[0]()
        return

    def started(i: int):
        batches = iter(parts[i]())
        return batches, next(batches, None)

    def joined():
        pool = ThreadPoolExecutor(1, thread_name_prefix="next-part")
        try:
            ahead = pool.submit(started, 0)
            for i in range(len(parts)):
                batches, first = ahead.result()
                if first is not None:
                    yield first
                # Started once the first batch is taken, so the next epoch's join does not
                # compete with the stream's start for the node's CPUs.
                if i + 1 < len(parts):
                    ahead = pool.submit(started, i + 1)
                yield from batches  # nothing left when the part had no first batch
        finally:  # a run that stops early (max_steps) does not wait for the next part's start
            pool.shutdown(wait=False, cancel_futures=True)

    yield from rebatched(joined(), batch_size)


def rebatched(batches: Iterator[dict], size: int) -> Iterator[dict]:
    """``batches`` (dicts of equally long arrays) as batches of ``size`` rows, in order, the
    last one shorter if the rows run out. A full batch passes through uncopied."""
    pending: dict | None = None
    for batch in batches:
        if pending is not None:
            batch = {key: np.concatenate([pending[key], batch[key]]) for key in batch}
        rows = len(next(iter(batch.values())))
        whole = rows - rows % size
        for start in range(0, whole, size):
            yield batch if rows == size else {key: values[start : start + size] for key, values in batch.items()}
        pending = {key: values[whole:] for key, values in batch.items()} if whole < rows else None
    if pending is not None:
        yield pending


def collated(batches, make_batch, seed_of, first_micro_step: int, ahead: bool):
    """Each micro-batch with its tensors: ``make_batch(batch, generator)``, the generator
    seeded by ``seed_of(micro_step)``, micro-steps counting from ``first_micro_step``. With
    ``ahead``, the next batch is made in a thread while the caller trains on this one, so
    masking and collation leave the step's critical path. The tensors are the same either
    way: ``make_batch`` draws from its generator only."""

    def make(batch, micro_step: int):
        return make_batch(batch, torch.Generator().manual_seed(seed_of(micro_step)))

    micro_steps = itertools.count(first_micro_step)
    if not ahead:
        for batch in batches:
            yield batch, make(batch, next(micro_steps))
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="collate") as pool:
        pending = None
        for batch in batches:
            made = pool.submit(make, batch, next(micro_steps))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (batch, made)
        if pending is not None:
            yield pending[0], pending[1].result()


def _timed(batches, waited: list[float]):
    """``batches``, adding the time each ``next`` blocks to ``waited[0]``."""
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        waited[0] += time.perf_counter() - started
        yield batch


def log(msg: dict | str) -> None:
    # Worker logs go to stderr: a job's stdout is reserved for its JSON summary. Written
    # directly, because Ray Train patches `print` on workers and would emit each line twice.
    sys.stderr.write((msg if isinstance(msg, str) else json.dumps(msg)) + "\n")
    sys.stderr.flush()


MAX_STEPS_BETWEEN_CHECKS = 10_000


def steps_between_checks(check_s: float, step_s: float) -> int:
    """Steps to the next preemption ask: as many as fit in ``check_s`` seconds at the
    slowest rank's ``step_s`` a step, at least 1 (a step longer than the interval asks
    after each), at most :data:`MAX_STEPS_BETWEEN_CHECKS`."""
    if step_s <= 0:
        return 1
    return max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(check_s / step_s)))


# Written by a worker that hit a user error or a corrupt input (a deterministic error): every
# worker of the next attempt stops at its start, so that Ray Train's retries (meant for lost
# workers and nodes) do not redo the failing work max_failures times.
USER_ERROR = "user_error.json"
DETERMINISTIC = (ConfigError, InputError, ArtifactError, OutOfSpace)


def train_worker(config: dict) -> dict:
    """Ray Train's train_loop_per_worker. ``config`` holds picklable settings only, or those
    settings pickled (what :func:`fit` hands Ray Train: see :func:`_sealed_for_workers`)."""
    if "pickled" in config:
        config = cloudpickle.loads(config["pickled"])
    _quiet_ray_train_reports()
    marker = storage.join(config["run_dir"], USER_ERROR)
    if storage.exists(marker):
        return {"user_error": storage.read_json(marker)}
    try:
        run = WorkerRun(config)
        for batch, tensors in run.batches():
            if run.state.step >= run.train.max_steps:
                break
            run.train_on(batch, tensors)
        return run.finish()
    except DETERMINISTIC as exc:
        _write_user_error(marker, exc)
        raise
    except Exception as exc:
        fed = fed_user_error(exc)
        if fed is not None:
            _write_user_error(marker, fed)
            raise fed from None
        failed_compile = _compile_error(exc, config.get("train"))
        if failed_compile is not None:
            _write_user_error(marker, failed_compile)
            raise failed_compile from exc
        if _round_trips(exc):
            raise
        # Ray Train hands a worker's exception to its controller pickled; one that does not
        # come back (torch 2.11's Inductor raised such an AssertionError on an H200) reached
        # the driver as "a worker health check failed", its type and message lost.
        raise WorkerError(f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}") from None


_REMOTE_USER_ERROR = re.compile(
    rf"^pipeline\.core\.errors\.({'|'.join(cls.__name__ for cls in DETERMINISTIC)}): (.+)$", re.MULTILINE
)


def fed_user_error(exc: BaseException) -> RaydenseError | None:
    """A deterministic error raised in a Ray Data task that fed this worker (a damaged corpus
    shard), or None. Ray Data wraps it in a UserCodeException whose cause does not survive
    the trip to the worker, only the remote traceback's text, which names it on a line of
    its own."""
    found = user_error(exc)
    if isinstance(found, DETERMINISTIC):
        return found
    named = _REMOTE_USER_ERROR.findall(str(exc))
    if named:
        kind, message = named[-1]
        return {cls.__name__: cls for cls in DETERMINISTIC}[kind](message)
    full = [line for line in str(exc).splitlines() if any(reason in line for reason in FULL_DISK.values())]
    return out_of_space(None, full[-1].strip()) if full else None


def _write_user_error(marker: str, exc: BaseException) -> None:
    with contextlib.suppress(StorageError):  # a full disk: the driver reads it from the error's text
        storage.write_json(marker, {"kind": type(exc).__name__, "message": str(exc)})


class WorkerError(RuntimeError):
    """A worker's exception that could not be sent to Ray Train's controller as it was: its
    type, message and traceback as text."""


def _compile_error(exc: BaseException, train: TrainConfig | None) -> ConfigError | None:
    """With --train.compile, a failure of torch.compile as the user's error: the same model,
    shapes and torch fail the same way, so Ray Train's retries would only repeat it (as
    torch 2.11's Inductor did on an H200, in its tiling analysis)."""
    if train is None or not train.compile:
        return None
    from torch._dynamo.exc import TorchDynamoException

    if not isinstance(exc, TorchDynamoException):
        return None
    cause = getattr(exc, "inner_exception", None) or exc  # what the backend (Inductor) raised
    lines = str(cause).strip().splitlines()
    return ConfigError(
        f"--train.compile: torch {torch.__version__} could not compile the model "
        f"({type(exc).__name__}, {type(cause).__name__}: {lines[0][:400] if lines else ''}); "
        "train without --train.compile, or with another torch version"
    )


def _round_trips(exc: BaseException) -> bool:
    try:
        cloudpickle.loads(cloudpickle.dumps(exc))
    except Exception:
        return False
    return True


def _quiet_ray_train_reports() -> None:
    """Ray Train logs every report at INFO, its whole metrics dict included: each log step
    would appear twice. Its warnings from that module still show."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray version: its log lines stay
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _build_engine(train: TrainConfig, task: TrainTask, deepspeed_settings: dict):
    """The task's model under DeepSpeed, with AdamW and the linear schedule: (engine, scheduler)."""
    # Named, DeepSpeed does not warn on every CPU worker that it found no GPU.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if train.use_gpu else "cpu")
    deepspeed = import_deepspeed(keep_mlflow="mlflow" in train.tracker)
    torch.set_num_threads(max(1, int(train.cpus_per_worker)))
    torch.manual_seed(train.seed)  # identical initialisation on every rank
    model = task.build_model()
    if train.compile:
        compile_in_place(model, blocks=True)  # before DeepSpeed wraps it: the engine calls the compiled blocks
    optimizer = torch.optim.AdamW(
        param_groups(model, train.weight_decay), lr=train.lr, eps=train.adam_eps, fused=train.use_gpu or None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(train.max_steps, train.warmup_ratio))
    skip_inference_comm_op()
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_settings
    )
    return engine, scheduler


def _restore(engine, rank: int, run_dir: str) -> Restored:
    """The checkpoint this start resumes from (state, data position), its resume event recorded."""
    restored = restore_checkpoint(engine, rank, run_dir)
    state, position = restored.state, restored.position
    stream_position, stream_from = read_position(run_dir)
    if restored.checkpoint is not None or stream_from is not None:
        # The stream left out what checkpoint `stream_from` consumed; the model resumed from
        # `restored.checkpoint`. Both are the same function's answer, so they agree; if they
        # ever differ, the rows repeated or skipped are counted here, not hidden.
        event = {
            "checkpoint": restored.checkpoint,
            "step": state.step,
            "stream_from": stream_from,
            "rows_repeated": position.difference_count(stream_position),
            "rows_skipped": stream_position.difference_count(position),
        }
        state.resumes.append(event)
        if rank == 0:
            log({"event": "resumed", **event})
    return restored


@dataclass
class LogWindow:
    """What a log line averages: the steps since the last one."""

    losses: list = field(default_factory=list)
    tokens: int = 0
    samples: int = 0
    waited: list = field(default_factory=lambda: [0.0])  # seconds spent waiting for the next batch
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, tokens: int, samples: int) -> None:
        self.losses.append(loss.detach())
        self.tokens += tokens
        self.samples += samples

    def reset(self) -> None:
        # In place: `_timed` keeps adding to this window's `waited`.
        self.losses, self.tokens, self.samples, self.start = [], 0, 0, time.perf_counter()
        self.waited[0] = 0.0


class WorkerRun:
    """One worker's attempt at a run: its engine, the restored state and data position, the
    log window and the data trace."""

    def __init__(self, config: dict):
        self.config, self.train, self.task = config, config["train"], config["task"]
        self.run_dir: str = config["run_dir"]
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.engine, self.scheduler = _build_engine(self.train, self.task, config["deepspeed"])
        restored = _restore(self.engine, self.rank, self.run_dir)
        self.state, self.position = restored.state, restored.position
        self.checkpoint_suffix = restored.name_suffix  # after passing over damaged checkpoints
        self._fit_to_memory(ctx.get_local_world_size())
        hparams = config.get("hparams") or to_dict(self.train)
        self.run_log = (
            RunLog(self.train.output, self.train.tracker, hparams, self.state.history) if self.rank == 0 else None
        )
        self.window = LogWindow()
        self.trace: list[list] = []  # [micro_step, epoch, rows] per micro-batch, with train.data_trace
        self.started, self.start_tokens, self.start_step = time.perf_counter(), self.state.tokens, self.state.step
        self.last_saved = self.state.step
        self.preemption_seen = None  # the last preemption notice acted on
        # The first ask follows the first step; its time (warm-up included) sets the next.
        self.next_check, self.checked_at = self.state.step + 1, (self.state.step, time.perf_counter())
        self.extra: dict[str, torch.Tensor] = {}
        self.epochs = np.zeros(0, dtype=np.int64)  # the last batch's epochs
        self.profiler = StepProfiler(
            self.train.profile_steps if self.rank == 0 else 0,
            self.train.max_steps,
            self.engine.device,
            self.train.output,
            self.rank,
        )
        self.profiler.before_training(self.state.step)

    def _fit_to_memory(self, workers_on_node: int) -> None:
        """Size what the task and the loop size from memory (coCondenser's chunk, the
        micro-batch); the split is kept in the state, for this run's resumes."""
        train, state = self.train, self.state
        available = int(train.memory_gib * 2**30) or free_memory(self.engine.device, workers_on_node)
        fitted = self.task.fit_to_memory(self.engine, available, train.micro_batch_size)
        kept = state.micro_batch_size
        sized = size_micro_batch(self.engine, self.task, train, available, kept)
        micro = sized.get("micro_batch_size", train.micro_batch_size)
        if kept and micro != kept and state.resumes:
            # The kept split no longer fits this device, or the settings changed: the resumed
            # run goes on with other micro-batches (the same rows per step when sized).
            state.resumes[-1]["micro_batch_resized"] = [kept, micro]
        state.micro_batch_size = micro
        if (fitted or sized) and self.rank == 0:
            log({"sized_from_memory": fitted | sized})

    def batches(self):
        """This worker's micro-batches with their tensors (:func:`collated`), the wait for
        each timed."""
        batches = chained(
            [
                functools.partial(shard_batches, name, self.train, self.state.micro_batch_size)
                for name in self.config.get("datasets", ["train"])
            ],
            self.state.micro_batch_size,
        )
        if self.config.get("replay_batches"):
            # Benchmark mode: hold the first N batches in memory and cycle them, so the same
            # loop can be timed without any ingest (bench/bench_pretrain.py).
            batches = itertools.cycle(list(itertools.islice(batches, self.config["replay_batches"])))
        ahead = self.train.collate_ahead == "on" or (self.train.collate_ahead == "auto" and self.train.use_gpu)
        seed_of = functools.partial(step_seed, self.train.seed, self.rank)
        return _timed(
            collated(batches, self.task.make_batch, seed_of, self.state.micro_step, ahead), self.window.waited
        )

    def train_on(self, batch: dict[str, np.ndarray], tensors: dict[str, torch.Tensor]) -> None:
        """One micro-batch (its arrays, and its tensors as :func:`collated` made them):
        forward, backward, the optimiser at an accumulation boundary, then the log line and
        the checkpoint when they are due."""
        train, state, engine = self.train, self.state, self.engine
        # Dropout draws from the global generators: seeded per micro-step, like the task's
        # corruption, a resumed run draws what the uninterrupted one drew at that step.
        torch.manual_seed(step_seed(train.seed, self.rank, state.micro_step))
        tensors = to_device(tensors, engine.device)
        loss, self.extra = self.task.backward(engine, tensors)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        self._record(batch, loss)
        if not boundary:
            return
        state.step += 1
        self.profiler.after_step(state.step)
        if state.step % train.log_every == 0 or state.step == train.max_steps:
            self._log()
        noticed = self._preemption_notice()  # a collective: asked on every rank, whatever else is due
        if state.step < train.max_steps and (noticed or state.step % train.checkpoint_every == 0):
            self._save({"step": state.step})

    def _preemption_notice(self) -> bool:
        """Whether Ray Train has had word, since the last notice, that a node of this worker
        group is about to be taken away (drained with a deadline: a spot reclaim, a
        scale-down). Ray Train restarts the group once the deadline passes; the checkpoint
        saved on the notice is what the restart resumes from, so the steps trained before it
        are not redone. Asked about every ``preemption_check_s`` seconds, at steps all ranks
        agree on: the ask is a collective, and so is the step time that sets the next one."""
        check_s, state = self.train.preemption_check_s, self.state
        if not check_s or state.step < self.next_check:
            return False
        now = time.perf_counter()
        last_step, last_time = self.checked_at
        step_s = torch.tensor([(now - last_time) / max(1, state.step - last_step)], device=self.engine.device)
        torch.distributed.all_reduce(step_s, op=torch.distributed.ReduceOp.MAX)
        self.next_check = state.step + steps_between_checks(check_s, float(step_s.item()))
        self.checked_at = (state.step, now)
        notice = ray.train.get_preemption_info()
        if notice is None or notice == self.preemption_seen:
            return False
        self.preemption_seen = notice
        deadline_in_s = round(notice.deadline_ms / 1000 - time.time(), 1) if notice.deadline_ms else None
        event = {
            "step": state.step,
            "nodes": notice.preempted_node_ids,
            "ranks": notice.preempted_ranks,
            "deadline_in_s": deadline_in_s,
        }
        state.preemptions.append(event)
        if self.rank == 0:
            log({"event": "preemption_notice", **event, "saving": "checkpoint"})
        return True

    def _record(self, batch: dict[str, np.ndarray], loss: torch.Tensor) -> None:
        """What the micro-batch consumed (the data position, the trace), counted and summed."""
        state = self.state
        self.epochs, rows = self.task.consumed_rows(batch)
        # Packed sequences name the document they cut part-way, with the tokens consumed.
        opened = batch.get("partial")
        for epoch in np.unique(batch["epoch"]):
            begun = opened[(batch["epoch"] == epoch) & (opened[:, 0] >= 0)] if opened is not None else ()
            self.position.add(int(epoch), rows[self.epochs == epoch], begun)
            if self.train.data_trace:
                self.trace.append([state.micro_step, int(epoch), rows[self.epochs == epoch].tolist()])
        state.micro_step += 1
        for key, value in self.task.counters(batch).items():
            state.counters[key] = state.counters.get(key, 0) + value
        tokens = self.task.count_tokens(batch)
        state.tokens += tokens
        self.window.add(loss, tokens, len(next(iter(batch.values()))))

    def _log(self) -> None:
        window = self.window
        elapsed = time.perf_counter() - window.start
        entry = {
            "step": self.state.step,
            "loss": float(torch.stack(window.losses).float().mean()),
            "lr": self.scheduler.get_last_lr()[0],
            "tokens_per_s": window.tokens / max(elapsed, 1e-9),
            "samples_per_s": window.samples / max(elapsed, 1e-9),
            # near 1: the step waits on ingest (Ray Data), not on compute
            "input_wait_frac": min(1.0, window.waited[0] / max(elapsed, 1e-9)),
            "epoch": int(self.epochs.max()) if len(self.epochs) else 0,
            "elapsed_s": time.perf_counter() - self.started,
            **_mixed_precision_state(self.engine, self.train.precision),
            **{k: float(v) for k, v in self.extra.items()},
        }
        self.state.history.append(entry)
        ray.train.report(entry)  # every rank: Ray keeps rank 0's, for its dashboard and result
        if self.run_log is not None:
            log(entry)
            self.run_log.log(entry)
        window.reset()

    def _save(self, metrics: dict) -> None:
        self.trace = _flush_trace(self.trace, self.run_dir, self.rank, self.state)
        save_checkpoint(
            self.engine, self.state, self.position, self.rank, self.run_dir, metrics, self.checkpoint_suffix
        )
        self.last_saved = self.state.step

    def _totals(self) -> tuple[float, dict[str, int]]:
        """This attempt's tokens/s summed over the workers, and the task's counters' totals."""
        state = self.state
        elapsed = time.perf_counter() - self.started
        counter_names = sorted(self.task.counter_names)  # the same on every rank
        totals = torch.tensor(
            [(state.tokens - self.start_tokens) / max(elapsed, 1e-9)]
            + [float(state.counters.get(k, 0)) for k in counter_names],
            dtype=torch.float64,
            device=self.engine.device,
        )
        torch.distributed.all_reduce(totals)  # one collective, at the end only
        return float(totals[0].item()), {k: int(v) for k, v in zip(counter_names, totals[1:].tolist())}

    def finish(self) -> dict:
        """Export, the run's summary as the last report (with a checkpoint if steps were
        trained since the last one); returns every log entry (rank 0's is the run's)."""
        state = self.state
        rate, counter_totals = self._totals()
        _flush_trace(self.trace, self.run_dir, self.rank, state)
        export = _export(self.task, self.engine, self.rank, storage.join(self.train.output, "export"))
        if self.run_log is not None:
            self.run_log.close()
        summary = {
            "steps": state.step,
            "final_loss": state.history[-1]["loss"] if state.history else float("nan"),
            "tokens_per_s": rate,
            "tokens_per_s_per_worker": rate / self.world,
            "restarts": state.restarts,
            "resumes": state.resumes,
            "preemptions": state.preemptions,
            "steps_this_attempt": state.step - self.start_step,
            "micro_batch_size": state.micro_batch_size,
            "grad_accum": self.engine.gradient_accumulation_steps(),
            "counters": counter_totals,
            **export,
        }
        if state.step > self.last_saved:
            save_checkpoint(self.engine, state, self.position, self.rank, self.run_dir, summary, self.checkpoint_suffix)
        else:
            ray.train.report(summary)
        # Ray Train V2 keeps only checkpoints' metrics in its Result; rank 0's return value is
        # the run's every log entry (every report), resumed attempts included.
        return {"history": state.history}


def _mixed_precision_state(engine, precision: str) -> dict[str, float]:
    """The global gradient norm of the last step (bf16, fp16) and fp16's loss scale: what
    tells a diverging low-precision run from a healthy one."""
    if precision == "fp32":
        return {}
    out = {}
    norm = engine.get_global_grad_norm()
    if norm is not None:
        out["grad_norm"] = float(norm)
    if precision == "fp16":
        scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None)
        if scale is not None:
            out["loss_scale"] = float(scale)
    return out


def _export(task: TrainTask, engine, rank: int, destination: str) -> dict[str, str]:
    """Rank 0 exports the model with fp32 weights and uploads it; returns destination paths.

    Under ZeRO-3 each rank holds a slice of every parameter, so all ranks gather the
    full weights for the duration of the export.
    """

    import deepspeed

    gather = (
        deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
        if engine.zero_optimization_stage() == 3
        else contextlib.nullcontext()
    )
    with gather:
        if rank != 0:
            return {}
        module = engine.module
        if any(p.dtype != torch.float32 for p in module.parameters()):
            module = copy.deepcopy(module).float()
        with tempfile.TemporaryDirectory(prefix="raydense-export-") as tmp:
            paths = task.export(module, tmp)
            storage.upload_dir(tmp, destination)
            uploaded = {
                k: storage.join(destination, os.path.relpath(v, tmp)) if v.startswith(tmp) else v
                for k, v in paths.items()
            }
    return uploaded | {"export_dir": destination}


def _flush_trace(trace: list, run_dir: str, rank: int, state: TrainState) -> list:
    """Write the data trace gathered since the last flush (``train.data_trace``): one
    ``[micro_step, epoch, rows]`` entry per micro-batch trained on. Flushed before every
    checkpoint, so the record of a killed attempt survives up to its last checkpoint; an
    audit independent of the data position that checkpoints carry."""
    if trace:
        name = f"rank{rank}-attempt{state.restarts}-upto{state.micro_step:09d}.json"
        storage.write_json(storage.join(run_dir, "trace", name), trace)
    return []


# -- the driver side ---------------------------------------------------------------------


REPORT_POLL_S = 0.1
HEALTH_POLLS_PER_S = 20  # the controller's polls of all workers together, at most (once past 2 workers)


def health_check_interval(workers: int) -> float:
    """Seconds between Ray Train's health checks of each worker: ``REPORT_POLL_S`` for a
    couple of workers, then longer so that the controller polls the group about
    ``HEALTH_POLLS_PER_S`` times a second (128 workers: 6.4 s, where 0.1 s would be 1,280
    polls a second), and at most 10 s."""
    return round(min(10.0, max(REPORT_POLL_S, workers / HEALTH_POLLS_PER_S)), 3)


def _fit_interruptibly(trainer: TorchTrainer):
    """``trainer.fit()`` on a thread of its own. On the main thread, Ray Train installs a
    SIGINT handler that turns Ctrl-C into an aborted run, which the job then reports as a
    failure (exit 1, Ray's advice, no resume hint). Here Ctrl-C stays Python's
    KeyboardInterrupt in the main thread: the job exits 130 with the resume hint at once, and
    the run's actors end with the driver (what was checkpointed stays)."""
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)  # a timed join: Ctrl-C interrupts it
    except KeyboardInterrupt:
        # The run's actors go now: left to the interpreter's exit, the workers train on for
        # seconds and their forwarded lines follow the resume hint.
        ray.shutdown()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def worker_resources(train: TrainConfig) -> dict[str, float]:
    return {"CPU": train.cpus_per_worker, "GPU": 1.0 if train.use_gpu else 0.0}


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


def _raise_user_error(marker: str) -> None:
    """A worker's deterministic error, raised here as what it was (a job exits 2 on it)."""
    if storage.exists(marker):
        error = storage.read_json(marker)
        kind = {cls.__name__: cls for cls in DETERMINISTIC}.get(error["kind"], ArtifactError)
        raise kind(error["message"])


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
            storage_filesystem=loc.fs if storage.is_s3(train.output) else None,
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
    storage.delete_file(marker)  # an earlier run's: this one may have been given the fix
    try:
        result = _fit_interruptibly(trainer)
    except ray.train.TrainingFailedError as exc:
        _raise_user_error(marker)
        fed = fed_user_error(exc)  # a marker the worker could not write (a full disk)
        if fed is not None:
            raise fed from None
        raise
    _raise_user_error(marker)
    checkpoint = result.checkpoint.path if result.checkpoint else None
    history = (result.return_value or {}).get("history", [])
    done = FitResult(dict(result.metrics or {}), checkpoint, run_dir, history)
    storage.write_json(
        storage.join(run_dir, FINISHED),
        {"checkpoint_dir_name": restorable_checkpoint(run_dir), **asdict(done)},
    )
    return done


FINISHED = "finished.json"


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
