"""Reading and validating raw corpora.

A corpus is a local path or an ``s3://`` URI naming either one file or a directory (an S3
prefix), in which case every ``*.jsonl``, ``*.tsv`` and ``*.txt`` file (each also ``.gz``)
below it is read, in sorted order. Three formats, chosen by suffix:

- ``.jsonl``: BEIR corpus lines ``{"_id": str, "title": optional str, "text": str}``; extra
  keys are allowed, blank lines are ignored. The document text is ``f"{title}\\n{text}"``
  when the title is non-empty, else ``text``.
- ``.tsv``: MS MARCO's ``collection.tsv``, ``id<TAB>text`` a line, no header.
- ``.txt``: plain text, documents separated by one or more blank lines; the id of the n-th
  document (from 0) of ``notes.txt`` is ``"notes:n"``.
- ``.parquet``: a table with an id, an optional title and a text column, found by name
  (:data:`PARQUET_COLUMNS`) or named by a mapping (``id=docid,title=title,text=body``).
  Read a row group at a time, each row group a piece of its own; errors name the row.

``.gz`` files are decompressed on the fly. Files are streamed line by line, never read whole.

Every input line either becomes part of a document, is counted as skipped, is a blank line
(ignored), or raises :class:`InputError` with the file and 1-based line number in its message.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import pyarrow.fs as pafs

from pipeline.core import storage
from pipeline.core.errors import InputError
from pipeline.data.records import decode_line, json_type, line_error, numbered_lines

SUFFIXES = (".jsonl", ".jsonl.gz", ".tsv", ".tsv.gz", ".txt", ".txt.gz", ".parquet")
# A Parquet corpus's columns, where no mapping names them: the first of each present (BEIR
# on the Hugging Face hub: _id, title, text; Tevatron's corpora: docid, title, text).
PARQUET_COLUMNS = {
    "id": ("_id", "id", "docid", "doc_id", "pid"),
    "title": ("title",),
    "text": ("text", "contents", "passage"),
}
ON_EMPTY = ("skip", "error")
MAX_SKIPPED_EXAMPLES = 20


@dataclass
class CorpusStats:
    documents: int = 0
    skipped_empty: int = 0
    skipped_examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "documents": self.documents,
            "skipped_empty": self.skipped_empty,
            "skipped_examples": list(self.skipped_examples),
        }


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str
    source: str  # URI of the file it came from
    line: int  # 1-based line where the document starts


def corpus_files(uri: str) -> list[str]:
    """The corpus files ``uri`` names: itself if it is a file, else the matching files below it."""
    uri = str(uri)
    kind = storage.info(uri).type
    if kind == pafs.FileType.NotFound:
        raise InputError(f"{uri}: no such file or directory", source=uri)
    if kind == pafs.FileType.Directory:
        files = [f for f in storage.list_files(uri) if _suffix(f)]
        if not files:
            raise InputError(
                f"{uri}: directory holds no corpus files (expected {', '.join('*' + s for s in SUFFIXES)})", source=uri
            )
        return files
    source = storage.resolve(uri).uri
    if not _suffix(source):
        raise InputError(
            f"{source}: unsupported corpus file type (expected one of {', '.join(SUFFIXES)})", source=source
        )
    return [source]


def iter_documents(uri: str, *, on_empty: str = "skip", stats: CorpusStats | None = None) -> Iterator[Document]:
    """Stream the documents of the corpus at ``uri`` (file or directory, local or S3), validated.

    ``on_empty``: what to do with a document whose text is empty or whitespace only:
    ``"skip"`` (count it in ``stats.skipped_empty``) or ``"error"`` (raise InputError).
    Duplicate ids anywhere in the input are an error, raised once the stream has ended (the
    check keeps 8 bytes a document, not the ids: see ``IdHashes``).
    """
    if on_empty not in ON_EMPTY:
        raise ValueError(f"on_empty must be one of {ON_EMPTY}, got {on_empty!r}")
    return _iter_documents(str(uri), on_empty, stats if stats is not None else CorpusStats())


def _iter_documents(uri: str, on_empty: str, stats: CorpusStats) -> Iterator[Document]:
    files = corpus_files(uri)
    seen = IdHashes()
    for source in files:
        yield from piece_documents(Piece(source), on_empty, stats, seen)
    repeated = seen.repeated()
    if repeated:
        raise_duplicate(files, repeated)


@dataclass(frozen=True)
class Piece:
    """A part of one corpus file that one reader parses: the lines starting at a byte in
    ``[start, end)`` (``end`` None: the whole file), the first numbered ``first_line``."""

    source: str
    start: int = 0  # a Parquet file's: row groups [start, end), its first row numbered first_line
    end: int | None = None
    first_line: int = 1
    columns: str = ""  # a Parquet file's column mapping (see parquet_columns)

    @property
    def span(self) -> tuple[int, int, int] | None:
        return None if self.end is None else (self.start, self.end, self.first_line)


def corpus_pieces(uri: str, piece_bytes: int, columns: str = "") -> list[Piece]:
    """The corpus at ``uri`` in pieces of about ``piece_bytes``, in corpus order, for parallel
    readers. Only uncompressed JSONL and TSV files are cut (a line is a record); a gzip or
    ``.txt`` file (whose ids count its documents) is one piece. Every piece numbers its lines
    from 1 here: :func:`pipeline.data.text_shards` counts the lines before each cut and sets
    ``first_line``, so an error names the file's own line."""
    pieces: list[Piece] = []
    for source in corpus_files(uri):
        if is_parquet(source):
            pieces.extend(_row_group_pieces(source, columns))
            continue
        size = storage.info(source).size
        if _suffix(source) not in (".jsonl", ".tsv") or size <= piece_bytes:
            pieces.append(Piece(source))
            continue
        cuts = list(range(0, size, piece_bytes)) + [size]
        pieces.extend(Piece(source, a, b) for a, b in zip(cuts, cuts[1:]))
    return pieces


