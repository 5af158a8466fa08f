"""Passage texts served by Ray actors, so workers join ids to texts without the driver.

Stages that need candidates' texts (re-ranker scoring: the teacher) get ids from a run;
the texts of tens of millions of passages must not pass through, or sit in, the driver.
:class:`PassageStore` serves the corpus's staged text shards (run storage:
:func:`pipeline.data.text_shards.stage_text`) with one :class:`PassageServer` actor per
load of consecutive shards, each holding its load's ids and texts as arrays and reserving
that memory from Ray. A worker asks every server for a block's ids
(:func:`fetch_texts`); each answers for the ids it holds.
"""

from __future__ import annotations

import functools
import resource
from typing import Callable

import numpy as np
import ray

from pipeline.core import storage
from pipeline.data.corpus_ids import CorpusIds, id_keys
from pipeline.data.text_shards import group_shards, read_text_load
from pipeline.retrieval.fanout import ShardActors

SERVER_CPUS = 0.01  # a token share, as searchers take (see pipeline.retrieval.search.plan_searchers)
PROCESS_BYTES = 512 * 2**20
TEXT_OVERHEAD = 2  # a shard's texts, and the ids and their sort order: about twice the text bytes


class PassageServer:
    """A Ray actor holding a load of text shards: doc ids (sorted for lookup) and texts (Arrow)."""

    def __init__(self, load: list[dict]):
        table = read_text_load(load)
        self.ids = CorpusIds(
            table.column("doc_id").cast("binary").to_numpy(zero_copy_only=False).astype(bytes),
            storage.resolve(load[0]["text_uri"]).describe(),
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
    """The driver's handle on a staged corpus (``text``: the manifest of ``stage_text``), one
    :class:`PassageServer` per ``docs_per_server`` documents. Close it (or use ``with``).

    Workers are handed the servers with each call (:meth:`call_with_servers`), not once
    for their lifetime: a server copied off a draining node then serves every call made
    after its copy has loaded."""

    label = "passages"

    def __init__(self, text: dict, docs_per_server: int = 2_000_000):
        server = ray.remote(PassageServer)
        self._serve(
            [
                functools.partial(
                    server.options(
                        num_cpus=SERVER_CPUS,
                        memory=PROCESS_BYTES + TEXT_OVERHEAD * sum(i["text_bytes"] for i in load),
                        **self.limits.actor_options(),
                    ).remote,
                    load,
                )
                for load in group_shards(text["shards"], docs_per_server)
            ]
        )
        self.shards = ray.get([s.stats.remote() for s in self.actors])  # every server has read its load
        self._calls: list[tuple[list, ray.ObjectRef]] = []  # (the servers a call was given, its ref)

    def call_with_servers(self, call: Callable[[list], ray.ObjectRef]) -> ray.ObjectRef:
        """``call(servers)``, a remote call whose worker reads texts from ``servers``, made
        with the servers as they are now (moved off draining nodes first); returns its ref.
        A server replaced meanwhile is let go only once the calls given it are back."""
        refs = [ref for _, ref in self._calls]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        self._calls = [(servers, ref) for servers, ref in self._calls if ref not in done]
        # Each call reads from every server it was given: it is owed by each of them.
        self._move_off_draining([(servers, [ref] * len(servers)) for servers, ref in self._calls])
        servers = list(self.actors)
        ref = call(servers)
        self._calls.append((servers, ref))
        return ref
