"""One driver per run: a lease in the run's output that a job's driver takes before any work.

Two drivers writing one output erase each other's stage records, write the same checkpoint
folders and delete parts the other is joining (a ``ray job submit`` that lost its terminal
leaves its job running, and the same command submitted again starts a second). So every job
takes ``<output>/driver.lease.json`` first: who holds it (the Ray job, host, process) and a
heartbeat the holder renews. It is taken with an exclusive create, on S3 a conditional
write (``If-None-Match: *``), locally ``O_EXCL``; renewed and taken over with a write
conditioned on what was read (``If-Match`` on the ETag; locally under a file lock), so two
drivers can never both believe they hold it.

A second driver on a live lease is refused, naming the holder; a lease whose heartbeat is
older than ``RAYDENSE_LEASE_STALE_S`` (its driver was killed, or its head lost) is taken
over, saying so; ``--force`` takes a live one, and the driver that held it stops at its
next heartbeat.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import hashlib
import json
import os
import posixpath
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from pipeline.core import storage
from pipeline.core.errors import LeaseHeld

LEASE = "driver.lease.json"
# How often the holder renews its heartbeat, and how old a heartbeat is before the lease
# counts as abandoned; the ratio leaves several missed renewals (a throttled S3) in between.
TIMINGS = {"RAYDENSE_LEASE_HEARTBEAT_S": "15", "RAYDENSE_LEASE_STALE_S": "120"}


def _seconds(name: str) -> float:
    return float(os.environ.get(name) or TIMINGS[name])


def lease_uri(output: str) -> str:
    """Where the lease of a job writing ``output`` lives: inside the folder, or beside a
    file output (``negatives.jsonl``)."""
    name = posixpath.basename(str(output).rstrip("/"))
    if "." in name.lstrip("."):
        return f"{output}.{LEASE}"
    return storage.join(output, LEASE)


@dataclass
class Holder:
    token: str
    job: str  # the Ray job's submission id, or "" for a job started by hand
    host: str
    pid: int
    command: str
    started: float
    heartbeat: float

    @classmethod
    def this_process(cls) -> Holder:
        now = time.time()
        return cls(
            token=uuid.uuid4().hex,
            job=os.environ.get("RAY_JOB_SUBMISSION_ID", ""),
            host=socket.gethostname(),
            pid=os.getpid(),
            command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])[:300],
            started=now,
            heartbeat=now,
        )

    def describe(self) -> str:
        who = f"Ray job {self.job}, " if self.job else ""
        return f"{who}pid {self.pid} on {self.host} ({self.command}), last heartbeat {time.time() - self.heartbeat:.0f} s ago"

    def how_to_stop(self) -> str:
        return f"`ray job stop {self.job}`" if self.job else f"`kill {self.pid}` on {self.host}"


class _LocalLease:
    """The lease as a local file: created with O_EXCL, replaced under a lock of this node
    (local outputs are a single node's: :func:`pipeline.core.runtime.check_outputs_shared`),
    kept outside the output so that a job that wrote nothing leaves no folder."""

    def __init__(self, uri: str):
        import filelock

        self.path = uri
        name = hashlib.sha1(uri.encode()).hexdigest()[:16]
        self.lock = filelock.FileLock(os.path.join(tempfile.gettempdir(), f"raydense-lease-{name}.lock"))
        self.made_folder = ""

    def create(self, body: bytes) -> bool:
        folder = os.path.dirname(self.path)
        if not os.path.isdir(folder):
            os.makedirs(folder)
            self.made_folder = folder
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        return True

    def read(self) -> tuple[bytes, str] | None:
        try:
            with open(self.path, "rb") as f:
                body = f.read()
        except FileNotFoundError:
            return None
        return body, body.decode("utf-8", "replace")

    def replace(self, body: bytes, expected: str) -> bool:
        with self.lock:
            found = self.read()
            if found is None or found[1] != expected:
                return False
            storage.write_bytes(self.path, body)
            return True

    def delete(self, expected: str) -> None:
        with self.lock:
            found = self.read()
            if found is not None and found[1] == expected:
                os.remove(self.path)
        if self.made_folder:
            with contextlib.suppress(OSError):  # the job wrote something there: it stays
                os.rmdir(self.made_folder)


@functools.lru_cache(maxsize=4)
def _s3_client(endpoint: str | None, _pid: int):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def _precondition_failed(exc: BaseException) -> bool:
    """A conditional write refused: the object is not the version named (412), or is gone
    (an ``If-Match`` on a deleted object: 404)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    code = response.get("Error", {}).get("Code", "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "412", "NoSuchKey", "404") or status in (404, 412)


class _S3Lease:
    """The lease as an S3 object, written only on a condition: that none exists
    (``If-None-Match: *``) or that it is still the version read (``If-Match``)."""

    def __init__(self, uri: str):
        self.uri = uri
        self.bucket, _, self.key = uri[len("s3://") :].partition("/")

    @property
    def client(self):
        return _s3_client(storage.s3_endpoint(), os.getpid())

    def _put(self, body: bytes, **condition) -> bool:
        try:
            storage.retrying(
                f"write {self.uri}",
                lambda: self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, **condition),
            )
        except Exception as exc:
            if _precondition_failed(exc):
                return False
            raise
        return True

    def create(self, body: bytes) -> bool:
        return self._put(body, IfNoneMatch="*")

    def read(self) -> tuple[bytes, str] | None:
        def get():
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=self.key)
            except self.client.exceptions.NoSuchKey:
                return None
            return answer["Body"].read(), answer["ETag"]

        return storage.retrying(f"read {self.uri}", get)

    def replace(self, body: bytes, expected: str) -> bool:
        return self._put(body, IfMatch=expected)

    def delete(self, expected: str) -> None:
        found = self.read()
        if found is not None and found[1] == expected:
            storage.delete_file(self.uri)


