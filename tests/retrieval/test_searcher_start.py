"""A searcher's start at any size: its shards read side by side, waited for while it loads
(not for a fixed time), and started again after a transient fault in its constructor."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
from ray import cloudpickle

from pipeline.core.errors import ArtifactError, ServerError, TransientStorageError
from pipeline.retrieval import faiss_index, search
from pipeline.retrieval.faiss_index import brute_force_topk
from pipeline.retrieval.search import SearcherConfig, ShardedIndex
from tests.helpers import index_of_random_vectors
from tests.pace import bound_s

DIM, SHARDS, PER_SHARD = 8, 8, 10
SLOW_READ_S = 4.0  # a searcher's 8 shards take 8 s to read, four at a time
BEHAVIOUR_VAR = "RAYDENSE_TEST_SEARCHER_START"  # how the test searcher below misbehaves


@pytest.fixture(scope="module")
def ivf_index(tmp_path_factory, shared_ray):
    root = tmp_path_factory.mktemp("start")
    index_uri, vectors, rows = index_of_random_vectors(root, SHARDS, PER_SHARD, DIM, "IVF2,Flat")
    queries = np.random.default_rng(1).standard_normal((6, DIM)).astype(np.float32)
    return index_uri, queries, brute_force_topk(queries, vectors, 5, rows=rows), root


class _MisbehavingSearcher(search.IndexSearcher):
    """An IndexSearcher whose shard reads are slow or stop for good, or whose first start
    meets a transient fault, as ``BEHAVIOUR_VAR`` says (``slow``, ``stuck``, ``flaky:<dir>``,
    ``broken``). Each start leaves a mark in the flaky one's folder."""

    def __init__(self, *args, **kwargs):
        behaviour = os.environ.get(BEHAVIOUR_VAR, "")
        read = faiss_index._read_with_sizes
        reads = []

        def slow_read(*a):
            reads.append(1)
            if behaviour == "stuck" and len(reads) > 2:
                time.sleep(3600)
            time.sleep(SLOW_READ_S if behaviour == "slow" else 0.2)
            return read(*a)

        faiss_index._read_with_sizes = slow_read
        if behaviour.startswith("flaky:"):
            marks = behaviour.split(":", 1)[1]
            os.makedirs(marks, exist_ok=True)
            if not os.listdir(marks):
                open(os.path.join(marks, "first"), "w").close()
                raise TransientStorageError("cannot read index shard: object storage kept failing transiently")
            open(os.path.join(marks, f"again-{len(os.listdir(marks))}"), "w").close()
        if behaviour == "broken":
            raise ArtifactError("index shard x is not a readable FAISS index")
        super().__init__(*args, **kwargs)


@pytest.fixture
def misbehaving(monkeypatch):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(search, "IndexSearcher", _MisbehavingSearcher)

    def behave(how: str) -> None:
        monkeypatch.setattr(search, "_searcher_env", lambda: {"env_vars": {BEHAVIOUR_VAR: how}})

    return behave


def test_a_searcher_is_waited_for_while_it_loads_past_its_ready_timeout(ivf_index, misbehaving):
    """One searcher whose 8 shards take 8 s to read (4 s each, four at a time) after its
    process starts, with a ready timeout of 6 s (on an idle machine): it reports its start
    and each shard as it is read, and the stage waits for it and answers as brute force.
    Mutation: ``LoadWatch.stalled`` ignoring the reports (the fixed timeout, as before)
    fails it "not up, no progress for 6 s"."""
    index_uri, queries, (ref_scores, ref_rows), _ = ivf_index
    misbehaving("slow")
    started, timeout = time.monotonic(), bound_s(6)
    with ShardedIndex(index_uri, nprobe=2, searchers=SearcherConfig(searchers=1, ready_timeout_s=timeout)) as index:
        assert time.monotonic() - started > 2 * SLOW_READ_S
        scores, rows = index.search(queries, 5)
        assert index.start_retries == 0
    assert np.array_equal(rows, ref_rows) and np.allclose(scores, ref_scores, atol=1e-5)


def test_a_searcher_stuck_while_loading_fails_the_stage_naming_how_far_it_got(ivf_index, misbehaving):
    """A searcher whose third shard read never returns: no progress for the ready timeout
    ends the stage with one line naming the searcher and the shards it had loaded (the
    first two, read side by side with the stuck ones)."""
    index_uri, *_ = ivf_index
    misbehaving("stuck")
    with pytest.raises(
        ServerError,
        match=r"search: faiss-cpu searcher 0 of 1 \(index shards 0-7\) not up, no progress for \d+ s, "
        r"2 of 16 shards loaded \(no node could hold it, or its loading is stuck\)",
    ):
        ShardedIndex(index_uri, nprobe=2, searchers=SearcherConfig(searchers=1, ready_timeout_s=bound_s(6)))


def test_a_transient_fault_in_a_searchers_start_starts_it_again_and_a_mistake_does_not(ivf_index, misbehaving):
    """A constructor whose storage kept failing transiently (past storage's own retries)
    is started again, like a lost node, and the stage answers as brute force; counted by
    the starts' marks and ``start_retries``. An artifact's error ends the stage at once,
    naming it.
    Mutation: ``_await_ready`` raising every constructor's error (as before) fails the
    first with the TransientStorageError."""
    index_uri, queries, (_, ref_rows), root = ivf_index
    marks = root / "flaky-marks"
    misbehaving(f"flaky:{marks}")
    with ShardedIndex(index_uri, nprobe=2, searchers=SearcherConfig(searchers=2, ready_timeout_s=60)) as index:
        _, rows = index.search(queries, 5)
        assert index.start_retries == 1
    assert np.array_equal(rows, ref_rows)
    assert sorted(os.listdir(marks)) == ["again-1", "again-2", "first"]  # one failed start, three that ran
    misbehaving("broken")
    with pytest.raises(
        ServerError,
        match=r"died after 0 of its 3 restarts, last on node \w+ \(\S+\): its constructor raised "
        r"ArtifactError: index shard x is not a readable FAISS index$",
    ):
        ShardedIndex(index_uri, nprobe=2, searchers=SearcherConfig(searchers=1, ready_timeout_s=60))


def test_a_searcher_reads_its_shards_side_by_side_and_merges_them_in_order(ivf_index, monkeypatch):
    """``load_merged_shards`` reads ``READ_AHEAD`` shards at once (counted: the most reads
    in flight together), and its merged index answers as the shards read one at a time.
    Mutation: ``READ_AHEAD = 1``, or reads in the calling thread, gives one at a time."""
    index_uri, queries, _, _ = ivf_index
    entries = faiss_index.load_index_manifest(index_uri)["shards"]
    read = faiss_index._read_with_sizes
    in_flight, most, lock = [0], [0], threading.Lock()

    def counted(*args):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.2)
        try:
            return read(*args)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(faiss_index, "_read_with_sizes", counted)
    said = []
    (merged,) = faiss_index.load_merged_shards(index_uri, entries, on_read=lambda: said.append(1))
    assert most[0] == faiss_index.READ_AHEAD > 1 and len(said) == SHARDS
    monkeypatch.setattr(faiss_index, "READ_AHEAD", 1)
    (one_at_a_time,) = faiss_index.load_merged_shards(index_uri, entries)
    for index in (merged, one_at_a_time):
        faiss_index.set_nprobe(index, 2)
    assert [a.tolist() for a in merged.search(queries, 5)] == [a.tolist() for a in one_at_a_time.search(queries, 5)]
