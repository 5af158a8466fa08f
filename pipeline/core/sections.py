"""Settings sections several jobs share, declared once.

A job's config composes them (its dataclass derives from the section, so the options keep
their names: ``--data.query_max_len``), and a workflow hands one job's values to the next
with :meth:`Section.values_of`, not field by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class Section:
    @classmethod
    def values_of(cls, source: Any) -> dict[str, Any]:
        """This section's fields as ``source`` (any config composing it) holds them: the
        values themselves, so a nested section passes as the same object."""
        return {f.name: getattr(source, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


@dataclass
class Lengths(Section):
    """How many tokens a query and a passage keep: what a retriever was trained with is what
    it encodes and searches with."""

    query_max_len: int = field(default=32, metadata={"help": "query tokens, [CLS] and [SEP] included"})
    passage_max_len: int = field(default=128, metadata={"help": "passage tokens, [CLS] and [SEP] included"})
