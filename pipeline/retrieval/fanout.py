"""The one sharded fan-out: a query block asked of every shard actor, the exact top-k merged.

Dense search (:class:`pipeline.retrieval.search.ShardedIndex`, one FAISS shard an actor) and
BM25 (:class:`pipeline.retrieval.bm25.ShardedBm25`, one text shard an actor) are both a
:class:`ShardFanout`: each actor answers ``search(block, k, ...)`` with its own top-k as
``(scores, rows, doc ids)`` and ``holds(keys)`` for the ids it serves; the driver puts each
block into the object store once, gathers every shard's answer and merges them
(:func:`merge_topk`). Each shard's top-k contains its share of the global one, so the merge
is exact. This module needs neither FAISS nor torch.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterator, Sequence

import numpy as np
import ray

from pipeline.core import storage
from pipeline.core.draining import DrainingNodes
from pipeline.core.errors import ConfigError, ServerError, TransientStorageError
from pipeline.core.progress import progress
from pipeline.data.beir import Judgments, read_qrels
from pipeline.retrieval import loading
from pipeline.retrieval.query_vectors import StoredQueryVectors

log = logging.getLogger(__name__)


def check_metric(metric: str) -> None:
    if metric not in ("ip", "l2"):
        raise ConfigError(f"metric {metric!r} is not one of ['ip', 'l2']")


def check_k(k: int, total: int) -> None:
    if k < 1:
        raise ConfigError(f"k={k} must be at least 1")
    if k > total:
        raise ConfigError(f"k={k} is larger than the corpus ({total} passages)")


def smallest(key: np.ndarray, k: int) -> np.ndarray:
    """Column indexes of each row's ``k`` smallest keys, ascending (argpartition: O(n), not a full sort)."""
    top = (
        np.argpartition(key, k - 1, axis=1)[:, :k]
        if k < key.shape[1]
        else np.broadcast_to(np.arange(key.shape[1]), key.shape)
    )
    return np.take_along_axis(top, np.argsort(np.take_along_axis(key, top, 1), axis=1, kind="stable"), 1)


def merge_topk(
    results: list[tuple[np.ndarray, ...]], k: int, metric: str = "ip", total: int | None = None
) -> tuple[np.ndarray, ...]:
    """Exact global top-k from per-shard top-k (each shard's top-k contains its share of the
    global one). Each result is ``(scores, rows, *columns)``: any further per-hit arrays (the
    hits' doc ids, say) are merged along. Padding (row -1) sorts last; ``total`` (the corpus
    size) bounds ``k``."""
    check_metric(metric)
    merged = [np.concatenate([r[i] for r in results], axis=1) for i in range(len(results[0]))]
    scores, rows = merged[0], merged[1]
    if total is not None:
        check_k(k, total)
    elif not 1 <= k <= rows.shape[1]:
        raise ValueError(f"k={k} is outside 1..{rows.shape[1]}, the number of results the shards returned")
    # One ascending key for both metrics; padding gets +inf so it never displaces a real hit.
    key = np.where(rows < 0, np.inf, -scores if metric == "ip" else scores)
    top = smallest(key, min(k, key.shape[1]))
    return tuple(np.take_along_axis(column, top, 1) for column in merged)


def held_by(actors: list, doc_ids: np.ndarray) -> np.ndarray:
    """Which of ``doc_ids`` (a bytes array) some shard actor holds, each answering
    ``holds(keys)`` for its own: a bool mask."""
    found = np.zeros(len(doc_ids), bool)
    for mask in ray.get([a.holds.remote(doc_ids) for a in actors]):
        found |= mask
    return found


def read_qrels_of_corpus(uri: str, holds: Callable[[np.ndarray], np.ndarray], query_ids: Container[str]) -> Judgments:
    """``read_qrels`` with its unknown-document check answered by ``holds`` (bytes ids ->
    which are held: a shard fan-out's ``holds``, or the prepared corpus's tasks), given the
    judged documents once each, so an unknown id is reported at its line as always, without
    the corpus's ids on the driver."""

    judged = read_qrels(uri, query_ids=query_ids)
    judged.check_documents(holds)
    return judged