class DriverLease:
    """The lease of the run in ``output``: :meth:`acquire` before any work, :meth:`release`
    after; a thread renews it meanwhile, and stops this driver (as Ctrl-C does) if another
    took the lease over."""

    def __init__(self, output: str, *, force: bool = False):
        self.uri = lease_uri(storage.resolve(output).uri)
        self.store = _S3Lease(self.uri) if storage.is_s3(self.uri) else _LocalLease(self.uri)
        self.force = force
        self.holder = Holder.this_process()
        self.version = ""  # what we last wrote, as the store names it (ETag or content)
        self.lost_to: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps(asdict(self.holder), sort_keys=True).encode("utf-8")

    def _held(self) -> tuple[Holder | None, str]:
        found = self.store.read()
        if found is None:
            return None, ""
        body, version = found
        try:
            return Holder(**json.loads(body)), version
        except (ValueError, TypeError):  # unreadable: whoever wrote it is no driver of ours
            return Holder("", "", "?", 0, "an unreadable lease", 0.0, 0.0), version

    def _written(self) -> None:
        found = self.store.read()
        self.version = found[1] if found else ""

    def acquire(self) -> str:
        """Take the lease; returns a line to print when it was taken over ("" otherwise).
        A live lease of another driver raises :class:`LeaseHeld`, unless ``force``."""
        for _ in range(3):  # a lease released between our create and read: create again
            if self.store.create(self._body()):
                self._written()
                self._start_heartbeat()
                return ""
            held, version = self._held()
            if held is None:
                continue
            if held.token == self.holder.token:  # our create landed, its answer was lost
                self.version = version
                self._start_heartbeat()
                return ""
            age, stale_s = time.time() - held.heartbeat, _seconds("RAYDENSE_LEASE_STALE_S")
            if age < stale_s and not self.force:
                raise LeaseHeld(
                    f"{self.uri}: another driver is running this run: {held.describe()}. Stop it "
                    f"({held.how_to_stop()}) and run this command again, or add --force to take the run over"
                )
            if not self.store.replace(self._body(), version):
                continue  # someone else replaced it first: look again
            self._written()
            self._start_heartbeat()
            why = "--force" if age < stale_s else f"its heartbeat is {age:.0f} s old, past RAYDENSE_LEASE_STALE_S"
            return f"took the run over from the driver that held it ({held.describe()}): {why}"
        raise LeaseHeld(f"{self.uri}: other drivers keep taking this run's lease; stop them and run this command again")

    def renew(self) -> bool:
        """One heartbeat; False when another driver holds the lease now."""
        self.holder.heartbeat = time.time()
        if self.store.replace(self._body(), self.version):
            self._written()
            return True
        held, _ = self._held()
        if held is not None and held.token == self.holder.token:  # our write landed, unanswered
            self._written()
            return True
        if held is None and self.store.create(self._body()):  # deleted (the job cleared its output): ours again
            self._written()
            return True
        self.lost_to = held
        return False

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="driver-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(_seconds("RAYDENSE_LEASE_HEARTBEAT_S")):
            try:
                if self.renew():
                    continue
            except Exception as exc:  # noqa: BLE001 - a missed heartbeat; the next may land
                print(f"driver lease {self.uri}: heartbeat failed ({exc}); trying again", file=sys.stderr, flush=True)
                continue
            holder = self.lost_to.describe() if self.lost_to else "a driver that took it and let it go"
            print(
                f"error: {self.uri}: another driver took this run over ({holder}); this one stops",
                file=sys.stderr,
                flush=True,
            )
            _thread.interrupt_main()  # stops the job where Ctrl-C would: committed work is kept
            return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost_to is None and self.version:
            self.store.delete(self.version)

    def __enter__(self) -> DriverLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
