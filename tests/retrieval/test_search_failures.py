"""A search never hangs: on a Ray that declares 2 GPUs on this CPU machine, FAISS's GPU path
is stood in for by ``RAYDENSE_TEST_GPU_FAULT`` (see ``pipeline.retrieval.gpu_search``), whose
value names the step that aborts the process as a broken FAISS/CUDA build would. A searcher
that aborts is restarted a bounded number of times, then the stage fails with one line
naming the searcher, its node and the cause; or, with a fallback set, completes on it with
the brute-force answers. Without the stand-in, faiss-cpu on a GPU request fails its canary
instead of searching on the CPU unsaid."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pipeline.core.entry import user_error
from pipeline.core.errors import ServerError
from pipeline.retrieval.faiss_index import brute_force_topk
from pipeline.retrieval.gpu_search import FAULT_MARKS_VAR, FAULT_VAR
from pipeline.retrieval.search import SearcherConfig, ShardedIndex
from tests.helpers import index_of_random_vectors
from tests.pace import bound_s

pytestmark = pytest.mark.ray

DIM, SHARDS, PER_SHARD = 16, 4, 25
# One GPU searcher of the 4 index shards, restarted once: an abort costs two process starts.
GPU = dict(use_gpu=True, gpu_memory_gb=16, searchers=1, restarts=1, ready_timeout_s=120, stall_timeout_s=120)
DEATH = (
    r"faiss-gpu searcher 0 of 1 \(index shards 0-3\) died after 1 of its 1 restarts, last on node \w+ \(\S+\): .*died"
)


@pytest.fixture(scope="module")
def flat_index(tmp_path_factory, fake_gpu_ray):
    index_uri, vectors, rows = index_of_random_vectors(
        tmp_path_factory.mktemp("failures"), SHARDS, PER_SHARD, DIM, "Flat"
    )
    queries = np.random.default_rng(1).standard_normal((30, DIM)).astype(np.float32)
    return index_uri, vectors, queries, brute_force_topk(queries, vectors, 10, rows=rows)


def _search(index_uri: str, queries: np.ndarray, **settings) -> tuple[ShardedIndex, np.ndarray, np.ndarray]:
    with ShardedIndex(index_uri, searchers=SearcherConfig(**(GPU | settings))) as index:
        scores, rows = index.search(queries, 10, block=8)
        index.searcher_stats = index.stats()
    return index, scores, rows


def test_a_searcher_that_aborts_fails_the_stage_after_its_restarts_naming_it(flat_index, monkeypatch, tmp_path):
    """Mutations: ``max_restarts`` back to -1 (ServerLimits.actor_options) makes this wait
    for ever, restarting the searcher (here: past the 120 s ready timeout, and the message
    names no death); ``max_restarts=0`` starts it once and says 0 restarts. A searcher
    that aborts in a search is found the same way, by the call that comes back from the
    dead server (the fallback test below). Counted, not timed: each start leaves a mark."""
    index_uri, _, queries, _ = flat_index
    monkeypatch.setenv(FAULT_VAR, "load")
    monkeypatch.setenv(FAULT_MARKS_VAR, str(tmp_path / "starts"))
    with pytest.raises(ServerError, match=DEATH) as failure:
        _search(index_uri, queries)
    assert len(os.listdir(tmp_path / "starts")) == 2, "a first start and its one restart"
    message = str(user_error(failure.value))
    assert "\n" not in message and message.endswith(
        "(--searchers.gpu_fallback torch or cpu searches without FAISS's GPU path)"
    )
    assert failure.value.exit_code == 1


@pytest.mark.parametrize("step,fallback", [("load", "torch"), ("search", "cpu")])
def test_a_searcher_that_aborts_falls_back_and_answers_as_brute_force(flat_index, monkeypatch, capsys, step, fallback):
    """The GPU searchers die past their restarts (at start, or with blocks in flight): every
    searcher starts again on the fallback, the blocks are asked again, and the answers are
    the brute-force ones. Mutation: ``ShardedIndex._recover`` returning False fails the
    "search" cases with the ServerError."""
    index_uri, _, queries, (ref_scores, ref_rows) = flat_index
    monkeypatch.setenv(FAULT_VAR, step)
    index, scores, rows = _search(index_uri, queries, gpu_fallback=fallback, restarts=0)
    mode = "torch" if fallback == "torch" else "faiss-cpu"
    assert index.search_mode == mode and [s["search"] for s in index.searcher_stats] == [
        "torch-cpu" if mode == "torch" else mode
    ]
    assert "died after 0 of its 0 restarts" in index.fallback
    assert f"searching with {mode} instead" in capsys.readouterr().err
    # torch's fallback holds its GPU (one each); FAISS on the host holds none.
    assert [s["reserved"].get("GPU", 0) for s in index.searcher_stats] == [1.0 if mode == "torch" else 0]
    assert np.array_equal(rows, ref_rows) and np.allclose(scores, ref_scores, atol=1e-4)


def test_a_gpu_out_of_memory_at_a_searchers_load_is_a_server_error_the_fallback_takes(flat_index, monkeypatch):
    """FAISS's cudaMalloc failure as a searcher moves its shards to a GPU smaller than the
    plan's: one line naming the searcher and the error, exit 1, not started again (it would
    fail the same way); with ``gpu_fallback cpu`` the searchers start on the host and answer
    as brute force."""
    index_uri, _, queries, (_, ref_rows) = flat_index
    monkeypatch.setenv(FAULT_VAR, "load-oom")
    with pytest.raises(
        ServerError, match=r"died after 0 of its 1 restarts.*its constructor raised RuntimeError: .*out of memory\]"
    ) as failure:
        _search(index_uri, queries)
    assert failure.value.exit_code == 1 and "\n" not in str(failure.value)
    index, _, rows = _search(index_uri, queries, gpu_fallback="cpu")
    assert index.search_mode == "faiss-cpu" and "out of memory" in index.fallback
    assert np.array_equal(rows, ref_rows)


def test_the_gpu_canary_stops_a_broken_or_missing_faiss_gpu_before_any_searcher(flat_index, monkeypatch):
    """A canary that aborts (a broken build) fails the stage with its cause, or falls back;
    with no stand-in, faiss-cpu cannot search on a GPU, and says so instead of searching on
    the CPU. Mutation: dropping ``_canary`` from ``ShardedIndex.__init__`` starts the
    searchers, which fail (no FAISS GPU) or pass as GPU searchers (the stand-in)."""
    index_uri, _, queries, (_, ref_rows) = flat_index
    monkeypatch.setenv(FAULT_VAR, "canary")
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"search: FAISS's GPU canary failed: .*died.*--searchers.gpu_fallback"):
        _search(index_uri, queries)
    assert time.monotonic() - started < bound_s(30)
    index, _, rows = _search(index_uri, queries, gpu_fallback="torch")
    assert index.search_mode == "torch" and np.array_equal(rows, ref_rows)
    monkeypatch.delenv(FAULT_VAR)
    with pytest.raises(
        ServerError, match=r"FAISS's GPU canary failed: FAISS sees no GPU here \(faiss-cpu is installed"
    ):
        _search(index_uri, queries)
    # (With the stand-in whole, the GPU searchers serve: tests/retrieval/test_placement.py.)


def test_a_block_no_searcher_answers_fails_after_the_stall_timeout(flat_index, monkeypatch):
    """A searcher that hangs in a search (a wedged GPU) ends the stage after
    ``stall_timeout_s``, naming the block and the silent searchers. Mutation: ``ray.get``
    without its timeout in ``_asked_blocks`` waits for ever."""
    index_uri, _, queries, _ = flat_index
    with ShardedIndex(index_uri, searchers=SearcherConfig(searchers=2, stall_timeout_s=3)) as index:
        index.actors[1].__ray_call__.remote(lambda searcher: time.sleep(3600))  # busy: its searches queue
        started = time.monotonic()
        with pytest.raises(
            ServerError,
            match=r"search: queries 0-7 \(block 0\) unanswered after 3 s by faiss-cpu searcher 1 of 2 "
            r"\(index shards 2-3\) on node \w+",
        ):
            index.search(queries, 10, block=8)
        assert time.monotonic() - started < bound_s(15)
