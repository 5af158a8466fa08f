"""Settings sections several jobs share, declared once.

A job's config composes them (its dataclass derives from the section, so the options keep
their names: ``--data.query_max_len``), and a workflow hands one job's values to the next
with :meth:`Section.values_of`, not field by field. A job whose defaults differ (the
training queries, not the dev ones; its own output folder) derives from
:meth:`Section.with_defaults`, which changes the defaults and keeps each option's help.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.sample import (
    SAMPLE_CORPUS,
    SAMPLE_DEV_QRELS,
    SAMPLE_DEV_QUERIES,
    SAMPLE_TRAIN_QRELS,
    SAMPLE_TRAIN_QUERIES,
)


class Section:
    @classmethod
    def values_of(cls, source: Any) -> dict[str, Any]:
        """This section's fields as ``source`` (any config composing it) holds them: the
        values themselves, so a nested section passes as the same object."""
        return {f.name: getattr(source, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def with_defaults(cls, *, notes: dict[str, str] | None = None, **defaults: Any) -> type:
        """This section with other defaults: a base class for a job's config. ``notes``
        add what an option means in that job to its help (``"empty = none"``)."""
        notes = notes or {}
        declared = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = (set(defaults) | set(notes)) - set(declared)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
        namespace: dict[str, Any] = {"__annotations__": {}, "__doc__": cls.__doc__}
        for name, base in declared.items():
            if name not in defaults and name not in notes:
                continue
            text = base.metadata.get("help", "")
            metadata = {**base.metadata, "help": f"{text}; {notes[name]}" if name in notes else text}
            if name in defaults:
                kept = {"default": defaults[name]}
            elif base.default is dataclasses.MISSING:
                kept = {"default_factory": base.default_factory}
            else:
                kept = {"default": base.default}
            namespace["__annotations__"][name] = base.type
            namespace[name] = field(**kept, metadata=metadata)  # type: ignore[call-overload]
        return dataclass(type(cls.__name__, (cls,), namespace))


@dataclass
class Lengths(Section):
    """How many tokens a query and a passage keep: what a retriever was trained with is what
    it encodes and searches with."""

    query_max_len: int = field(default=32, metadata={"min": 3, "help": "query tokens, [CLS] and [SEP] included"})
    passage_max_len: int = field(default=128, metadata={"min": 3, "help": "passage tokens, [CLS] and [SEP] included"})


@dataclass
class Queries(Section):
    """Queries and their judgments, in BEIR layout. The defaults are the bundled sample's
    dev split."""

    queries: str = field(
        default=SAMPLE_DEV_QUERIES,
        metadata={"help": "BEIR queries.jsonl or MS MARCO's queries.*.tsv (id<TAB>text); local or s3://"},
    )
    qrels: str = field(
        default=SAMPLE_DEV_QRELS,
        metadata={
            "help": "BEIR qrels TSV (header optional) or TREC's four columns (MS MARCO's qrels.*.tsv); local or s3://: a score > 0 marks a positive"
        },
    )


@dataclass
class Corpus(Section):
    corpus: str = field(
        default=SAMPLE_CORPUS,
        metadata={
            "help": "BEIR corpus.jsonl, MS MARCO's collection.tsv (id<TAB>text), .txt, .gz or a folder; local or s3://"
        },
    )


@dataclass
class Collection(Queries, Corpus):
    """A retrieval collection in BEIR layout: the passages, the queries and their judgments."""


# The defaults of a section that reads training queries: the bundled sample's training split.
TRAINING_SPLIT: dict[str, Any] = {"queries": SAMPLE_TRAIN_QUERIES, "qrels": SAMPLE_TRAIN_QRELS}

# What a trainer on query groups reads: the training queries and their judgments.
TrainingQueries = Queries.with_defaults(**TRAINING_SPLIT)


def training_queries() -> Queries:
    """The bundled sample's training split."""
    return Queries(**TRAINING_SPLIT)


@dataclass
class Output(Section):
    """Where a job writes: a folder, or a file where the job writes one."""

    output: str = field(default="runs/out", metadata={"help": "where the job writes (local or s3://)"})