def is_parquet(source: str) -> bool:
    return _suffix(source) == ".parquet"


def _row_group_pieces(source: str, columns: str) -> list[Piece]:
    """A Parquet file's row groups, a piece each (its columns checked here, before any task)."""
    metadata = storage.read_parquet_metadata(source)
    parquet_columns(source, metadata.schema.names, columns)
    pieces, first = [], 1
    for group in range(metadata.num_row_groups):
        pieces.append(Piece(source, group, group + 1, first, columns))
        first += metadata.row_group(group).num_rows
    return pieces


def parquet_columns(source: str, names: list[str], mapping: str) -> dict[str, str | None]:
    """The id, title and text columns of a Parquet corpus: as ``mapping`` names them
    (``id=docid,title=title,text=body``; ``title=`` for none), else the first present of
    :data:`PARQUET_COLUMNS`. An unknown key or a column the file lacks is an error naming
    the file and its columns."""
    given: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in mapping.split(","))):
        key, eq, column = part.partition("=")
        if not eq or key.strip() not in PARQUET_COLUMNS:
            raise InputError(f"--corpus.columns {mapping!r}: {part!r} is not id=, title= or text=COLUMN", source=source)
        given[key.strip()] = column.strip()
    found: dict[str, str | None] = {}
    for key, candidates in PARQUET_COLUMNS.items():
        column = given.get(key, next((c for c in candidates if c in names), None))
        if column and column not in names:
            raise InputError(f"{source}: no column {column!r} for the {key} (it has {', '.join(names)})", source=source)
        if not column and key != "title":
            raise InputError(
                f"{source}: no {key} column (it has {', '.join(names)}; name it with --corpus.columns {key}=COLUMN)",
                source=source,
            )
        found[key] = column or None
    return found


