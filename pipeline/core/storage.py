"""One way to address storage: a local path or an ``s3://bucket/key`` URI.

Every stage reads and writes through ``pyarrow.fs`` so that Ray Data, Ray Train's
``storage_path`` and our own manifests see the same filesystem object. S3 settings
(endpoint, region, credentials) come from the environment only: ``AWS_ENDPOINT_URL``
(or ``AWS_ENDPOINT_URL_S3``) for S3-compatible stores, ``AWS_DEFAULT_REGION`` /
``AWS_REGION``, and the standard AWS credential chain. Credentials are never passed
to the filesystem object, so they never end up pickled into Ray tasks or checkpoints.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import os
import posixpath
import random
import re
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.core.errors import RaydenseError, StorageError, TransientStorageError


def cache_root() -> str:
    """This node's cache (models, checkpoint keys); ``RAYDENSE_CACHE`` moves it (e.g. to a
    node's NVMe)."""
    return os.environ.get("RAYDENSE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "raydense")


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


# The client's settings, from the environment of every process (a local Ray passes them to
# its workers, the cluster's pods set them): RETRY_SECONDS is how long one storage call keeps
# retrying transient faults (S3 throttles a prefix in bursts of seconds when its request
# rate grows); MAX_ATTEMPTS is the SDK's own quick retries inside each of ours.
S3_SETTINGS = {
    "RAYDENSE_S3_CONNECT_TIMEOUT": "5",
    "RAYDENSE_S3_REQUEST_TIMEOUT": "120",
    "RAYDENSE_S3_MAX_ATTEMPTS": "3",
    "RAYDENSE_S3_RETRY_SECONDS": "120",
}


def s3_setting(name: str) -> float:
    return float(os.environ.get(name) or S3_SETTINGS[name])


@functools.lru_cache(maxsize=8)
def _cached_s3_filesystem(key: tuple) -> pafs.S3FileSystem:
    endpoint, region, connect, request, attempts, _pid = key
    kwargs: dict[str, Any] = dict(
        region=region,
        connect_timeout=connect,
        request_timeout=request,
        # The SDK's default strategy (no retry quota, which a throttling storm drains) for
        # its quick retries; the budget is ours (:func:`retrying`).
        retry_strategy=pafs.AwsDefaultS3RetryStrategy(max_attempts=attempts),
    )
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    return pafs.S3FileSystem(**kwargs)


def _s3_filesystem(*, attempts: int | None = None) -> pafs.S3FileSystem:
    """This process's S3 filesystem for these settings, built once: each new one paid a
    connection and a credential lookup (under IRSA, a web-identity exchange) per call."""
    return _cached_s3_filesystem(
        (
            s3_endpoint(),
            os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
            s3_setting("RAYDENSE_S3_CONNECT_TIMEOUT"),
            s3_setting("RAYDENSE_S3_REQUEST_TIMEOUT"),
            int(attempts or s3_setting("RAYDENSE_S3_MAX_ATTEMPTS")),
            os.getpid(),
        )
    )


def sdk_retrying_filesystem() -> pafs.S3FileSystem:
    """An S3 filesystem for code that calls it without :func:`retrying` around each call
    (Ray Train's checkpoint uploads and run state): the SDK itself retries, with attempts
    enough that its doubling delays (25 ms, 50 ms, ...) add up to the retry budget."""
    budget, attempts = s3_setting("RAYDENSE_S3_RETRY_SECONDS"), 1
    while 0.025 * (2**attempts - 1) < budget:
        attempts += 1
    return _s3_filesystem(attempts=attempts + 1)


# Transient: throttling, server errors, resets and timeouts, by the HTTP status as well as by
# the error's name (a HEAD answered 503 has no body, and the SDK then names it UNKNOWN).
_TRANSIENT_STATUS = re.compile(r"HTTP status (?:429|5\d\d)\b|HTTPStatusCode.: (?:429|5\d\d)\b")
_TRANSIENT_NAMES = (
    "SLOW_DOWN",
    "SlowDown",
    "SERVICE_UNAVAILABLE",
    "ServiceUnavailable",
    "INTERNAL_FAILURE",
    "InternalError",
    "THROTTLING",
    "Throttling",
    "REQUEST_TIMEOUT",
    "RequestTimeout",
    "NETWORK_CONNECTION",
    "Connection reset",
    "Connection was reset",
    "connection was closed",
    "Broken pipe",
    "Timeout was reached",
    "timed out",
    "curlCode: 28",
    "curlCode: 52",
    "curlCode: 55",
    "curlCode: 56",
)
# Never transient, whatever else the text says: the object, the bucket or the right is missing.
_PERMANENT_NAMES = ("ACCESS_DENIED", "AccessDenied", "NO_SUCH_BUCKET", "NoSuchBucket", "NO_SUCH_KEY", "NoSuchKey")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (pyarrow's, botocore's or the socket's) is a fault that the same
    request may not meet again: throttling (SlowDown, 429, 503), a server error (500, 502,
    504), a reset connection or a timeout. Missing objects, denied access, bad buckets and
    invalid data are not."""
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, RaydenseError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    text = f"{type(exc).__name__}: {exc}"
    response = getattr(exc, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        error = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text += f" {error.get('Code', '')} HTTP status {status}"
    if any(name in text for name in _PERMANENT_NAMES):
        return False
    if type(exc).__name__ in ("EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError"):
        return True
    return bool(_TRANSIENT_STATUS.search(text)) or any(name in text for name in _TRANSIENT_NAMES)


@dataclass
class RetryCounts:
    """What this process's storage calls met: the benchmark and the tests read it."""

    transient: int = 0  # transient faults met
    backoff_s: float = 0.0  # seconds slept before a retry
    given_up: int = 0  # calls that failed past the budget


RETRIES = RetryCounts()
T = TypeVar("T")


def retrying(what: str, call: Callable[[], T]) -> T:
    """``call()`` (one idempotent storage operation: a read, listing, stat, whole-object
    write, delete), again after each transient fault, with exponential backoff and full
    jitter (AWS's advice to clients of a throttled service), until it succeeds or
    ``RAYDENSE_S3_RETRY_SECONDS`` have passed; then a :class:`TransientStorageError`,
    which a stage retry or a training restart takes. Any other error is raised at once."""
    budget = s3_setting("RAYDENSE_S3_RETRY_SECONDS")
    started, delay = time.monotonic(), 0.2
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc) or isinstance(exc, TransientStorageError):
                raise
            RETRIES.transient += 1
            left = budget - (time.monotonic() - started)
            if left <= 0:
                RETRIES.given_up += 1
                raise TransientStorageError(
                    f"cannot {what}: object storage kept failing transiently for {budget:g} s "
                    f"(RAYDENSE_S3_RETRY_SECONDS); the last error: {str(exc).strip()[:400]}"
                ) from exc
            pause = min(left, random.uniform(0, delay))
            RETRIES.backoff_s += pause
            time.sleep(pause)
            delay = min(delay * 2, 20.0)


LOCAL = pafs.LocalFileSystem()


@dataclass(frozen=True)
class Location:
    """A resolved URI: the filesystem and the path inside it."""

    uri: str
    fs: pafs.FileSystem
    path: str

    def describe(self) -> str:
        if is_s3(self.uri) and s3_endpoint():
            return f"{self.uri} (endpoint {s3_endpoint()})"
        return self.uri


def resolve(uri: str | os.PathLike) -> Location:
    uri = str(uri)
    if is_s3(uri):
        path = uri[len("s3://") :].rstrip("/")
        if not path:
            raise StorageError(f"{uri}: an S3 URI needs a bucket")
        return Location(uri, _s3_filesystem(), path)
    if "://" in uri:
        raise StorageError(f"{uri}: unsupported scheme (use a local path or s3://bucket/prefix)")
    path = str(Path(uri).expanduser().resolve())
    return Location(path, LOCAL, path)


def join(uri: str, *parts: str) -> str:
    uri = str(uri)
    if is_s3(uri):
        return posixpath.join(uri.rstrip("/"), *parts)
    return os.path.join(uri, *parts)


def _unreachable_hint(loc: Location, text: str) -> str:
    if is_s3(loc.uri) and ("NETWORK_CONNECTION" in text or "connect" in text.lower()):
        return " (S3 endpoint unreachable: check AWS_ENDPOINT_URL and the network)"
    return ""


def _wrap(loc: Location, action: str, exc: Exception) -> StorageError:
    text = str(exc)
    return StorageError(f"cannot {action} {loc.describe()}{_unreachable_hint(loc, text)}: {text}")


def _do(loc: Location, action: str, call: Callable[[], T]) -> T:
    """``call()`` on ``loc``'s filesystem: on S3 through :func:`retrying`; a missing file or
    any other permanent failure becomes a :class:`StorageError` naming ``loc``."""
    try:
        if isinstance(loc.fs, pafs.LocalFileSystem):
            return call()
        return retrying(f"{action} {loc.describe()}", call)
    except TransientStorageError as exc:
        hint = _unreachable_hint(loc, str(exc))
        raise (TransientStorageError(f"{exc}{hint}") if hint else exc) from exc.__cause__
    except RaydenseError:
        raise
    except FileNotFoundError as exc:
        raise StorageError(f"{loc.describe()}: no such file") from exc
    except Exception as exc:  # pyarrow raises OSError subclasses with AWS detail, and ArrowInvalid
        raise _wrap(loc, action, exc) from exc


def info(uri: str) -> pafs.FileInfo:
    loc = resolve(uri)
    return _do(loc, "stat", lambda: loc.fs.get_file_info(loc.path))


def exists(uri: str) -> bool:
    return info(uri).type != pafs.FileType.NotFound


def check_reachable(uri: str) -> None:
    """Fail fast, with the endpoint named, before any Ray work is scheduled."""
    info(uri)


def must_exist(uri: str, what: str) -> None:
    """A check before any work: ``what`` (the option that names ``uri``) is named when
    nothing is stored there."""
    if info(uri).type == pafs.FileType.NotFound:
        raise StorageError(f"{what} {resolve(uri).describe()}: no such file or directory")


def read_bytes(uri: str) -> bytes:
    loc = resolve(uri)

    def whole() -> bytes:
        with loc.fs.open_input_stream(loc.path) as f:  # a *.gz file comes back decompressed
            return f.read()

    return _do(loc, "read", whole)


# An S3 stream is read in GETs of this size: unbuffered, each read of the caller is one
# (FAISS reads an IVF index two small reads a list: ~2,000 GETs for a shard of 1,024 lists).
STREAM_BUFFER = 8 << 20


class RetryingInput:
    """A file on S3 read by ranged GETs, each one retried on its own (:func:`retrying`), so a
    throttled or reset read resumes at its offset instead of failing the whole stream; the
    file object the callers use (``read``, ``seek``, ``tell``, ``read_at``, ``size``).
    ``buffer`` bytes are read ahead on a sequential ``read`` (0: one GET a read)."""

    def __init__(self, loc: Location, buffer: int):
        self.loc, self.buffer = loc, buffer
        self.handle = _do(loc, "open", lambda: loc.fs.open_input_file(loc.path))  # its HEAD: the size
        self.length = self.handle.size()
        self.position, self.ahead, self.ahead_at = 0, b"", 0
        self.closed = False

    def _get(self, nbytes: int, offset: int) -> bytes:
        def ranged() -> bytes:
            # One handle for every GET (a new one costs a HEAD), opened again after a failure.
            if self.handle is None:
                self.handle = self.loc.fs.open_input_file(self.loc.path)
            try:
                return self.handle.read_at(nbytes, offset)
            except Exception:
                self.handle = None
                raise

        return _do(self.loc, "read", ranged) if nbytes > 0 else b""

    def read_at(self, nbytes: int, offset: int) -> bytes:
        return self._get(min(nbytes, max(self.length - offset, 0)), offset)

    def read(self, nbytes: int = -1) -> bytes:
        end = self.length if nbytes is None or nbytes < 0 else min(self.position + nbytes, self.length)
        start = self.position
        held = self.ahead_at <= start and start < self.ahead_at + len(self.ahead)
        if not (held and end <= self.ahead_at + len(self.ahead)):
            fetch_to = min(max(end, start + self.buffer), self.length)
            self.ahead, self.ahead_at = self._get(fetch_to - start, start), start
        data = self.ahead[start - self.ahead_at : end - self.ahead_at]
        self.position += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: offset, 1: self.position + offset, 2: self.length + offset}[whence]
        return self.position

    def tell(self) -> int:
        return self.position

    def size(self) -> int:
        return self.length

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.closed, self.ahead, self.handle = True, b"", None

    def __enter__(self) -> RetryingInput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_input(uri: str, *, random_access: bool = False):
    """A binary input file, read as stored (never decompressed), usable as a file object:
    sequential reads are read ahead in :data:`STREAM_BUFFER` pieces; with ``random_access``,
    each read is one ranged GET (``read_at`` reads at any offset). On S3 every GET is
    retried on its own (:class:`RetryingInput`)."""
    loc = resolve(uri)
    if not isinstance(loc.fs, pafs.LocalFileSystem):
        return RetryingInput(loc, 0 if random_access else STREAM_BUFFER)
    if random_access:
        return _do(loc, "open", lambda: loc.fs.open_input_file(loc.path))
    return _do(loc, "open", lambda: loc.fs.open_input_stream(loc.path, compression=None, buffer_size=STREAM_BUFFER))


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole object. Local writes go through a rename so readers never see half a
    file; an S3 object appears whole or not at all, and a retried write replaces it whole."""
    loc = resolve(uri)

    def put() -> None:
        if isinstance(loc.fs, pafs.LocalFileSystem):
            os.makedirs(os.path.dirname(loc.path), exist_ok=True)
            tmp = f"{loc.path}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, loc.path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        else:  # as given: pyarrow's default would gzip the bytes of a *.gz name (again)
            with loc.fs.open_output_stream(loc.path, compression=None) as f:
                f.write(data)

    _do(loc, "write", put)


@contextmanager
def open_output(uri: str) -> Iterator[BinaryIO]:
    """A binary stream that becomes ``uri`` (local or S3) only if the block succeeds, gzip-compressed
    when the name ends in ``.gz``. It is written to a local temporary file first, so a failed job
    leaves no half-written output (its upload retried whole), and large outputs are never held
    in memory."""
    loc = resolve(uri)
    local = isinstance(loc.fs, pafs.LocalFileSystem)
    if local:
        os.makedirs(os.path.dirname(loc.path), exist_ok=True)
    # Opened with open() rather than mkstemp, so the file gets the umask's permissions, not 0600.
    tmp = os.path.join(
        os.path.dirname(loc.path) if local else tempfile.gettempdir(),
        f".{os.path.basename(loc.path)}.tmp-{uuid.uuid4().hex[:8]}",
    )
    try:
        with open(tmp, "xb") as raw:
            if loc.path.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
                    yield gz  # type: ignore[misc]
            else:
                yield raw
        if local:
            os.replace(tmp, loc.path)
        else:
            _do(loc, "write", lambda: _upload_file(tmp, loc))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


COPY_CHUNK = 8 << 20


def _copy_file(source_fs: pafs.FileSystem, source: str, destination_fs: pafs.FileSystem, destination: str) -> None:
    """One file copied through streams closed here, so a failed upload raises: pyarrow's
    ``copy_files`` let an S3 upload whose part failed (SlowDown) be closed by its destructor,
    which ignored the error, and returned as if the object had been written."""
    if isinstance(destination_fs, pafs.LocalFileSystem):
        os.makedirs(os.path.dirname(destination), exist_ok=True)
    with source_fs.open_input_stream(source, compression=None, buffer_size=COPY_CHUNK) as src:
        out = destination_fs.open_output_stream(destination, compression=None)
        try:
            while chunk := src.read(COPY_CHUNK):
                out.write(chunk)
        finally:
            out.close()  # raises what the upload met (an S3 object appears only if all went)


def _upload_file(local_path: str, loc: Location) -> None:
    _copy_file(LOCAL, local_path, loc.fs, loc.path)


def _copy_tree(source: Location, destination: Location) -> None:
    """Every file below ``source`` to the same relative path below ``destination``, each
    copy retried on its own (:func:`_do`): a fault redoes one file, not the tree."""
    for info in _listing(source):
        if info.type == pafs.FileType.File:
            relative = posixpath.relpath(info.path, source.path)
            target = Location(
                join(destination.uri, relative), destination.fs, posixpath.join(destination.path, relative)
            )
            remote = target if not isinstance(destination.fs, pafs.LocalFileSystem) else source
            _do(remote, "copy", functools.partial(_copy_file, source.fs, info.path, target.fs, target.path))


def read_json(uri: str) -> Any:
    try:
        return json.loads(read_bytes(uri).decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise StorageError(f"{uri}: not valid JSON ({exc})") from exc


def write_json(uri: str, obj: Any, *, keep_same: bool = False) -> None:
    """``obj`` as JSON at ``uri``. ``keep_same``: leave the file as it is when it already
    holds exactly this, so its stored version (:func:`version`) stays: what was made from it
    is still current."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
    if keep_same and exists(uri) and read_bytes(uri) == data:
        return
    write_bytes(uri, data)