def _merged_then(work: Callable, k: int, metric: str, total: int, args: tuple, *answers):
    """:meth:`ShardFanout.map_blocks`' task: the answers (Ray resolves the references passed
    as arguments) merged, then handed to ``work``."""
    scores, rows, ids = merge_topk(list(answers), k, metric, total)
    return work(scores, rows, ids, *args)


def ranked_ids(ids: np.ndarray) -> list[str]:
    """One query's result ids (a row of :meth:`ShardFanout.search_blocks`), padding dropped."""
    return [d.decode() for d in ids if d]


# A server actor (a searcher, a BM25 shard, a passage server) holds what it serves only in
# memory, loaded from storage by its constructor. When its process or node dies, Ray runs the
# constructor again, on another node if its own is gone, and re-sends the calls that were in
# flight: a query block asked of a dead server is answered once, by its successor. Only
# system failures are retried, and only ``ServerLimits.restarts`` times a stage: a server
# whose constructor or search crashes its process (a FAISS/CUDA abort, the OOM killer) would
# otherwise be restarted for ever while the stage waits. An exception raised by the server's
# own code fails the call.
BLOCKS_IN_FLIGHT = 3  # query blocks asked of the searchers ahead of the one being merged

# A query block is the unit searched, written, resumed and redone after a lost node. Its
# answers (every server's top-k of it) and its vectors are held at once by the task that
# merges it: sized so that they take about BLOCK_BYTES, the fewer objects the better.
BLOCK_BYTES = 256 * 2**20
HIT_BYTES = 4 + 8 + 32  # a hit in a server's answer: score, corpus row, doc id (up to 32 bytes)
MIN_BLOCK, MAX_BLOCK = 64, 16384


# A search of many queries is cut into at least this many blocks, so that its progress line
# moves (BM25's 4,434 Nave training queries were one block: "0/4,434" until the end).
PROGRESS_BLOCKS = 16


