"""One way to address storage: a local path or an ``s3://bucket/key`` URI.

Every stage reads and writes through ``pyarrow.fs`` so that Ray Data, Ray Train's
``storage_path`` and our own manifests see the same filesystem object. S3 settings
(endpoint, region, credentials) come from the environment only: ``AWS_ENDPOINT_URL``
(or ``AWS_ENDPOINT_URL_S3``) for S3-compatible stores, ``AWS_DEFAULT_REGION`` /
``AWS_REGION``, and the standard AWS credential chain. Credentials are never passed
to the filesystem object, so they never end up pickled into Ray tasks or checkpoints.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import posixpath
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.core.errors import StorageError


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _s3_filesystem() -> pafs.S3FileSystem:
    endpoint = s3_endpoint()
    kwargs: dict[str, Any] = dict(
        region=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
        connect_timeout=float(os.environ.get("RAYDENSE_S3_CONNECT_TIMEOUT", "5")),
        request_timeout=float(os.environ.get("RAYDENSE_S3_REQUEST_TIMEOUT", "120")),
        retry_strategy=pafs.AwsStandardS3RetryStrategy(
            max_attempts=int(os.environ.get("RAYDENSE_S3_MAX_ATTEMPTS", "3"))
        ),
    )
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    return pafs.S3FileSystem(**kwargs)


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
    return Location(path, pafs.LocalFileSystem(), path)


def join(uri: str, *parts: str) -> str:
    uri = str(uri)
    if is_s3(uri):
        return posixpath.join(uri.rstrip("/"), *parts)
    return os.path.join(uri, *parts)


def _wrap(loc: Location, action: str, exc: Exception) -> StorageError:
    hint = ""
    text = str(exc)
    if is_s3(loc.uri) and ("NETWORK_CONNECTION" in text or "connect" in text.lower()):
        hint = " (S3 endpoint unreachable: check AWS_ENDPOINT_URL and the network)"
    return StorageError(f"cannot {action} {loc.describe()}{hint}: {text}")


def info(uri: str) -> pafs.FileInfo:
    loc = resolve(uri)
    try:
        return loc.fs.get_file_info(loc.path)
    except Exception as exc:  # pyarrow raises OSError subclasses with AWS detail
        raise _wrap(loc, "stat", exc) from exc


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
    try:
        with loc.fs.open_input_stream(loc.path) as f:
            return f.read()
    except FileNotFoundError as exc:
        raise StorageError(f"{loc.describe()}: no such file") from exc
    except Exception as exc:
        raise _wrap(loc, "read", exc) from exc


# An S3 stream is read in GETs of this size: unbuffered, each read of the caller is one
# (FAISS reads an IVF index two small reads a list: ~2,000 GETs for a shard of 1,024 lists).
STREAM_BUFFER = 8 << 20


def open_input(uri: str, *, random_access: bool = False):
    """A binary input stream (pyarrow NativeFile, usable as a file object), read ahead in
    :data:`STREAM_BUFFER` pieces; with ``random_access``, a file to read at any offset
    (``read_at``; on S3, a ranged GET a read)."""
    loc = resolve(uri)
    try:
        if random_access:
            return loc.fs.open_input_file(loc.path)
        return loc.fs.open_input_stream(loc.path, buffer_size=STREAM_BUFFER)
    except FileNotFoundError as exc:
        raise StorageError(f"{loc.describe()}: no such file") from exc
    except Exception as exc:
        raise _wrap(loc, "open", exc) from exc


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole object. Local writes go through a rename so readers never see half a file."""
    loc = resolve(uri)
    try:
        if isinstance(loc.fs, pafs.LocalFileSystem):
            os.makedirs(os.path.dirname(loc.path), exist_ok=True)
            tmp = f"{loc.path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, loc.path)
        else:
            with loc.fs.open_output_stream(loc.path) as f:
                f.write(data)
    except Exception as exc:
        raise _wrap(loc, "write", exc) from exc