def read_array(uri: str) -> np.ndarray:
    """A ``.npy`` array as :func:`write_array` stored it, read with ``allow_pickle=False``:
    an object array (a pickle) in storage is refused, never run."""
    try:
        return np.load(io.BytesIO(read_bytes(uri)), allow_pickle=False)
    except ValueError as exc:
        raise StorageError(f"{uri}: not a plain .npy array ({exc})") from exc


def write_array(uri: str, array: np.ndarray) -> None:
    """``array`` as ``.npy`` at ``uri``, refusing object arrays (they would be pickles)."""
    with open_output(uri) as f:
        np.save(f, array, allow_pickle=False)


def _listing(loc: Location) -> list[pafs.FileInfo]:
    selector = pafs.FileSelector(loc.path, recursive=True, allow_not_found=True)
    return _do(loc, "list", lambda: loc.fs.get_file_info(selector))


def list_files(uri: str, suffix: str = "") -> list[str]:
    """Files below ``uri`` (recursive), as URIs of the same kind, sorted."""
    infos = _listing(resolve(uri))
    paths = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))
    return [("s3://" + p) if is_s3(uri) else p for p in paths]


def file_sizes(uri: str) -> dict[str, int]:
    """Every file below the folder ``uri`` (recursive) by its path relative to it: its size
    in bytes, from one listing."""
    loc = resolve(uri)
    return {posixpath.relpath(i.path, loc.path): i.size for i in _listing(loc) if i.type == pafs.FileType.File}


