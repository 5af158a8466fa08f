"""Pre-training documents built from consecutive short records (verses into passages).

coCondenser draws its two spans from one document, and a document of one Bible verse
(~35 tokens) cannot hold two spans of useful length. A pre-training corpus may differ from
the retrieval corpus, so preparation can join consecutive records that share a group key
(the chapter of a verse id: ``Gen.1.7`` -> ``Gen.1``) into passages of at most
``max_words`` words. A passage never crosses a group boundary, and a group longer than
``max_words`` is cut into consecutive passages; the retrieval corpus is left as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

from pipeline.core.errors import ConfigError, InputError
from pipeline.data.corpus import Document


@dataclass
class JoinConfig:
    group_by: str = field(
        default="",
        metadata={
            "help": "regex over a record's id whose first group is its group (e.g. '^(.+)\\.\\d+$': a verse's chapter); consecutive records of a group are joined into passages; empty = every record is a document"
        },
    )
    max_words: int = field(
        default=128, metadata={"help": "words per joined passage at most (a longer group is cut into several)"}
    )

    def __post_init__(self):
        if self.group_by:
            try:
                pattern = re.compile(self.group_by)
            except re.error as exc:
                raise ConfigError(f"--corpus.join.group_by {self.group_by!r}: not a regex ({exc})") from exc
            if pattern.groups < 1:
                raise ConfigError(f"--corpus.join.group_by {self.group_by!r}: needs a group, e.g. '^(.+)\\.\\d+$'")
        if self.max_words < 1:
            raise ConfigError(f"--corpus.join.max_words must be >= 1, got {self.max_words}")


def join_consecutive(documents: Iterator[Document], cfg: JoinConfig) -> Iterator[Document]:
    """Passages of consecutive documents of one group, each ``first_id..last_id``.

    A single record longer than ``max_words`` stays whole (it is never split mid-record).
    An id the pattern does not match is an error naming its file and line.
    """
    if not cfg.group_by:
        yield from documents
        return
    pattern = re.compile(cfg.group_by)
    parts: list[Document] = []
    group, words = None, 0

    def passage() -> Document:
        doc_id = parts[0].doc_id if len(parts) == 1 else f"{parts[0].doc_id}..{parts[-1].doc_id}"
        return Document(doc_id, " ".join(p.text.strip() for p in parts), parts[0].source, parts[0].line)

    for doc in documents:
        match = pattern.search(doc.doc_id)
        if match is None:
            raise InputError(
                f"{doc.source} line {doc.line}: id {doc.doc_id!r} does not match --corpus.join.group_by "
                f"{cfg.group_by!r}",
                source=doc.source,
                line=doc.line,
            )
        length = len(doc.text.split())
        if parts and (match.group(1) != group or words + length > cfg.max_words):
            yield passage()
            parts, words = [], 0
        parts.append(doc)
        group, words = match.group(1), words + length
    if parts:
        yield passage()