@contextmanager
def open_output(uri: str) -> Iterator[BinaryIO]:
    """A binary stream that becomes ``uri`` (local or S3) only if the block succeeds, gzip-compressed
    when the name ends in ``.gz``. It is written to a local temporary file first, so a failed job
    leaves no half-written output, and large outputs are never held in memory."""
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
            try:
                pafs.copy_files(tmp, loc.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=loc.fs)
            except Exception as exc:
                raise StorageError(f"cannot write {loc.describe()}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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


def list_files(uri: str, suffix: str = "") -> list[str]:
    """Files below ``uri`` (recursive), as URIs of the same kind, sorted."""
    loc = resolve(uri)
    try:
        infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True, allow_not_found=True))
    except Exception as exc:
        raise _wrap(loc, "list", exc) from exc
    paths = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(suffix))
    return [("s3://" + p) if is_s3(uri) else p for p in paths]


def file_sizes(uri: str) -> dict[str, int]:
    """Every file below the folder ``uri`` (recursive) by its path relative to it: its size
    in bytes, from one listing."""
    loc = resolve(uri)
    try:
        infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True, allow_not_found=True))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError subclasses and ArrowInvalid
        raise _wrap(loc, "list", exc) from exc
    return {posixpath.relpath(i.path, loc.path): i.size for i in infos if i.type == pafs.FileType.File}


def version(uri: str) -> str:
    """What is stored at ``uri`` now (a file, or every file below a folder): a digest of the
    names, sizes and modification times. Anything rewritten at the same URI (a corpus cut
    short, a new export) is a new version, so work made from the old one is not reused."""
    loc = resolve(uri)
    try:
        top = loc.fs.get_file_info(loc.path)
        if top.type == pafs.FileType.NotFound:
            raise StorageError(f"{loc.describe()}: no such file or directory")
        if top.type == pafs.FileType.Directory:
            infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
        else:
            infos = [top]
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError subclasses and ArrowInvalid
        raise _wrap(loc, "list", exc) from exc
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
    try:
        if loc.fs.get_file_info(loc.path).type == pafs.FileType.File:
            loc.fs.delete_file(loc.path)
    except Exception as exc:
        raise _wrap(loc, "delete", exc) from exc


def delete_dir(uri: str) -> None:
    loc = resolve(uri)
    try:
        if loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound:
            loc.fs.delete_dir(loc.path)
    except Exception as exc:
        raise _wrap(loc, "delete", exc) from exc


def upload_dir(local_dir: str | os.PathLike, uri: str) -> str:
    """Copy a local directory to ``uri`` (local or S3); returns ``uri``."""
    loc = resolve(uri)
    if isinstance(loc.fs, pafs.LocalFileSystem):
        if os.path.abspath(local_dir) != loc.path:
            shutil.copytree(local_dir, loc.path, dirs_exist_ok=True)
        return loc.uri
    try:
        pafs.copy_files(
            str(local_dir), loc.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=loc.fs
        )
    except Exception as exc:
        raise _wrap(loc, "upload to", exc) from exc
    return loc.uri


def copy_dir(source: str, destination: str) -> str:
    """Copy the files under ``source`` to ``destination`` (each local or S3); returns it."""
    src, dst = resolve(source), resolve(destination)
    try:
        dst.fs.create_dir(dst.path, recursive=True)  # a local destination must be there first
        pafs.copy_files(src.path, dst.path, source_filesystem=src.fs, destination_filesystem=dst.fs)
    except Exception as exc:
        raise _wrap(src, f"copy to {dst.uri} from", exc) from exc
    return dst.uri


def download_dir(uri: str, local_dir: str | os.PathLike) -> str:
    loc = resolve(uri)
    if isinstance(loc.fs, pafs.LocalFileSystem):
        return loc.path
    os.makedirs(local_dir, exist_ok=True)
    try:
        pafs.copy_files(
            loc.path, str(local_dir), source_filesystem=loc.fs, destination_filesystem=pafs.LocalFileSystem()
        )
    except Exception as exc:
        raise _wrap(loc, "download", exc) from exc
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


def read_parquet(uri: str, columns: list[str] | None = None):
    """A whole Parquet file as a pyarrow Table (Parquet needs random access, not a stream)."""

    loc = resolve(uri)
    try:
        return pq.read_table(loc.path, filesystem=loc.fs, columns=columns)
    except FileNotFoundError as exc:
        raise StorageError(f"{loc.describe()}: no such file") from exc
    except Exception as exc:
        raise _wrap(loc, "read Parquet", exc) from exc