def version(uri: str) -> str:
    """What is stored at ``uri`` now (a file, or every file below a folder): a digest of the
    names, sizes and modification times. Anything rewritten at the same URI (a corpus cut
    short, a new export) is a new version, so work made from the old one is not reused."""
    loc = resolve(uri)
    top = info(uri)
    if top.type == pafs.FileType.NotFound:
        raise StorageError(f"{loc.describe()}: no such file or directory")
    infos = _listing(loc) if top.type == pafs.FileType.Directory else [top]
    files = sorted(
        (posixpath.relpath(i.path, loc.path) if i.path != loc.path else "", i.size, i.mtime_ns)
        for i in infos
        if i.type == pafs.FileType.File
    )
    if not files:
        raise StorageError(f"{loc.describe()}: no files stored there")
    return hashlib.sha256(repr(files).encode()).hexdigest()[:16]


def delete_file(uri: str) -> None:
    """Remove a file if it is there."""
    loc = resolve(uri)

    def remove() -> None:
        if loc.fs.get_file_info(loc.path).type == pafs.FileType.File:
            loc.fs.delete_file(loc.path)

    _do(loc, "delete", remove)


def delete_dir(uri: str) -> None:
    loc = resolve(uri)

    def remove() -> None:
        if loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound:
            loc.fs.delete_dir(loc.path)

    _do(loc, "delete", remove)