def piece_documents(piece: Piece, on_empty: str, stats: CorpusStats, seen: IdHashes) -> Iterator[Document]:
    """The documents of one piece, validated, their ids added to ``seen`` (the caller checks
    those for duplicates once every piece is read); empty ones skipped or refused as
    :func:`iter_documents` says."""
    documents = (
        _parse_parquet(piece.source, piece.span, piece.columns)
        if is_parquet(piece.source)
        else _parser(piece.source)(piece.source, piece.span)
    )
    for doc in documents:
        seen.add(doc.doc_id)
        if not doc.text.strip():
            where = f"{doc.source} line {doc.line}: empty text (id {doc.doc_id})"
            if on_empty == "error":
                raise InputError(
                    f"{where}; pass on_empty='skip' to skip such documents", source=doc.source, line=doc.line
                )
            stats.skipped_empty += 1
            if len(stats.skipped_examples) < MAX_SKIPPED_EXAMPLES:
                stats.skipped_examples.append(where)
            continue
        stats.documents += 1
        yield doc


class IdHashes:
    """The ids seen so far as 8-byte hashes in numpy (8 bytes a document, where a set of the
    ids costs ~170): the duplicate check of a corpus of tens of millions of documents must not
    hold its ids on the driver. Checked once the stream ends; a repeated hash is then
    confirmed, and located, by a second pass over the files (a collision alone is no error)."""

    CHUNK = 1 << 16

    def __init__(self):
        self.chunks: list[np.ndarray] = []
        self.pending: list[int] = []

    def add(self, doc_id: str) -> None:
        self.pending.append(id_hash(doc_id))
        if len(self.pending) == self.CHUNK:
            self.chunks.append(np.array(self.pending, dtype=np.uint64))
            self.pending = []

    def array(self) -> np.ndarray:
        return np.concatenate(self.chunks + [np.array(self.pending, dtype=np.uint64)])

    def repeated(self) -> set[int]:
        return repeated_hashes([self.array()])


def repeated_hashes(arrays: list[np.ndarray]) -> set[int]:
    """The hashes that occur more than once across ``arrays``."""
    hashes = np.sort(np.concatenate(arrays)) if arrays else np.zeros(0, np.uint64)
    return set(hashes[1:][hashes[1:] == hashes[:-1]].tolist())


def id_hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")


def raise_duplicate(files: list[str], repeated: set[int]) -> None:
    """Raise for the first id that occurs twice among those whose hash is ``repeated``."""
    first: dict[str, tuple[str, int]] = {}
    for source in files:
        for doc in _parser(source)(source, None):
            if id_hash(doc.doc_id) not in repeated:
                continue
            if doc.doc_id in first:
                where = first[doc.doc_id]
                raise InputError(
                    f"duplicate id {doc.doc_id!r} at {doc.source} line {doc.line} (first at {where[0]} line {where[1]})",
                    source=doc.source,
                    line=doc.line,
                )
            first[doc.doc_id] = (doc.source, doc.line)


# ---------------------------------------------------------------- reading lines


def _suffix(uri: str) -> str:
    """The corpus suffix of ``uri`` ("" if it has none of SUFFIXES)."""
    name = posixpath.basename(uri.replace("\\", "/")).lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix) and len(name) > len(suffix):
            return suffix
    return ""


def _stem(source: str) -> str:
    name = posixpath.basename(source.replace("\\", "/"))
    return name[: len(name) - len(_suffix(source))]


# ---------------------------------------------------------------- formats


def _parser(source: str) -> Callable[[str, tuple[int, int, int] | None], Iterator[Document]]:
    return {".jsonl": _parse_jsonl, ".tsv": _parse_tsv, ".txt": _parse_txt, ".parquet": _parse_parquet}[
        _suffix(source).removesuffix(".gz")
    ]


