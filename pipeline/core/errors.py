"""The errors raydense raises on purpose: each names what is wrong and where.

    RaydenseError           anything below: a job prints its message without a traceback
    ├── ConfigError         a configuration key, value or file (names the key and its source)
    ├── InputError          user data: a corpus, queries, qrels, runs, negatives (file and line)
    ├── ArtifactError       something raydense wrote earlier is missing, unfinished or corrupt
    │                       (corpus, embedding or index shards, manifests, checkpoints)
    ├── StorageError        a path or URI cannot be read or written (missing, denied, bad scheme)
    │   └── OutOfSpace      a disk or quota is full: retrying cannot help
    ├── LeaseHeld           another driver is running the same run (names it and how to stop it)
    ├── TransientStorageError  object storage kept answering with throttling, server errors
    │                       or resets past the retry budget: not the user's (exit 1), and
    │                       a stage retry or a training restart takes it (``retryable``)
    ├── CapacityError       the actors or workers a stage asked for were never placed within
    │                       their wait (names the resources; exit 1: not the input's fault)
    └── ServerError         a server actor kept dying, never came up, or stopped answering
                            (names the server, its node and the cause; exit 1, not 2)

``InputError`` and ``ConfigError`` are also ``ValueError`` and ``StorageError`` is also an
``OSError``, so callers written against the built-in kinds keep working.
"""

from __future__ import annotations


class RaydenseError(Exception):
    """Base of raydense's own errors. ``source`` and ``line`` say where, when known."""

    exit_code = 2  # a job's exit status for it: 2 is the user's to mend, as a bad option
    # Whether running the same work again may succeed: False for the user's mistakes and for
    # damage, which fail the same way every time, so no retry is spent on them.
    retryable = False

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None):
        super().__init__(message)
        self.source = source
        self.line = line

    def __reduce__(self):  # keep source/line when pickled (raised inside a Ray task or actor)
        return (_rebuild, (type(self), str(self), self.source, self.line))


def _rebuild(cls: type[RaydenseError], message: str, source: str | None, line: int | None) -> RaydenseError:
    return cls(message, source=source, line=line)


class ConfigError(RaydenseError, ValueError):
    """A configuration key, value or file is wrong; the message says which and where from."""


class InputError(RaydenseError, ValueError):
    """Bad user data. The message names the file and, where there is one, the 1-based line."""


class ArtifactError(RaydenseError):
    """A stored artifact (shards, manifests, indexes, checkpoints) is missing, unfinished or
    corrupt. The message names it and says how to rebuild it."""


class StorageError(RaydenseError, OSError):
    """A path or URI cannot be reached, read or written."""


class OutOfSpace(StorageError):
    """A disk or quota filled up while writing: the job ends (a retry would fill it again),
    naming where; what was finished is kept for the rerun. ``where`` is the file or folder
    named (None where the library that wrote said none), ``detail`` its own words."""

    where: str | None = None
    detail: str = ""


class LeaseHeld(RaydenseError):
    """Another live driver holds the run's lease (:mod:`pipeline.core.lease`): two drivers
    would write one run."""


class TransientStorageError(RaydenseError, OSError):
    """Object storage kept failing transiently (throttling, 5xx, resets, timeouts) for longer
    than the retry budget (``RAYDENSE_S3_RETRY_SECONDS``). Deliberately not a
    :class:`StorageError`: code that turns a missing or unreadable object into the user's
    error (a damaged shard, a bad model path) must never catch this one."""

    exit_code = 1
    retryable = True


class CapacityError(RaydenseError):
    """What a stage asked of the cluster (actors, workers) was not placed within its wait,
    counted from the cluster's last change: named, with what the cluster has."""

    exit_code = 1


class ServerError(RaydenseError):
    """A server actor (a searcher, a BM25 shard, a passage server) died past its restarts,
    was not up within its timeout, or answered no block within the stall timeout. Not the
    user's input, but a failure that repeats: the job ends with this one line."""

    exit_code = 1
