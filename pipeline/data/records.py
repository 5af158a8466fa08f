"""Validated line records: the reading helpers every retrieval file format shares.

Each yields or raises with the file and its 1-based line, so a bad record anywhere in
queries, qrels, runs, negatives or Tevatron files is reported the same way
(:class:`pipeline.core.errors.InputError`). A name ending in ``.gz`` is gzip.
"""

from __future__ import annotations

import json
import math
from typing import Any, BinaryIO, Iterator

from pipeline.core import storage
from pipeline.core.errors import InputError, StorageError
from pipeline.data.corpus import decode_line, json_type, numbered_lines


def read_lines(uri: str) -> Iterator[tuple[str, int, str]]:
    """(file, 1-based number, text) of each non-blank line. The corpus reader's line reader
    gunzips ``*.jsonl.gz`` itself; pyarrow detects other ``*.gz`` names (e.g. ``qrels.tsv.gz``)."""
    source = storage.resolve(uri).uri
    try:
        for number, raw in numbered_lines(source):
            text = decode_line(source, number, raw)
            if text.strip():
                yield source, number, text
    except OSError as exc:
        if isinstance(exc, StorageError):
            raise
        raise InputError(f"{source}: cannot read ({exc})", source=source) from exc


def line_error(source: str, number: int, problem: str) -> InputError:
    return InputError(f"{source} line {number}: {problem}", source=source, line=number)


def json_lines(uri: str) -> Iterator[tuple[str, int, dict]]:
    for source, number, text in read_lines(uri):
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise line_error(source, number, f"malformed JSON ({getattr(exc, 'msg', exc)})") from exc
        if not isinstance(obj, dict):
            raise line_error(source, number, f"expected a JSON object, got {json_type(obj)}")
        yield source, number, obj


def as_id(value: Any, what: str, source: str, number: int) -> str:
    """An id: a non-empty string or a finite number (BEIR files use both), as str."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise line_error(source, number, f"{what} must be a string or a number, got {json_type(value)}")
    if not str(value):
        raise line_error(source, number, f"{what} is empty")
    return str(value)


def get_field(obj: dict, key: str, kind: type | None, source: str, number: int, *,
         default: Any = ..., ctx: str = "") -> Any:
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