def _parse_parquet(source: str, span: tuple[int, int, int] | None, columns: str = "") -> Iterator[Document]:
    """A Parquet corpus, a row group at a time: ``span`` = (first row group, end, its first
    row's number), or the whole file. A row's id must be a string or an integer, its text a
    string, its title a string or null."""
    import pyarrow.parquet as pq

    with storage.open_input(source, random_access=True) as f:
        file = pq.ParquetFile(f)
        names = parquet_columns(source, file.schema_arrow.names, columns)
        start, end, row = span if span is not None else (0, file.num_row_groups, 1)
        wanted = [c for c in names.values() if c]
        for group in range(start, end):
            table = file.read_row_group(group, columns=wanted)
            ids = table.column(names["id"]).to_pylist()
            texts = table.column(names["text"]).to_pylist()
            titles = table.column(names["title"]).to_pylist() if names["title"] else [None] * len(ids)
            for doc_id, title, text in zip(ids, titles, texts):
                yield _parquet_document(source, row, doc_id, title, text)
                row += 1


def _parquet_document(source: str, row: int, doc_id, title, text) -> Document:
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
        raise line_error(source, row, f"the id must be a non-empty string or an integer, got {json_type(doc_id)}")
    if not isinstance(text, str):
        raise line_error(source, row, f"the text must be a string, got {json_type(text)} (id {doc_id})")
    if title is not None and not isinstance(title, str):
        raise line_error(source, row, f"the title must be a string, got {json_type(title)} (id {doc_id})")
    return Document(str(doc_id), f"{title}\n{text}" if title and title.strip() else text, source, row)


def _parse_tsv(source: str, span: tuple[int, int, int] | None) -> Iterator[Document]:
    """MS MARCO's collection.tsv: ``id<TAB>text`` a line, no header."""
    for number, raw in numbered_lines(source, span):
        line = decode_line(source, number, raw).rstrip("\r\n")
        if not line.strip():
            continue
        doc_id, tab, text = line.partition("\t")
        if not tab or "\t" in text:
            raise line_error(
                source, number, f"expected 2 tab-separated columns (id, text), got {line.count(chr(9)) + 1}"
            )
        if not doc_id.strip():
            raise line_error(source, number, "empty id")
        yield Document(doc_id.strip(), text, source, number)


def _parse_jsonl(source: str, span: tuple[int, int, int] | None) -> Iterator[Document]:
    for number, raw in numbered_lines(source, span):
        line = decode_line(source, number, raw)
        if not line.strip():
            continue

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise line_error(source, number, f"malformed JSON ({exc.msg}: column {exc.colno})") from exc
        except RecursionError as exc:
            raise line_error(source, number, "malformed JSON (nested too deeply)") from exc
        if not isinstance(obj, dict):
            raise line_error(source, number, f"expected a JSON object, got {json_type(obj)}")

        if "_id" not in obj:
            raise line_error(source, number, "missing field '_id'")
        doc_id = obj["_id"]
        if (
            isinstance(doc_id, bool)
            or not isinstance(doc_id, (str, int, float))
            or (isinstance(doc_id, float) and not math.isfinite(doc_id))
        ):
            raise line_error(source, number, f"field '_id' must be a string or a number, got {json_type(doc_id)}")
        doc_id = str(doc_id)
        if not doc_id:
            raise line_error(source, number, "field '_id' is empty")

        if "text" not in obj:
            raise line_error(source, number, f"missing field 'text' (id {doc_id})")
        text = obj["text"]
        if not isinstance(text, str):
            raise line_error(source, number, f"field 'text' must be a string, got {json_type(text)} (id {doc_id})")

        title = obj.get("title")
        if title is not None and not isinstance(title, str):
            raise line_error(source, number, f"field 'title' must be a string, got {json_type(title)} (id {doc_id})")
        if title and title.strip():
            text = f"{title}\n{text}"
        yield Document(doc_id, text, source, number)


def _parse_txt(source: str, span: None) -> Iterator[Document]:
    stem = _stem(source)
    count = 0
    start = 0
    lines: list[str] = []
    for number, raw in numbered_lines(source):
        line = decode_line(source, number, raw)
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            yield Document(f"{stem}:{count}", "\n".join(lines), source, start)
            count += 1
            lines = []
    if lines:
        yield Document(f"{stem}:{count}", "\n".join(lines), source, start)