def upload_dir(local_dir: str | os.PathLike, uri: str) -> str:
    """Copy a local directory to ``uri`` (local or S3); returns ``uri``. A retried upload
    copies every file again: each object is replaced whole."""
    loc = resolve(uri)
    if isinstance(loc.fs, pafs.LocalFileSystem):
        if os.path.abspath(local_dir) != loc.path:
            shutil.copytree(local_dir, loc.path, dirs_exist_ok=True)
        return loc.uri
    _copy_tree(Location(str(local_dir), LOCAL, os.path.abspath(local_dir)), loc)
    return loc.uri


def copy_dir(source: str, destination: str) -> str:
    """Copy the files under ``source`` to ``destination`` (each local or S3); returns it."""
    src, dst = resolve(source), resolve(destination)
    if isinstance(dst.fs, pafs.LocalFileSystem):
        os.makedirs(dst.path, exist_ok=True)  # there, even for a source with no files
    _copy_tree(src, dst)
    return dst.uri


def download_dir(uri: str, local_dir: str | os.PathLike) -> str:
    loc = resolve(uri)
    if isinstance(loc.fs, pafs.LocalFileSystem):
        return loc.path
    os.makedirs(local_dir, exist_ok=True)
    _copy_tree(loc, Location(str(local_dir), LOCAL, os.path.abspath(local_dir)))
    return str(local_dir)


