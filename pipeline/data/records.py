"""Validated line records: the line reading every input format shares (corpora, queries,
qrels, runs, negatives, Tevatron files).

Each yields or raises with the file and its 1-based line, so a bad record anywhere is
reported the same way
(:class:`pipeline.core.errors.InputError`). A name ending in ``.gz`` is gzip.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from typing import Any, BinaryIO, Iterable, Iterator

from pipeline.core import storage
from pipeline.core.errors import InputError, StorageError, TransientStorageError

_CHUNK = 1 << 20
_GZIP = zlib.MAX_WBITS | 16  # zlib's wbits for a gzip header and trailer
_SPAN_CHUNK = 8 << 20  # a ranged GET each on S3: few and large


def _split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from lines
    if pending:
        yield pending


def _gzip_chunks(source: str) -> Iterator[bytes]:
    # Opened without pyarrow's own on-the-fly decompression, so that we decompress exactly once.
    raw = storage.open_input(source)
    # Inflated as it arrives, so a file cut short yields every whole line before the cut
    # (its error then names the line where the data ends, not the first of a read).
    with raw:
        inflate, fed = zlib.decompressobj(_GZIP), False
        while chunk := raw.read(_CHUNK):
            while chunk:
                fed = True
                yield inflate.decompress(chunk)
                if not inflate.eof:
                    break
                # One member ended: the next of a concatenated gzip starts in what is left.
                chunk, inflate, fed = inflate.unused_data, zlib.decompressobj(_GZIP), False
        if fed and not inflate.eof:
            raise EOFError("the file ends before its compressed data does (cut short?)")


def _span_lines(source: str, start: int, end: int) -> Iterator[bytes]:
    """The lines of an uncompressed file that start at a byte in ``[start, end)``: a piece of
    a file another reader reads on from ``end``. The line holding byte ``start - 1`` is the
    previous piece's, so reading begins there and drops through its newline."""
    with storage.open_input(source, random_access=True) as f:
        at = max(start - 1, 0)
        f.seek(at)
        pending, dropping = b"", start > 0
        while at < end:
            chunk = f.read(_SPAN_CHUNK)
            if not chunk:
                break
            pending += chunk
            if dropping:
                cut = pending.find(b"\n")
                if cut < 0:
                    at, pending = at + len(pending), b""
                    continue
                at, pending, dropping = at + cut + 1, pending[cut + 1 :], False
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if at >= end:
                    return
                yield line
                at += len(line) + 1
        if pending and not dropping and at < end:
            yield pending


def count_line_starts(source: str, start: int, end: int) -> int:
    """How many lines of an uncompressed file start at a byte in ``[start, end)`` (the lines
    :func:`numbered_lines` yields for that span), counted without splitting them. ``end``
    is at most the file's size (a newline ending the file starts no line: it is byte
    ``size - 1``, never read here)."""
    if start >= end:
        return 0
    count = int(start == 0)
    with storage.open_input(source, random_access=True) as f:
        at = max(start - 1, 0)
        f.seek(at)
        while at < end - 1:  # a newline at p starts a line at p + 1, so p runs to end - 2
            chunk = f.read(min(_SPAN_CHUNK, end - 1 - at))
            if not chunk:
                break
            count += chunk.count(b"\n")
            at += len(chunk)
    return count


