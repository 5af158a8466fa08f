"""How a worker's failure reaches the job.

A deterministic error (a user's setting, a damaged input, a full disk) must end the job
with its own one line, once: Ray Train's retries are for lost workers and nodes, and
would redo the failing work ``max_failures`` times. The worker that meets one writes it
to a marker in the run folder, or in Ray's key-value store where that disk is full (every
worker of a later attempt stops at its start), and the driver raises it as what it was.
Anything else is Ray Train's to retry, sent so that its type and message survive the trip.
"""

from __future__ import annotations

import json
import re
import traceback
from typing import NoReturn

import torch
from ray import cloudpickle
from ray.experimental.internal_kv import (
    _internal_kv_del,
    _internal_kv_get,
    _internal_kv_initialized,
    _internal_kv_put,
)

from pipeline.core import storage
from pipeline.core.entry import FULL_DISK, out_of_space, user_error
from pipeline.core.errors import ArtifactError, ConfigError, InputError, OutOfSpace, RaydenseError, StorageError
from pipeline.training.train_config import TrainConfig

# Written by a worker that hit a user error or a corrupt input (a deterministic error): every
# worker of the next attempt stops at its start, so that Ray Train's retries (meant for lost
# workers and nodes) do not redo the failing work max_failures times.
USER_ERROR = "user_error.json"


DETERMINISTIC = (ConfigError, InputError, ArtifactError, OutOfSpace)


_REMOTE_USER_ERROR = re.compile(
    rf"^pipeline\.core\.errors\.({'|'.join(cls.__name__ for cls in DETERMINISTIC)}): (.+)$", re.MULTILINE
)


def fed_user_error(exc: BaseException, where: str | None = None) -> RaydenseError | None:
    """A deterministic error raised in a Ray Data task that fed this worker (a damaged corpus
    shard), or None. Ray Data wraps it in a UserCodeException whose cause does not survive
    the trip to the worker, only the remote traceback's text, which names it on a line of
    its own. A full disk the text alone names is said to be ``where`` (the run's folder)."""
    found = user_error(exc)
    if isinstance(found, OutOfSpace) and found.where is None and where:
        return out_of_space(where, found.detail)
    if isinstance(found, DETERMINISTIC):
        return found
    named = _REMOTE_USER_ERROR.findall(str(exc))
    if named:
        kind, message = named[-1]
        return {cls.__name__: cls for cls in DETERMINISTIC}[kind](message)
    full = [line for line in str(exc).splitlines() if any(reason in line for reason in FULL_DISK.values())]
    return out_of_space(where, full[-1].strip()) if full else None


# Where a marker goes when the run folder cannot take it (its disk is full: every attempt
# Ray Train started again met the same full disk, a traceback each): Ray's key-value store
# in the GCS, under the marker's URI, read and cleared with it.
MARKER_NAMESPACE = "raydense-user-errors"


def write_user_error(marker: str, exc: BaseException) -> None:
    record = {"kind": type(exc).__name__, "message": str(exc)}
    try:
        storage.write_json(marker, record)
    except StorageError:
        _internal_kv_put(marker, json.dumps(record), overwrite=True, namespace=MARKER_NAMESPACE)


def recorded_user_error(marker: str) -> dict | None:
    """The deterministic error a worker of this run recorded, from the run folder or, where
    that could not be written, from Ray's key-value store; None if none was."""
    if storage.exists(marker):
        return storage.read_json(marker)
    value = _internal_kv_get(marker, namespace=MARKER_NAMESPACE) if _internal_kv_initialized() else None
    return json.loads(value) if value else None


def forget_user_error(marker: str) -> None:
    """Clear an earlier run's record (this one may have been given the fix)."""
    storage.delete_file(marker)
    if _internal_kv_initialized():
        _internal_kv_del(marker, namespace=MARKER_NAMESPACE)


class WorkerError(RuntimeError):
    """A worker's exception that could not be sent to Ray Train's controller as it was: its
    type, message and traceback as text."""


def compile_error(exc: BaseException, train: TrainConfig | None) -> ConfigError | None:
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


def round_trips(exc: BaseException) -> bool:
    try:
        cloudpickle.loads(cloudpickle.dumps(exc))
    except Exception:
        return False
    return True


def raise_user_error(marker: str) -> None:
    """A worker's deterministic error, raised here as what it was (a job exits 2 on it)."""
    error = recorded_user_error(marker)
    if error is not None:
        kind = {cls.__name__: cls for cls in DETERMINISTIC}.get(error["kind"], ArtifactError)
        raise kind(error["message"])


def raise_from_worker(exc: Exception, marker: str, train: TrainConfig | None) -> NoReturn:
    """Raise what a worker's ``exc`` is to the job: a deterministic error (its own, one fed
    to it by a Ray Data task, or a failed torch.compile) recorded in ``marker`` first;
    anything else as it was, or as a :class:`WorkerError` where it would not survive the
    trip to Ray Train's controller."""
    if isinstance(exc, DETERMINISTIC):
        write_user_error(marker, exc)
        raise exc
    fed = fed_user_error(exc, marker.rsplit("/", 1)[0])  # the run folder
    if fed is not None:
        write_user_error(marker, fed)
        raise fed from None
    failed_compile = compile_error(exc, train)
    if failed_compile is not None:
        write_user_error(marker, failed_compile)
        raise failed_compile from exc
    if round_trips(exc):
        raise exc
    # Ray Train hands a worker's exception to its controller pickled; one that does not
    # come back (torch 2.11's Inductor raised such an AssertionError on an H200) reached
    # the driver as "a worker health check failed", its type and message lost.
    raise WorkerError(f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}") from None
