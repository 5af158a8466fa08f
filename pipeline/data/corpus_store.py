"""The one owner of a run's corpus: its text staged once, and each tokenizer's prepared
shards, prepared once per run.

A workflow (the recipe, the comparison) trains and evaluates several models on one corpus.
The raw corpus is read and validated once, into text shards under ``<root>/text``
(:func:`pipeline.data.text_shards.stage_text`); BM25's shard actors, the passage servers
and every tokenizer's preparation read those. Every model with the same tokenizer reads the
same token-id shards, so the corpus is tokenized once per tokenizer, under
``<root>/<key of the tokenizer>``, and every stage after the first (training, each
evaluation's encoding) reads that folder. Both are reused only when their manifests record
the same stored version of the corpus and the same settings.
"""

from __future__ import annotations

import hashlib

from pipeline.core import model_ref, storage
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.data.shards import PreparedCorpus
from pipeline.data.text_shards import stage_text


def prepare_in(corpus: str, folder: str, tokenizer: str, docs_per_shard: int, text: str = "") -> PreparedCorpus:
    """``corpus`` prepared in ``folder`` with ``tokenizer`` (a model reference), or the
    preparation already there, reading the staged text in ``text`` (empty: staged for this
    preparation only). Its settings are recorded as a trainer records them (the input and the
    tokenizer resolved), so a trainer handed this folder reuses it, and so does this after a
    trainer prepared it."""
    return prepare_corpus(
        PrepareConfig(
            input=storage.resolve(corpus).uri,
            output=folder,
            tokenizer=model_ref.check(tokenizer, "tokenizer"),
            docs_per_shard=docs_per_shard,
            text=text,
        )
    )


class CorpusStore:
    def __init__(self, corpus: str, root: str, docs_per_shard: int):
        self.corpus, self.root, self.docs_per_shard = corpus, root, docs_per_shard
        self.text_folder = storage.join(root, "text")

    def text(self) -> dict:
        """The corpus's text shards (the manifest of :func:`stage_text`): staged now if not yet."""
        return stage_text(self.corpus, self.text_folder, self.docs_per_shard)

    def docs(self) -> int:
        """The corpus's document count (empty documents skipped, as every reader skips them)."""
        return self.text()["docs"]

    def folder(self, tokenizer: str) -> str:
        """Where the corpus prepared with ``tokenizer`` (a model reference) lives."""
        return storage.join(self.root, hashlib.sha1(tokenizer.encode()).hexdigest()[:10])

    def prepare(self, folder: str, tokenizer: str) -> PreparedCorpus:
        """The corpus prepared with ``tokenizer`` in ``folder`` from the staged text: prepared now if not yet."""
        return prepare_in(self.corpus, folder, tokenizer, self.docs_per_shard, self.text_folder)

    def prepared(self, tokenizer: str) -> PreparedCorpus:
        """The run's folder of the corpus prepared with ``tokenizer``: prepared now if not yet."""
        return self.prepare(self.folder(tokenizer), tokenizer)