def numbered_lines(source: str, span: tuple[int, int, int] | None = None) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes without "\\n" or a trailing "\\r"). ``span``, for an
    uncompressed file: ``(start, end, first_line)``, only the lines starting at a byte in
    ``[start, end)``, the first of them numbered ``first_line``."""
    gz = source.lower().endswith(".gz")
    if span is not None:
        lines = _span_lines(source, span[0], span[1])
    else:
        lines = _split_lines(_gzip_chunks(source)) if gz else storage.iter_lines(source, chunk_size=_CHUNK)
    number = 0 if span is None else span[2] - 1
    while True:
        try:
            raw = next(lines)
        except StopIteration:
            return
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise InputError(
                f"{source} line {number + 1}: corrupt gzip data ({exc})", source=source, line=number + 1
            ) from exc
        number += 1
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        yield number, raw


def decode_line(source: str, number: int, raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{source} line {number}: invalid UTF-8 at byte offset {exc.start} of the line "
            f"(byte 0x{raw[exc.start]:02x}: {exc.reason})",
            source=source,
            line=number,
        ) from exc
    if number == 1 and text.startswith("\ufeff"):
        text = text[1:]
    return text


_JSON_TYPES = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def read_lines(uri: str) -> Iterator[tuple[str, int, str]]:
    """(file, 1-based number, text) of each non-blank line; a ``*.gz`` file is gunzipped."""
    source = storage.resolve(uri).uri
    try:
        for number, raw in numbered_lines(source):
            text = decode_line(source, number, raw)
            if text.strip():
                yield source, number, text
    except OSError as exc:
        if isinstance(exc, (StorageError, TransientStorageError)):
            raise
        raise InputError(f"{source}: cannot read ({exc})", source=source) from exc


def line_error(source: str, number: int, problem: str) -> InputError:
    """An error at a line of a text file, or at a row of a Parquet file (numbered from 1)."""
    unit = "row" if source.lower().endswith(".parquet") else "line"
    return InputError(f"{source} {unit} {number}: {problem}", source=source, line=number)


def json_lines(uri: str) -> Iterator[tuple[str, int, dict]]:
    """(file, 1-based number, object) of each record: a JSONL file's lines, or a Parquet
    file's rows (read a row group at a time; nested lists and structs as lists and dicts),
    so every record format reads from either, with errors naming the line or row."""
    if uri.lower().endswith(".parquet"):
        yield from _parquet_rows(uri)
        return
    for source, number, text in read_lines(uri):
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise line_error(source, number, f"malformed JSON ({getattr(exc, 'msg', exc)})") from exc
        if not isinstance(obj, dict):
            raise line_error(source, number, f"expected a JSON object, got {json_type(obj)}")
        yield source, number, obj


def _parquet_rows(uri: str) -> Iterator[tuple[str, int, dict]]:
    import pyarrow.parquet as pq

    source = storage.resolve(uri).uri
    number = 0
    with storage.open_input(source, random_access=True) as f:
        file = pq.ParquetFile(f)
        for group in range(file.num_row_groups):
            for row in file.read_row_group(group).to_pylist():
                number += 1
                yield source, number, row


def as_id(value: Any, what: str, source: str, number: int) -> str:
    """An id: a non-empty string or a finite number (BEIR files use both), as str."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (str, int, float))
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise line_error(source, number, f"{what} must be a string or a number, got {json_type(value)}")
    if not str(value):
        raise line_error(source, number, f"{what} is empty")
    return str(value)


def get_field(
    obj: dict, key: str, kind: type | None, source: str, number: int, *, default: Any = ..., ctx: str = ""
) -> Any:
    """Field ``key`` of ``obj``, checked to be a ``kind`` (None: an id). ``ctx`` prefixes messages."""
    if key not in obj:
        if default is not ...:
            return default
        raise line_error(source, number, f"{ctx}missing field {key!r}")
    if kind is None:
        return as_id(obj[key], f"{ctx}field {key!r}", source, number)
    if not isinstance(obj[key], kind):
        expected = {str: "a string", list: "an array"}[kind]
        raise line_error(source, number, f"{ctx}field {key!r} must be {expected}, got {json_type(obj[key])}")
    return obj[key]


def check_new(seen: dict[str, int], key: str, what: str, source: str, number: int) -> None:
    if key in seen:
        raise line_error(source, number, f"duplicate {what} {key!r} (first at line {seen[key]})")
    seen[key] = number


def write_json_line(out: BinaryIO, obj: dict) -> None:
    out.write(json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n")
