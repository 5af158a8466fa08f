"""One worker's run: Ray Train's ``train_loop_per_worker``.

A trainer (pre-training, fine-tuning, the re-ranker, distillation) differs only in the
*task* it hands the loop (:class:`pipeline.training.engine.TrainTask`): how to build the model, turn a streamed
batch into tensors, compute the loss, and export the result. The worker owns the rest:
the engine, the restored state and data position, the micro-batch sized from memory,
logging, preemption notices and checkpoints.

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

import functools
import itertools
import json
import logging
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import ray.train
import ray.train.torch
import torch
from ray import cloudpickle

from models.batches import to_device
from models.memory import ACTIVATION_SHARE, OPTIMIZER_BYTES_PER_PARAM, fitting_micro_batch, free_memory
from pipeline.core import sealed, storage
from pipeline.core.config import to_dict
from pipeline.data.position import read_position
from pipeline.training.batches import chained, collated, shard_batches, timed
from pipeline.training.checkpoints import Restored, TrainState, restore_checkpoint, save_checkpoint
from pipeline.training.engine import TrainTask, build_engine, export_model, mixed_precision_state
from pipeline.training.failures import USER_ERROR, raise_from_worker, recorded_user_error
from pipeline.training.profiling import StepProfiler
from pipeline.training.tracking import RunLog
from pipeline.training.train_config import TrainConfig


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


# Written by the driver on SIGTERM: the workers save a checkpoint at their next preemption
# check and end (pipeline.training.driver).
STOP_REQUEST = "stop_requested.json"


def train_worker(config: dict) -> dict:
    """Ray Train's train_loop_per_worker. ``config`` holds picklable settings only, or those
    settings pickled (what :func:`fit` hands Ray Train: see :func:`_sealed_for_workers`)."""
    if "pickled" in config:
        config = cloudpickle.loads(config["pickled"])
    _quiet_ray_train_reports()
    marker = storage.join(config["run_dir"], USER_ERROR)
    recorded = recorded_user_error(marker)
    if recorded is not None:
        return {"user_error": recorded}
    try:
        run = WorkerRun(config)
        for batch, tensors in run.batches():
            if run.state.step >= run.train.max_steps:
                break
            run.train_on(batch, tensors)
            if run.stopping:  # the driver was stopped: the checkpoint is saved, no export
                return {"stopped_at": run.state.step, "history": run.state.history}
        return run.finish()
    except Exception as exc:
        raise_from_worker(exc, marker, config.get("train"))


def _quiet_ray_train_reports() -> None:
    """Ray Train logs every report at INFO, its whole metrics dict included: each log step
    would appear twice. Its warnings from that module still show."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray version: its log lines stay
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _restore(engine, rank: int, run_dir: str, key: sealed.SealKey) -> Restored:
    """The checkpoint this start resumes from (state, data position), its resume event recorded."""
    restored = restore_checkpoint(engine, rank, run_dir, key)
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
        # In place: `timed` keeps adding to this window's `waited`.
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
        self.engine, self.scheduler = build_engine(
            self.train, self.task, config["deepspeed"], self.world, ctx.get_local_world_size()
        )
        # The driver's key (pipeline.core.sealed.seal_key): the same on every node.
        self.seal_key: sealed.SealKey = config["seal_key"]
        restored = _restore(self.engine, self.rank, self.run_dir, self.seal_key)
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
        self.stopping = False  # the driver asked the run to stop (STOP_REQUEST): saved, ending
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
        return timed(collated(batches, self.task.make_batch, seed_of, self.state.micro_step, ahead), self.window.waited)

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
        # The slowest step time and whether rank 0 found a stop request, agreed in one
        # collective: every rank saves and ends at the same step.
        asked = float(self.rank == 0 and storage.exists(storage.join(self.run_dir, STOP_REQUEST)))
        agreed = torch.tensor([(now - last_time) / max(1, state.step - last_step), asked], device=self.engine.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        self.next_check = state.step + steps_between_checks(check_s, float(agreed[0].item()))
        self.checked_at = (state.step, now)
        if agreed[1].item() > 0:
            self.stopping = True
            if self.rank == 0:
                log({"event": "stop_requested", "step": state.step, "saving": "checkpoint"})
            return True
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
            **mixed_precision_state(self.engine, self.train.precision),
            **{k: float(v) for k, v in self.extra.items()},
        }
        self.state.history.append(entry)
        ray.train.report(entry)  # every rank: Ray keeps rank 0's, for its dashboard and result
        if self.run_log is not None:
            log(self._progress() | entry)
            self.run_log.log(entry)
        window.reset()

    def _progress(self) -> dict:
        """Where the run stands, for the log line only: the step of how many, and the time
        left at this attempt's pace so far (its start, the join of the first epoch and the
        compile included: the estimate is high early on)."""
        done = self.state.step - self.start_step
        per_step = (time.perf_counter() - self.started) / max(done, 1)
        return {
            "step": self.state.step,
            "of": self.train.max_steps,
            "eta_s": round(per_step * max(0, self.train.max_steps - self.state.step)),
        }

    def _save(self, metrics: dict) -> None:
        self.trace = _flush_trace(self.trace, self.run_dir, self.rank, self.state)
        save_checkpoint(
            self.engine,
            self.state,
            self.position,
            self.rank,
            self.run_dir,
            metrics,
            self.seal_key,
            self.checkpoint_suffix,
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
        export = export_model(self.task, self.engine, self.rank, storage.join(self.train.output, "export"))
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
            save_checkpoint(
                self.engine,
                state,
                self.position,
                self.rank,
                self.run_dir,
                summary,
                self.seal_key,
                self.checkpoint_suffix,
            )
        else:
            ray.train.report(summary)
        # Ray Train V2 keeps only checkpoints' metrics in its Result; rank 0's return value is
        # the run's every log entry (every report), resumed attempts included.
        return {"history": state.history}


def _flush_trace(trace: list, run_dir: str, rank: int, state: TrainState) -> list:
    """Write the data trace gathered since the last flush (``train.data_trace``): one
    ``[micro_step, epoch, rows]`` entry per micro-batch trained on. Flushed before every
    checkpoint, so the record of a killed attempt survives up to its last checkpoint; an
    audit independent of the data position that checkpoints carry."""
    if trace:
        name = f"rank{rank}-attempt{state.restarts}-upto{state.micro_step:09d}.json"
        storage.write_json(storage.join(run_dir, "trace", name), trace)
    return []
