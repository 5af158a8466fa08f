"""The one owner of a run's corpus: each tokenizer's prepared shards, prepared once per run.

A workflow (the recipe, the comparison) trains and evaluates several models on one corpus.
Every model with the same tokenizer reads the same token-id shards, so the corpus is
tokenized once per tokenizer, under ``<root>/<key of the tokenizer>``, and every stage after
the first (training, each evaluation's encoding) reads that folder. A folder is reused only
when its manifest records the same input and settings (``prepare_corpus``).
"""

from __future__ import annotations

import hashlib

from pipeline.core import model_ref, storage
from pipeline.data.prepare import PrepareConfig, prepare_corpus


def prepare_in(corpus: str, folder: str, tokenizer: str, docs_per_shard: int) -> str:
    """``corpus`` prepared in ``folder`` with ``tokenizer`` (a model reference), or the
    preparation already there. Its settings are recorded as a trainer records them (the input
    and the tokenizer resolved), so a trainer handed this folder reuses it, and so does this
    after a trainer prepared it."""
    prepare_corpus(
        PrepareConfig(
            input=storage.resolve(corpus).uri,
            output=folder,
            tokenizer=model_ref.check(tokenizer, "tokenizer"),
            docs_per_shard=docs_per_shard,
        )
    )
    return folder


class CorpusStore:
    def __init__(self, corpus: str, root: str, docs_per_shard: int):
        self.corpus, self.root, self.docs_per_shard = corpus, root, docs_per_shard

    def folder(self, tokenizer: str) -> str:
        """Where the corpus prepared with ``tokenizer`` (a model reference) lives."""
        return storage.join(self.root, hashlib.sha1(tokenizer.encode()).hexdigest()[:10])

    def prepared(self, tokenizer: str) -> str:
        """The folder of the corpus prepared with ``tokenizer``: prepared now if it is not yet."""
        return prepare_in(self.corpus, self.folder(tokenizer), tokenizer, self.docs_per_shard)