def query_block(servers: int, k: int, dim: int = 0, queries: int = 0) -> int:
    """Queries per block when ``servers`` servers each answer a block with their top ``k``
    (and a query vector is ``dim`` floats): as many as fit ``BLOCK_BYTES`` in the task that
    merges the block, within [MIN_BLOCK, MAX_BLOCK], and, given the search's ``queries``, no
    more than a ``PROGRESS_BLOCKS``-th of them. 16,384 queries a block at MS MARCO's depth
    200 on one searcher (31 blocks for 502k queries), 3,600 on eight."""
    per_query = max(1, servers) * max(1, k) * HIT_BYTES + 4 * dim
    fits = min(MAX_BLOCK, BLOCK_BYTES // per_query)
    if queries:
        fits = min(fits, -(-queries // PROGRESS_BLOCKS))
    return int(max(MIN_BLOCK, fits))


@dataclass
class ServerLimits:
    """How long a stage waits on its server actors (searchers, BM25 shards, passage
    servers) before it fails, naming the server, its node and the cause."""

    restarts: int = field(
        default=3,
        metadata={
            "min": 0,
            "help": "times Ray restarts a server whose process or node died, per server and stage; past it the stage fails",
        },
    )
    ready_timeout_s: float = field(
        default=900.0,
        metadata={
            "above": 0,
            "help": "seconds a server (and a GPU canary) may go without progress coming up: placed (an autoscaler's new nodes included), then each shard it loads; a searcher is waited for as long as it loads",
        },
    )
    stall_timeout_s: float = field(
        default=1800.0, metadata={"above": 0, "help": "seconds a query block may go unanswered before the stage fails"}
    )

    def __post_init__(self):
        if self.restarts < 0:
            raise ValueError(f"restarts must be >= 0, got {self.restarts}")
        for name in ("ready_timeout_s", "stall_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def actor_options(self) -> dict:
        """Ray's options for a server: restarted ``restarts`` times, its calls re-sent to the
        restarted server meanwhile (and failed once it is dead for good)."""
        return {"max_restarts": self.restarts, "max_task_retries": -1}


def restarts_of(server) -> str:
    """How many times Ray restarted ``server`` (the actor table's count), as said in errors."""
    try:
        return str(int(ray._private.state.actors(server._actor_id.hex())["NumRestarts"]))
    except Exception:  # noqa: BLE001 - an internal table: an error message never fails on it
        return "?"


def death_cause(exc: BaseException) -> str:
    """Ray's reason for an actor's death, in one line (its message runs to a paragraph of
    troubleshooting advice)."""
    text = str(getattr(exc, "error_msg", "") or exc)
    if getattr(exc, "actor_init_failed", False):  # its constructor raised: that exception's line
        raised = [line for line in text.strip().splitlines() if re.match(r"^[\w.]+(Error|Exception): ", line)]
        if raised:
            return "its constructor raised " + re.sub(r"^(\w+\.)+", "", raised[-1].strip())
    because = re.search(r"The actor is dead because (.*)", text, re.S)
    reason = because.group(1) if because else text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    reason = reason.split(" Some common causes", 1)[0]
    return " ".join(reason.split()).rstrip(".")


def actor_node(actor) -> str:
    """Where ``actor`` ran last: its node id (short) and address, as the GCS records it."""
    try:
        from ray._private import state  # the GCS's actor table, no dashboard needed

        address = state.actors(actor._actor_id.hex()).get("Address") or {}
    except Exception:  # the table is Ray's internals: a missing field leaves the node unnamed
        return "an unknown node"
    node = address.get("NodeID") or ""
    return f"node {node[:12]} ({address.get('IPAddress', '?')})" if node else "an unknown node"


def failed_server(refs: Sequence) -> tuple[int, BaseException] | None:
    """(index, error) of the first of ``refs`` (a call to each server) that is back with
    its server dead; None when none is."""
    for i, ref in enumerate(refs):
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return i, exc
    return None


def _failed_start_was_transient(exc: BaseException) -> bool:
    """Whether a server's constructor raised a transient fault (storage still throttled past
    its own retries, a reset). Ray reports a constructor's exception as an ActorDiedError
    that keeps only its text, so the text is what is read."""
    return bool(getattr(exc, "actor_init_failed", False)) and (
        TransientStorageError.__name__ in str(exc) or storage.is_transient(exc)
    )


def _was_restarted(server) -> bool:
    return ray.get_runtime_context().was_current_actor_reconstructed


class ShardActors:
    """Actors that each serve one shard of the corpus, started by :meth:`_serve` and killed
    on :meth:`close` (or ``with``).

    A stage never waits on them for ever: :meth:`_serve` returns once every server is up,
    or fails when one dies past its restarts or is not up within ``limits.ready_timeout_s``
    (:class:`ServerLimits`); a block whose servers answer neither fails the stage after
    ``limits.stall_timeout_s``. Each failure is a :class:`ServerError` naming the server,
    its node and Ray's cause.

    A server whose node is being drained (a spot node's preemption notice, a scale-down) is
    copied before the node goes: whenever its servers are about to be asked (a query block
    of :class:`ShardFanout`, a scoring call handed the passage servers),
    :meth:`_move_off_draining` starts a copy of it, which Ray places on a node that stays;
    once the copy has loaded its shard it takes the server's place, and the server is let go
    once the calls asked of it are back. Left to Ray, the server would be restarted only once
    its node is gone, and every block would wait for it to load its shard again."""

    actors: list
    label: str = "search"  # the progress line's name, and the log's
    limits: ServerLimits = ServerLimits()

    def _serve(self, starts: Sequence[Callable[..., object]], reports: bool = False) -> None:
        """Start one server per shard, ``starts[i]()`` starting shard i's (again, for a copy),
        each given ``self.limits.actor_options()``; return once all are up. With
        ``reports``, each start is called with ``load_key=``, the key its constructor writes
        its progress under (:mod:`pipeline.retrieval.loading`)."""
        self._starts, self._reports = list(starts), reports
        self._load_keys = [loading.new_key(self.label) if reports else "" for _ in self._starts]
        self.actors = [self._start_server(shard) for shard in range(len(self._starts))]
        self._draining = DrainingNodes()
        for server in self.actors:
            self._draining.started(server)
        self._copies: dict[int, tuple] = {}  # shard -> (its copy, the copy's ready ref, when started)
        self._leaving: list[tuple] = []  # (a replaced server, the calls it still owes)
        self.moves: list[dict] = []  # one per server moved off a draining node
        self.start_retries = 0  # servers started again after their constructor met a transient fault
        try:
            self._await_ready()
        except BaseException:
            self.close()
            raise
        finally:
            loading.forget(self._load_keys)

    def _start_server(self, shard: int, key: str | None = None):
        """Shard ``shard``'s server, reporting under ``key`` (default: its own key)."""
        start = self._starts[shard]
        return start(load_key=self._load_keys[shard] if key is None else key) if self._reports else start()

    def server_name(self, shard: int) -> str:
        """How errors name server ``shard``."""
        return f"server {shard} of {len(self.actors)}"

    def _await_ready(self) -> None:
        """Wait until every server's constructor has returned. A server fails the stage here,
        before any block is asked, when it died past its restarts, when its constructor
        raised a user's or an artifact's error, or when it showed no progress for
        ``limits.ready_timeout_s`` (never placed: no node can hold it, an autoscaler that
        never brings one; or stuck while loading). A server that reports its loading is
        waited for as long as it loads. A constructor that met a transient fault (storage
        still throttled past its retries) is started again, like a lost node, up to
        ``limits.restarts`` times a server."""
        pending = {server.__ray_ready__.remote(): shard for shard, server in enumerate(self.actors)}
        watch = loading.LoadWatch(list(self._load_keys), self.limits.ready_timeout_s)
        again = [0] * len(self.actors)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(5.0, self.limits.ready_timeout_s))
            if not done:
                stalled = sorted(shard for shard in pending.values() if watch.stalled(shard))
                if stalled:
                    raise self._not_up(stalled, watch)
                continue
            shard = pending.pop(done[0])
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                if not _failed_start_was_transient(exc) or again[shard] >= self.limits.restarts:
                    raise self._died(shard, exc) from None
                again[shard] += 1
                self.start_retries += 1
                log.warning("%s: %s met a transient fault starting: started again", self.label, self.server_name(shard))
                self._draining.forget(self.actors[shard])
                loading.forget([self._load_keys[shard]])  # the failed start's reports
                self._load_keys[shard] = loading.new_key(self.label) if self._reports else ""
                self.actors[shard] = self._start_server(shard)
                self._draining.started(self.actors[shard])
                watch.restarted(shard, self._load_keys[shard])
                pending[self.actors[shard].__ray_ready__.remote()] = shard

    def _not_up(self, stalled: list[int], watch: loading.LoadWatch) -> ServerError:
        first = stalled[0]
        more = f" and {len(stalled) - 1} more" if len(stalled) > 1 else ""
        return ServerError(
            f"{self.label}: {self.server_name(first)}{more} not up, no progress for {watch.waited_s(first):.0f} s"
            f"{watch.said(first)} (no node could hold it, or its loading is stuck): "
            "see `ray status`; --searchers.ready_timeout_s waits longer"
        )

    def _died(self, shard: int, exc: BaseException, server=None) -> BaseException:
        """The error to end the stage with, for server ``shard`` dead past its restarts:
        the server's own error when its code raised one (a bad index, say), else a
        :class:`ServerError` naming the server, its node and Ray's cause."""
        if isinstance(getattr(exc, "cause", None), BaseException):
            return exc  # an exception the constructor raised: the job reports it as it is
        server = server or self.actors[shard]
        return ServerError(
            f"{self.label}: {self.server_name(shard)} died after {restarts_of(server)} of its {self.limits.restarts} "
            f"restarts, last on {actor_node(server)}: {death_cause(exc)}"
        )

    def _move_off_draining(self, in_flight: Sequence[tuple[list, list]]) -> None:
        """Copy the servers on draining nodes, and put each copy that has loaded in its
        server's place. ``in_flight``: (servers, their refs) of every call asked and not yet
        used, whose answers a replaced server still owes before it is let go."""
        for shard, server in enumerate(self.actors):
            if shard not in self._copies and self._draining.holds(server):
                copy = self._start_server(shard, key="")  # its server is up: nobody watches it load
                self._draining.started(copy)
                self._copies[shard] = (copy, copy.__ray_ready__.remote(), time.monotonic())
        for shard, (copy, ready, since) in list(self._copies.items()):
            if not ray.wait([ready], timeout=0)[0]:
                continue  # still loading: the server answers meanwhile
            ray.get(ready)  # a copy whose constructor failed stops the search here
            server, self.actors[shard] = self.actors[shard], copy
            del self._copies[shard]
            self._draining.forget(server)
            owed = [ref for servers, refs in in_flight for s, ref in zip(servers, refs) if s is server]
            self._leaving.append((server, owed))
            self.moves.append({"shard": shard, "copy_ready_s": round(time.monotonic() - since, 3)})
            log.info("%s: shard %d's server moved off a draining node", self.label, shard)
        self._let_go()

    def _let_go(self) -> None:
        """Kill the replaced servers whose calls are all back."""
        owing = []
        for server, owed in self._leaving:
            if len(ray.wait(owed, num_returns=len(owed), timeout=0)[0]) < len(owed):
                owing.append((server, owed))
            else:
                ray.kill(server)
        self._leaving = owing

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def restarted(self) -> int:
        """How many of the servers now serving were restarted by Ray (their process or node
        died) since they first started: a stage's record of the failures it rode out."""
        return sum(ray.get([server.__ray_call__.remote(_was_restarted) for server in self.actors]))

    def close(self) -> None:
        copies = [copy for copy, _, _ in getattr(self, "_copies", {}).values()]
        for actor in self.actors + copies + [server for server, _ in getattr(self, "_leaving", [])]:
            ray.kill(actor)


@dataclass
class AskedBlock:
    """A block of queries in flight: put once, asked of every server it names."""

    start: int  # its first query
    size: int
    queries: Any  # the block's object reference
    servers: list = field(default_factory=list)  # the servers asked (a replaced one asks anew)
    answers: list = field(default_factory=list)  # each server's answer reference
    pending: Any = None  # what is waited for: the answers, or the task that merges them


class ShardFanout(ShardActors):
    """Shard actors searched together: every actor answers each block of queries."""

    metric: str = "ip"
    total: int  # documents over all shards
    dim: int = 0  # a query's floats, when queries are vectors (sizes the default block)
    in_flight: int = BLOCKS_IN_FLIGHT
    # Of the last search (search_blocks or map_blocks): its wall time, and the part the driver spent waiting for the
    # actors' answers; the rest is the driver's own (merging, and the caller's writing).
    searched_s: float = 0.0
    waited_s: float = 0.0

    def driver_share(self) -> float:
        """The share of the last search's wall time that the driver was busy, not waiting on
        the actors: near 1, the driver bounds the search."""
        return round(1 - self.waited_s / self.searched_s, 4) if self.searched_s else 0.0

    def search_blocks(
        self, queries: Sequence, k: int, *, block: int | None = None, only: Sequence[int] | None = None, **options
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Per block of queries, as it is answered: (first query, scores (b, k), corpus rows
        (b, k), doc ids (b, k) as bytes), the exact merge of every shard's top-k. Padding
        (fewer than k hits) is row -1 and id b"". ``only``: the block numbers to search (a
        resumed stage's missing ones); ``options`` go to every actor's ``search``.

        By default a block is :func:`query_block` queries: every server's answers to it take
        about ``BLOCK_BYTES``, whatever the number of servers."""

        for start, answers in self._asked_blocks(queries, k, block, only, lambda start, size, refs: refs, options):
            yield start, *merge_topk(answers, k, self.metric, self.total)

    def map_blocks(
        self,
        queries: Sequence,
        k: int,
        work: Callable,
        work_args: Callable[[int, int], tuple],
        *,
        block: int | None = None,
        only: Sequence[int] | None = None,
        **options,
    ) -> Iterator[tuple[int, object]]:
        """:meth:`search_blocks` with each block's merge and use off the driver: a Ray task
        gets the actors' answers (by reference: they never pass through the driver), merges
        them and returns ``work(scores, rows, doc ids, *work_args(start, size))``. Yields
        (first query, that return value) in block order. The driver only asks and routes,
        so at scale its merging and writing no longer bound the searchers; with
        ``in_flight`` blocks asked ahead, up to that many tasks run beside the searches."""

        merged_then = ray.remote(_merged_then).options(num_cpus=1, max_retries=3)

        def route(start: int, size: int, refs: list):
            return merged_then.remote(work, k, self.metric, self.total, work_args(start, size), *refs)

        yield from self._asked_blocks(queries, k, block, only, route, options)

    def _recover(self, failure: BaseException) -> bool:
        """Whether the servers were replaced after ``failure`` (a server dead past its
        restarts), so that the blocks in flight can be asked again: never, here; a fan-out
        with a fallback (GPU searchers) says yes once it has one up."""
        return False

    def _asked_blocks(self, queries: Sequence, k: int, block: int | None, only, route: Callable, options: dict):
        """The loop both searches share: each block put once and asked of every actor,
        ``route(start, size, answer refs)`` giving what to wait for (the refs themselves, or
        a task's), ``in_flight`` blocks ahead so the actors search the next ones while this
        one is used; yields (first query, what was waited for) in block order, counted once
        the caller is done with it. Times the wait (see :meth:`driver_share`).

        A block unanswered for ``limits.stall_timeout_s`` ends the search; so does a server
        dead past its restarts, unless :meth:`_recover` replaces the servers, when every
        block in flight is asked again of the new ones."""
        block = block or query_block(len(self.actors), k, self.dim, len(queries))
        check_k(k, self.total)
        starts = range(0, len(queries), block) if only is None else [b * block for b in only]
        asked: deque[AskedBlock] = deque()
        began, self.waited_s = time.perf_counter(), 0.0

        def ask(entry: AskedBlock) -> None:
            entry.servers = list(self.actors)
            entry.answers = [a.search.remote(entry.queries, k, **options) for a in entry.servers]
            entry.pending = route(entry.start, entry.size, entry.answers)

        with progress(sum(min(block, len(queries) - s) for s in starts), self.label, "queries") as bar:

            def answered():
                while True:
                    head = asked[0]
                    start, size, pending, servers, refs = (
                        head.start,
                        head.size,
                        head.pending,
                        head.servers,
                        head.answers,
                    )
                    waiting = time.perf_counter()
                    try:
                        result = ray.get(pending, timeout=self.limits.stall_timeout_s)
                        break
                    except ray.exceptions.GetTimeoutError:
                        silent = [i for i, r in enumerate(refs) if not ray.wait([r], timeout=0)[0]]
                        raise ServerError(
                            f"{self.label}: queries {start}-{start + size - 1} (block {start // block}) unanswered "
                            f"after {self.limits.stall_timeout_s:g} s by "
                            + (
                                ", ".join(f"{self.server_name(i)} on {actor_node(servers[i])}" for i in silent)
                                or "its merge task"
                            )
                        ) from None
                    except ray.exceptions.RayError:
                        dead = failed_server(refs)
                        if dead is None:
                            raise  # the merge task's own failure
                        failure = self._died(dead[0], dead[1], servers[dead[0]])
                        if not self._recover(failure):
                            raise failure from None
                        for entry in asked:
                            ask(entry)
                    finally:
                        self.waited_s += time.perf_counter() - waiting
                asked.popleft()
                yield start, result
                bar.update(size)

            for start in starts:
                self._move_off_draining([(entry.servers, entry.answers) for entry in asked])
                if isinstance(queries, StoredQueryVectors):  # read by the actors: the driver never holds them
                    part = queries.rows_between(start, start + block)
                else:
                    part = queries[start : start + block]
                entry = AskedBlock(start, len(part), ray.put(part))  # put once, shared by every actor
                ask(entry)
                asked.append(entry)
                if len(asked) >= self.in_flight:
                    yield from answered()
            while asked:
                yield from answered()
        self._let_go()
        self.searched_s = time.perf_counter() - began

    def holds(self, doc_ids: np.ndarray) -> np.ndarray:
        """Which of ``doc_ids`` (bytes) the corpus holds, asked of the shards (each knows its
        own): a bool mask."""
        return held_by(self.actors, doc_ids)