def read_manifest(folder_uri: str, fmt: str, error: type[Exception], missing: str, unfinished: str) -> dict:
    """A folder's ``manifest.json``, checked: present (else ``missing``), of format ``fmt``,
    and marked completed (else ``unfinished``); failures raise ``error`` naming the file."""
    uri = join(folder_uri, "manifest.json")
    check_reachable(uri)
    if not exists(uri):
        raise error(f"{uri}: no manifest; {missing}")
    manifest = read_json(uri)
    if manifest.get("format") != fmt:
        raise error(f"{uri}: format {manifest.get('format')!r}, expected {fmt!r}")
    if not manifest.get("completed"):
        raise error(f"{uri}: {unfinished}; run it again")
    return manifest


def iter_lines(uri: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """Raw lines (without the newline) of a local or S3 file, streamed."""
    with open_input(uri) as f:
        pending = b""
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            yield from lines
        if pending:
            yield pending


def read_parquet_metadata(uri: str) -> pq.FileMetaData:
    """A Parquet file's footer (its row count and schema), without its data."""
    loc = resolve(uri)
    return _do(loc, "read the Parquet footer of", lambda: pq.read_metadata(loc.path, filesystem=loc.fs))


def read_parquet(uri: str, columns: list[str] | None = None):
    """A whole Parquet file as a pyarrow Table (Parquet needs random access, not a stream);
    on S3 the whole read is retried after a transient fault."""
    loc = resolve(uri)
    return _do(loc, "read Parquet", lambda: pq.read_table(loc.path, filesystem=loc.fs, columns=columns))
