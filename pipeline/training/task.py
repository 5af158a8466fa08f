"""What every trainer shares around the loop: the task's defaults and the run's summary.

A trainer (pre-training, fine-tuning, the re-ranker, distillation) is a config and a
``run_*`` function that hands :func:`pipeline.training.driver.fit` a task. :class:`Task`
holds what the four tasks have in common; :func:`run_summary` and :func:`write_summary`
are the summary every trainer writes as ``summary.json``.
"""

from __future__ import annotations

import numpy as np
import torch

from models.grad_cache import check_cacheable
from models.memory import ActivationCost
from models.objective import Objective
from pipeline.core import model_ref, storage
from pipeline.core.plots import plot_loss_curve
from pipeline.training.driver import FitResult


def consumed_source_rows(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, row) of every source row of a batch whose examples list theirs in ``source_rows``."""
    sources = list(batch["source_rows"])
    counts = np.array([len(s) for s in sources], dtype=np.int64)
    rows = np.concatenate(sources).astype(np.int64) if sources else np.zeros(0, np.int64)
    return np.repeat(np.asarray(batch["epoch"]), counts), rows


# What the loop reports at the end of a run, copied into every trainer's summary.
RUN_METRICS = (
    "export_dir",
    "steps",
    "final_loss",
    "tokens_per_s",
    "tokens_per_s_per_worker",
    "restarts",
    "resumes",
    "preemptions",
    "steps_this_attempt",
    "micro_batch_size",
    "grad_accum",
)
FINISHED_METRICS = ("already_finished", "resumed_from")  # a rerun of a finished run (driver.finished_run)


class Task:
    """The defaults of a task (the loop's ``TrainTask``): no event counters, the consumed rows
    that the stream lists per example, what its objective sizes from memory, and the
    tokenizer fetched once per worker for the export. Built on each worker from picklable
    settings."""

    counter_names: tuple[str, ...] = ()
    tokenizer_uri: str
    objective: Objective  # what computes the loss: a pre-training method, a retriever's or re-ranker's objective

    def counters(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        return {}

    def consumed_rows(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return consumed_source_rows(batch)

    def fit_to_memory(self, engine, available_bytes: int, micro_batch_size: int) -> dict:
        """The gradient cache's chunk, for an objective that has one (coCondenser's, the
        retriever's) and an engine under which it can run (not fp16). Every rank takes the
        smallest of any rank's: under ZeRO-3 each chunk's forward gathers the weights from
        all ranks, so they must run as many chunks."""
        try:
            check_cacheable(engine)
        except ValueError:  # fp16: no cache unless one is asked for (then refused)
            return {}
        chunk = self.objective.fit_chunk(engine.module, available_bytes, micro_batch_size)
        if chunk is None:  # no gradient cache in this objective
            return {}
        if torch.distributed.is_initialized():
            whole = 2**31 - 1  # chunk 0 (no cache) is the largest choice, not the smallest
            agreed = torch.tensor([chunk or whole], dtype=torch.long, device=engine.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            chunk = 0 if int(agreed) == whole else int(agreed)
            self.objective.chunk_size = chunk
        return {"grad_cache_chunk": chunk or None, "free_memory_gib": round(available_bytes / 2**30, 2)}

    def activation_cost(self, module: torch.nn.Module) -> ActivationCost | None:
        # Only an objective whose loss reads each row alone has one (the re-ranker's): in-batch
        # negatives couple a micro-batch's rows, which then stays as configured.
        return self.objective.activation_cost(module)

    def tokenizer_dir(self) -> str:
        if getattr(self, "_tokenizer_dir", None) is None:  # needed until the final export
            self._tokenizer_dir = model_ref.materialize(self.tokenizer_uri, "tokenizer")
        return self._tokenizer_dir


def run_summary(job: str, result: FitResult, **fields) -> dict:
    """A trainer's summary: the loop's end-of-run metrics and checkpoint, then ``fields``."""
    return {
        "job": job,
        **{key: result.metrics.get(key) for key in RUN_METRICS},
        **{key: result.metrics[key] for key in FINISHED_METRICS if key in result.metrics},
        "checkpoint": result.checkpoint,
        **fields,
    }


def write_summary(output: str, summary: dict, result: FitResult, title: str) -> dict:
    """The loss curve (``loss_curve.png``) and ``summary.json`` of a run under ``output``."""
    summary["loss_curve"] = plot_loss_curve(result.history, storage.join(output, "loss_curve.png"), title=title)
    storage.write_json(storage.join(output, "summary.json"), summary)
    return summary
