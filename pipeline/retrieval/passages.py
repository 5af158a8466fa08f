"""Passage texts served by Ray actors, so workers join ids to texts without the driver.

Stages that need candidates' texts (re-ranker scoring: the teacher) get ids from a run;
the texts of tens of millions of passages must not pass through, or sit in, the driver.
:class:`PassageStore` cuts the corpus into text shards in the run's storage and starts one
:class:`PassageServer` actor per shard, each holding its shard's ids and texts as arrays
and reserving that memory from Ray. A worker asks every server for a block's ids
(:func:`fetch_texts`); each answers for the ids it holds.
"""

from __future__ import annotations

import resource

import numpy as np
import ray

from pipeline.core import storage
from pipeline.data.corpus import CorpusStats
from pipeline.data.corpus_ids import CorpusIds, id_keys
from pipeline.data.text_shards import read_text_shard, write_text_shards
from pipeline.retrieval.fanout import ShardActors

SERVER_CPUS = 0.01  # a token share, as searchers take (see pipeline.retrieval.search.searcher_options)
PROCESS_BYTES = 512 * 2**20
TEXT_OVERHEAD = 2  # a shard's texts, and the ids and their sort order: about twice the text bytes


class PassageServer:
    """A Ray actor holding one text shard: doc ids (sorted for lookup) and texts (Arrow)."""

    def __init__(self, item: dict):
        table = read_text_shard(item)
        self.ids = CorpusIds(
            table.column("doc_id").cast("binary").to_numpy(zero_copy_only=False).astype(bytes),
            storage.resolve(item["text_uri"]).describe(),
        )
        self.texts = table.column("text").combine_chunks()

    def texts_of(self, keys: np.ndarray) -> tuple[np.ndarray, list[str | None]]:
        """For each id (bytes), whether this shard holds it, and its text (None if not)."""
        rows = self.ids.find(keys)
        held = rows >= 0
        texts = self.texts.take(np.where(held, rows, 0)).to_pylist()
        return held, [t if h else None for t, h in zip(texts, held)]

    def stats(self) -> dict:
        return {
            "passages": len(self.ids),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }


def fetch_texts(servers: list, doc_ids: list[str]) -> list[str | None]:
    """The texts of ``doc_ids`` (None for an id no server holds), asked of every server:
    called inside workers, with the servers' handles."""
    keys = id_keys(doc_ids)
    texts: list[str | None] = [None] * len(doc_ids)
    for held, found in ray.get([s.texts_of.remote(keys) for s in servers]):
        for i in np.flatnonzero(held):
            texts[i] = found[i]
    return texts


class PassageStore(ShardActors):
    """The driver's handle: the corpus staged as text shards under ``staging`` (run storage,
    deleted once loaded), one :class:`PassageServer` per shard. Close it (or use ``with``)."""

    def __init__(self, corpus: str, staging: str, docs_per_shard: int = 2_000_000):
        self.corpus_stats = CorpusStats()
        items = write_text_shards(corpus, staging, docs_per_shard, stats=self.corpus_stats)
        server = ray.remote(PassageServer)
        self.actors = [
            server.options(num_cpus=SERVER_CPUS, memory=PROCESS_BYTES + TEXT_OVERHEAD * item["text_bytes"]).remote(item)
            for item in items
        ]
        self.shards = ray.get([s.stats.remote() for s in self.actors])  # every server has read its shard
        storage.delete_dir(staging)
