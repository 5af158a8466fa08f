"""Encoding on Ray actors, FAISS index shards, sharded search, mining and the evaluation job."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shutil
import time

import numpy as np
import pytest
from conftest import synthetic_docs, write_jsonl

from pipeline.core.actor_pool import ActorConfig, run_actor_pool
from pipeline.core.errors import ArtifactError, InputError
from pipeline.data.beir import read_qrels, read_queries
from pipeline.retrieval import embeddings as emb
from pipeline.retrieval.encode import (
    EncodeConfig,
    Encoder,
    EncoderSettings,
    run_encoding,
)
from pipeline.retrieval.faiss_index import IndexConfig, brute_force_topk, load_index_manifest
from pipeline.retrieval.fanout import ranked_ids, read_qrels_of_corpus
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing
from pipeline.retrieval.search import SearcherConfig, ShardedIndex
from tests.helpers import drain_for_preemption, ir_measures_of_run, is_killed, resident_growth, stopped_by_sigterm
from tests.training.test_finetune_ray import tiny_bert  # noqa: F401  (fixture)

pytestmark = pytest.mark.ray

N_DOCS = 90


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    root = tmp_path_factory.mktemp("collection")
    docs = synthetic_docs(N_DOCS, seed=21)
    queries = [{"_id": f"q{i}", "text": " ".join(docs[i * 3]["text"].split()[:4])} for i in range(20)]
    qrels = "query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\t{docs[i * 3]['_id']}\t1\nq{i}\t{docs[i * 3 + 1]['_id']}\t1\n" for i in range(20)
    )
    (root / "qrels.tsv").write_text(qrels)
    return {
        "root": root,
        "docs": docs,
        "corpus": write_jsonl(root / "corpus.jsonl", docs),
        "queries": write_jsonl(root / "queries.jsonl", queries),
        "qrels": str(root / "qrels.tsv"),
    }


@pytest.fixture(scope="module")
def encoded(collection, tiny_bert, shared_ray):  # noqa: F811
    cfg = EncodeConfig(
        corpus=collection["corpus"],
        output=str(collection["root"] / "emb"),
        docs_per_shard=20,
        # Two shards in flight per actor, as on GPUs: one encoded while another is read or written.
        encoder=EncoderSettings(model=tiny_bert, pooling="mean", batch_size=7, shards_in_flight=2),
        pool=ActorConfig(actors=2),
    )
    return cfg, run_encoding(cfg)


def read_all(folder: str):
    manifest = emb.load_manifest(folder)
    parts = [emb.read_shard(folder, e) for e in manifest["shards"]]
    return (
        np.concatenate([p[0] for p in parts]),
        [d for p in parts for d in p[1]],
        np.concatenate([p[2] for p in parts]),
    )


def test_every_passage_encoded_once_and_equal_to_a_direct_encoding(encoded, collection):
    cfg, summary = encoded
    assert summary["passages"] == N_DOCS and summary["shards"] == 5 and summary["shards_encoded"] == 5
    rows, doc_ids, vectors = read_all(cfg.output)
    assert sorted(rows.tolist()) == list(range(N_DOCS))
    assert sorted(doc_ids) == sorted(d["_id"] for d in collection["docs"])
    # Against the model applied directly, one passage at a time (no batching, no sorting).
    encoder = Encoder(
        EncoderSettings(model=cfg.encoder.model, pooling="mean", batch_size=1),
        os.path.join(summary["corpus"], "tokenizer"),
    )
    texts = {d["_id"]: d["text"] for d in collection["docs"]}
    direct = encoder.encode_texts([texts[d] for d in doc_ids], 128, tower="passage")
    assert np.allclose(vectors, direct, atol=1e-4)


def test_a_rerun_redoes_only_missing_shards(encoded, collection, capsys, monkeypatch):
    """The driver reads the model's settings and width from its JSON files, never its weights
    (counted in the driver's process; the actors load it in theirs). Mutation: the driver's
    probe through load_biencoder again: one load."""
    import models.biencoder

    cfg, _ = encoded
    before = read_all(cfg.output)
    os.remove(os.path.join(cfg.output, emb.shard_path(2)))
    capsys.readouterr()
    loads = []
    real_load = models.biencoder.load_pretrained
    monkeypatch.setattr(models.biencoder, "load_pretrained", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    again = run_encoding(cfg)
    assert loads == []
    assert again["shards_encoded"] == 1 and again["shards_skipped"] == 4
    # stderr is not a terminal here: progress comes as whole lines, counting up to the
    # passages this run encodes, without carriage returns.
    lines = [line for line in capsys.readouterr().err.split("\n") if "encode: " in line]
    counts = [int(line.split()[1].split("/")[0].replace(",", "")) for line in lines]
    assert not any("\r" in line for line in lines) and counts == sorted(counts) and len(lines) >= 2
    assert lines[-1].startswith("encode: 20/20 passages (100.0%), ") and "/s, ETA 0s" in lines[-1]
    after = read_all(cfg.output)
    assert sorted(after[0].tolist()) == list(range(N_DOCS))
    order_b, order_a = np.argsort(before[0]), np.argsort(after[0])
    assert np.allclose(before[2][order_b], after[2][order_a], atol=1e-5)


@pytest.mark.release_check
@pytest.mark.runs_long  # four encodings over the corpus: 65-98 s in the suite under CI's load
def test_embeddings_made_otherwise_are_never_reused(encoded, tmp_path, capsys):
    """One output folder, the same model with another pooling: every shard is encoded anew
    (the old ones are deleted first, with a message), as a fresh folder would give them;
    the same settings again reuse them all."""
    import dataclasses
    import shutil

    cfg, _ = encoded
    shutil.copytree(cfg.output, tmp_path / "emb")
    mean = read_all(str(tmp_path / "emb"))
    cls = dataclasses.replace(
        cfg, output=str(tmp_path / "emb"), encoder=dataclasses.replace(cfg.encoder, pooling="cls")
    )
    capsys.readouterr()
    summary = run_encoding(cls)
    assert summary["shards_encoded"] == 5 and summary["shards_skipped"] == 0
    # (the copied folder's corpus lies elsewhere: the corpus differs too)
    assert re.search(
        r"5 embedding shards made otherwise \(other [^)]*\bretriever\b[^)]*\) deleted", capsys.readouterr().err
    )
    fresh = run_encoding(dataclasses.replace(cls, output=str(tmp_path / "fresh"), prepared=summary["corpus"]))
    got, want = read_all(cls.output), read_all(fresh["output"])
    assert np.array_equal(got[0], want[0]) and np.allclose(got[2], want[2], atol=1e-5)
    assert not np.allclose(got[2], mean[2], atol=1e-3)
    assert run_encoding(cls)["shards_skipped"] == 5

    # Shards with no record of what made them (an older folder) are not trusted either.
    os.remove(tmp_path / "emb" / emb.MADE_BY)
    assert run_encoding(cls)["shards_encoded"] == 5


class _Flaky:
    """An actor that dies (the process exits) on the first attempt at each marked task."""

    def __init__(self, marker_dir: str):
        self.marker_dir = marker_dir

    def work(self, task: int) -> int:
        marker = os.path.join(self.marker_dir, f"died-{task}")
        if task % 3 == 0 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os._exit(1)
        return task * 10


@pytest.mark.parametrize("calls_per_actor", [1, 2])
def test_a_task_whose_actor_died_is_retried_on_a_fresh_actor(tmp_path, shared_ray, calls_per_actor):
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import a test module
    remote = ray.remote(_Flaky).options(num_cpus=0.5, max_restarts=0, max_concurrency=calls_per_actor)
    made = []
    results = run_actor_pool(
        lambda: made.append(1) or remote.remote(str(tmp_path)),
        list(range(7)),
        lambda actor, t: actor.work.remote(t),
        # A task fails once with each death it shares a process with: with two calls at once,
        # an unmarked task can share all three deaths (it failed so once in CI), so three
        # retries are what guarantees every task finishes.
        max_retries=3,
        n_actors=2,
        calls_per_actor=calls_per_actor,
    )
    assert results == [t * 10 for t in range(7)]  # every task exactly once, in order
    assert sorted(os.listdir(tmp_path)) == ["died-0", "died-3", "died-6"]
    # One fresh actor per death, even when the dead actor had two calls in flight. With two
    # calls at once, both of an actor's calls may be marked tasks that mark and exit the one
    # process: the deaths are the processes that exited.
    deaths = {(tmp_path / name).read_text() for name in os.listdir(tmp_path)}
    assert len(deaths) >= 2 and len(made) == 2 + len(deaths)


class _Overlapping:
    """A threaded actor that reports how many of its calls ran at once."""

    def __init__(self):
        import threading

        self.lock, self.running, self.most = threading.Lock(), 0, 0

    def work(self, task: int) -> tuple[int, int]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.3)
        with self.lock:
            self.running -= 1
            return task, self.most


@pytest.mark.parametrize("calls_per_actor", [1, 2])
def test_an_actor_is_handed_calls_per_actor_tasks_at_once(shared_ray, calls_per_actor):
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    remote = ray.remote(_Overlapping).options(num_cpus=0.5, max_concurrency=calls_per_actor)
    results = run_actor_pool(
        remote.remote, list(range(6)), lambda a, t: a.work.remote(t), 0, n_actors=1, calls_per_actor=calls_per_actor
    )
    assert [task for task, _ in results] == list(range(6))
    assert max(most for _, most in results) == calls_per_actor


class _CannotStart:
    """An actor whose constructor fails, as one given a model it cannot load would."""

    def __init__(self, model: str):
        raise ValueError(f"--encoder.model {model}: no such checkpoint")

    def work(self, task: int) -> int:
        return task


def test_an_actor_that_cannot_start_fails_the_run_at_once(shared_ray):
    import sys

    import ray
    from ray import cloudpickle
    from ray.exceptions import RayActorError

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    remote = ray.remote(_CannotStart).options(num_cpus=0.5, max_restarts=0)
    started = []

    def make_actor():
        started.append(1)
        return remote.remote("s3://bucket/missing")

    with pytest.raises(RayActorError, match="s3://bucket/missing: no such checkpoint") as raised:
        run_actor_pool(make_actor, list(range(6)), lambda actor, t: actor.work.remote(t), max_retries=5, n_actors=2)
    assert raised.value.actor_init_failed
    assert len(started) == 2  # the first two actors; none started to retry a task on


class _Placed:
    """An actor whose calls say which node ran them."""

    def work(self, task: int) -> tuple[int, str]:
        import ray

        time.sleep(0.3)
        return task, ray.get_runtime_context().get_node_id()


def test_actors_on_a_drained_node_get_no_new_task_and_are_replaced_on_a_node_that_stays(local_cluster, monkeypatch):
    """Two actors on a node that is drained (a spot node's preemption notice, 60 s ahead)
    after their third task, while a fresh node joins: every task handed out once the pool
    has seen the drain runs on the new node, none fails or runs twice, and two actors
    replace the two."""
    import sys

    import ray
    from ray import cloudpickle

    from pipeline.core import draining

    monkeypatch.setattr(draining, "DRAIN_CHECK_S", 0.0)  # asked at every returned call
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    doomed = local_cluster.add_node(num_cpus=2)
    remote = ray.remote(_Placed).options(num_cpus=1, max_restarts=0)
    made, handed, drained_at = [], [], []

    def call(actor, task):
        handed.append((task, time.monotonic()))
        return actor.work.remote(task)

    def on_done(task, result):
        if task == 2:
            drain_for_preemption(local_cluster.address, doomed.node_id, deadline_s=60)
            drained_at.append(time.monotonic())
            local_cluster.add_node(num_cpus=2)

    results = run_actor_pool(
        lambda: made.append(1) or remote.remote(), list(range(12)), call, max_retries=0, n_actors=2, on_done=on_done
    )
    assert [task for task, _ in results] == list(range(12))  # every task once, none retried
    ran_on = dict(results)
    assert {ran_on[t] for t in range(3)} == {doomed.node_id}
    after = [t for t, at in handed if at > drained_at[0]]
    assert after and all(ran_on[t] != doomed.node_id for t in after), (after, ran_on)
    assert len(made) == 4


class _VectorShard:
    """A fan-out server over a slice of a matrix, writing a line to ``log_dir`` for each
    start and each block it answers (with its node), as a searcher would answer."""

    def __init__(self, vectors: np.ndarray, rows: np.ndarray, shard: int, log_dir: str):
        import ray

        self.vectors, self.rows, self.shard, self.log_dir = vectors, rows, shard, log_dir
        self.node = ray.get_runtime_context().get_node_id()
        self._note("start", -1)

    def _note(self, what: str, block: int) -> None:
        with open(os.path.join(self.log_dir, f"{what}_{self.shard}_{block}_{self.node}_{time.time_ns()}"), "w"):
            pass

    def search(self, block: np.ndarray, k: int):
        time.sleep(0.25)  # longer than the caller takes a block: blocks are out at the move
        scores = block @ self.vectors.T
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        rows = self.rows[top]
        self._note("search", int(block[0, 0] * 1000))  # the block's first query, by its tag
        return np.take_along_axis(scores, top, 1), rows, np.array([[b"d%d" % r for r in row] for row in rows])


def test_fanout_servers_on_a_drained_node_move_to_a_node_that_stays(local_cluster, monkeypatch, tmp_path):
    """Both servers of a fan-out sit on a node that is drained (a spot node's preemption
    notice, 60 s ahead) after the third block, while a fresh node joins: each server is
    copied to the new node while the search goes on, the copies answer the blocks asked once
    they have loaded, and the servers left behind are killed once their calls are back.
    Every block is answered exactly once by each shard, and the merged results are the
    brute-force top-k."""
    import functools
    import sys

    import ray
    from ray import cloudpickle

    from pipeline.core import draining
    from pipeline.retrieval.fanout import ServerLimits, ShardFanout

    monkeypatch.setattr(draining, "DRAIN_CHECK_S", 0.0)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    doomed = local_cluster.add_node(num_cpus=2)
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((60, 8)).astype(np.float32)
    queries = rng.standard_normal((40, 8)).astype(np.float32)
    queries[:, 0] = np.arange(40) / 1000  # each block's first value tags it in the servers' log
    server = ray.remote(_VectorShard).options(num_cpus=1, **ServerLimits().actor_options())
    fanout = ShardFanout()
    fanout.total = len(vectors)
    halves = np.array_split(np.arange(len(vectors)), 2)
    fanout._serve([functools.partial(server.remote, vectors[h], h, i, str(tmp_path)) for i, h in enumerate(halves)])
    placed = list(fanout.actors)

    def node_of(actor) -> str:
        return ray.get(actor.__ray_call__.remote(lambda instance: instance.node))

    assert {node_of(a) for a in placed} == {doomed.node_id}
    found, drained_at = [], []
    for start, scores, rows, _ in fanout.search_blocks(queries, 5, block=1):
        found.append((scores, rows))
        if start == 2:
            drain_for_preemption(local_cluster.address, doomed.node_id, deadline_s=60)
            drained_at.append(time.time_ns())
            fresh = local_cluster.add_node(num_cpus=2)
        elif start > 2 and len(fanout.moves) < 2:
            time.sleep(0.05)  # time for the copies to start on the new node while blocks remain
    assert sorted(m["shard"] for m in fanout.moves) == [0, 1]
    assert {node_of(a) for a in fanout.actors} == {fresh.node_id}
    ref_scores, ref_rows = brute_force_topk(queries, vectors, 5)
    assert np.array_equal(np.concatenate([r for _, r in found]), ref_rows)
    np.testing.assert_allclose(np.concatenate([s for s, _ in found]), ref_scores, rtol=1e-5)
    # The servers left behind were killed (their node, idle and drained, then ends itself),
    # not restarted by Ray: one start on each node per shard, and no block asked twice.
    assert all(is_killed(actor) for actor in placed)
    notes = [name.split("_") for name in os.listdir(tmp_path)]
    starts = sorted((int(shard), node) for what, shard, _, node, _ in notes if what == "start")
    assert starts == sorted((shard, node) for shard in (0, 1) for node in (doomed.node_id, fresh.node_id))
    answered = sorted((int(shard), int(block)) for what, shard, block, _, _ in notes if what == "search")
    assert answered == sorted((shard, block) for shard in (0, 1) for block in range(40))  # each once
    late = [(node, int(at)) for what, _, _, node, at in notes if what == "search" and int(at) > drained_at[0]]
    assert any(node == fresh.node_id for node, _ in late)
    fanout.close()


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_sharded_search_equals_brute_force(encoded, collection, factory):
    cfg, _ = encoded
    out = str(collection["root"] / f"index-{factory.replace(',', '_')}")
    summary = run_indexing(
        IndexJobConfig(
            embeddings=cfg.output,
            output=out,
            embedding_shards_per_index=2,
            index=IndexConfig(factory=factory, nprobe=4),
        )
    )
    assert summary["shards"] == 3 and summary["vectors"] == N_DOCS
    rows, _, vectors = read_all(cfg.output)
    queries = np.random.default_rng(0).standard_normal((12, vectors.shape[1])).astype(np.float32)
    # nprobe = nlist: IVF is exact too. One searcher holding the 3 shards (merged inside it),
    # or 2 searchers holding 2 and 1 (merged by the driver as well).
    index = ShardedIndex(out, nprobe=4, searchers=SearcherConfig(searchers=1 if factory == "Flat" else 2))
    assert [s["shards"] for s in index.stats()] == ([3] if factory == "Flat" else [2, 1])
    # IVF shards filled from the one trained quantiser are one index inside their searcher.
    assert [s["indexes"] for s in index.stats()] == ([3] if factory == "Flat" else [1, 1])
    keys = {shard["trained"] for shard in load_index_manifest(out)["shards"]}
    assert keys == {None} if factory == "Flat" else (len(keys) == 1 and None not in keys)
    scores, found = index.search(queries, 10)
    # Streamed in blocks of 5, with the ids each searcher reads for its own rows (index shards
    # 1 and 2 start at corpus rows 40 and 80): the same hits, as the corpus's ids.
    blocks = list(index.search_blocks(queries, 10, block=5))
    ref_scores, ref_rows = brute_force_topk(queries, vectors, 10, rows=rows)
    doc_ids = [d["_id"] for d in collection["docs"]]
    assert [b[0] for b in blocks] == [0, 5, 10]
    assert np.array_equal(np.concatenate([b[2] for b in blocks]), found)
    assert [ranked_ids(r) for b in blocks for r in b[3]] == [[doc_ids[r] for r in row] for row in found]
    asked = np.array([d.encode() for d in ("not-a-doc", doc_ids[0], doc_ids[-1], doc_ids[45])])
    assert index.holds(asked).tolist() == [False, True, True, True]
    # Qrels are checked against the corpus by the searchers, and an unknown passage is
    # still reported at its line.
    lines = open(collection["qrels"]).read().splitlines()
    bad = collection["root"] / f"qrels-bad-{factory.replace(',', '_')}.tsv"
    bad.write_text("\n".join(lines[:3] + ["q1\tghost\t1"] + lines[3:]) + "\n")
    query_ids = {f"q{i}" for i in range(20)}
    assert read_qrels_of_corpus(collection["qrels"], index.holds, query_ids) == read_qrels(collection["qrels"])
    with pytest.raises(InputError, match=r"qrels-bad-\S+\.tsv line 4: unknown document id 'ghost'"):
        read_qrels_of_corpus(str(bad), index.holds, query_ids)
    index.close()
    assert np.allclose(scores, ref_scores, atol=1e-4)
    assert (found == ref_rows).mean() > 0.99  # ties aside, the same passages
    with ShardedIndex(out) as index, pytest.raises(ValueError, match="larger than the corpus"):
        index.search(queries, N_DOCS + 1)


def test_a_searcher_killed_mid_search_comes_back_and_every_block_is_answered_once(encoded, collection):
    """A searcher's process is SIGKILLed between two blocks: Ray restarts it (it reloads its
    shard from storage) and re-sends the call it missed, so the search ends with every block
    once and the brute-force result."""
    from tests.helpers import kill_process_of, pid_of

    cfg, _ = encoded
    out = str(collection["root"] / "index-killed")
    run_indexing(
        IndexJobConfig(
            embeddings=cfg.output, output=out, embedding_shards_per_index=2, index=IndexConfig(factory="Flat")
        )
    )
    rows, _, vectors = read_all(cfg.output)
    queries = np.random.default_rng(1).standard_normal((20, vectors.shape[1])).astype(np.float32)
    with ShardedIndex(out, searchers=SearcherConfig(searchers=3)) as index:
        blocks, killed = [], None
        for block in index.search_blocks(queries, 10, block=4):
            blocks.append(block)
            if killed is None:
                killed = kill_process_of(index.actors[1])
        assert pid_of(index.actors[1]) != killed
    assert [b[0] for b in blocks] == [0, 4, 8, 12, 16]
    ref_scores, ref_rows = brute_force_topk(queries, vectors, 10, rows=rows)
    assert np.allclose(np.concatenate([b[1] for b in blocks]), ref_scores, atol=1e-4)
    assert (np.concatenate([b[2] for b in blocks]) == ref_rows).mean() > 0.99


def test_indexing_builds_only_the_shards_it_lacks_and_never_mixes_settings(encoded, collection, tmp_path):
    """An index of 3 shards losing one (a build killed before it finished) builds that one
    again, with the same quantiser, and searches as before; another factory into the same
    folder rebuilds them all."""
    cfg, _ = encoded
    job = IndexJobConfig(
        embeddings=cfg.output,
        output=str(tmp_path / "index"),
        embedding_shards_per_index=2,
        index=IndexConfig(factory="IVF4,Flat", nprobe=4),
    )
    first = run_indexing(job)
    assert (first["shards"], first["shards_built"], first["quantizers_trained"]) == (3, 3, 1)
    queries = np.random.default_rng(2).standard_normal((8, read_all(cfg.output)[2].shape[1])).astype(np.float32)
    with ShardedIndex(job.output, nprobe=4) as index:
        before = index.search(queries, 10)
    os.remove(tmp_path / "index" / "shards" / "index-00001.faiss.json")
    again = run_indexing(job)
    assert (again["shards"], again["shards_built"], again["quantizers_trained"]) == (3, 1, 1)
    with ShardedIndex(job.output, nprobe=4) as index:
        after = index.search(queries, 10)
    assert np.array_equal(before[1], after[1]) and np.allclose(before[0], after[0])
    rerun = run_indexing(job)
    assert (rerun["shards_built"], rerun["quantizers_trained"]) == (0, 0)  # nothing to build, nothing trained
    flat = run_indexing(IndexJobConfig(**{**job.__dict__, "index": IndexConfig(factory="Flat")}))
    assert (flat["shards_built"], flat["quantizers_trained"]) == (3, 0)


def test_a_factory_faiss_rejects_and_a_wrong_dimension_shard_are_clear_errors(encoded, collection, tmp_path):
    import shutil

    cfg, _ = encoded
    with pytest.raises(ValueError, match="FAISS rejects the index factory 'IVF4,PQ7'"):
        run_indexing(
            IndexJobConfig(embeddings=cfg.output, output=str(tmp_path / "i1"), index=IndexConfig(factory="IVF4,PQ7"))
        )
    broken = str(tmp_path / "emb")
    shutil.copytree(cfg.output, broken)
    rows, ids, vectors = emb.read_shard(broken, emb.load_manifest(broken)["shards"][1])
    os.remove(os.path.join(broken, emb.shard_path(1)))
    emb.write_shard(broken, 1, rows, ids, np.zeros((len(rows), 5), np.float32))
    with pytest.raises(ArtifactError, match="part-00001.parquet.*width 5"):
        run_indexing(IndexJobConfig(embeddings=broken, output=str(tmp_path / "i2")))
    os.remove(os.path.join(broken, emb.shard_path(1)))
    emb.write_shard(broken, 1, rows, ids, vectors)  # mended; now another shard goes missing
    os.remove(os.path.join(broken, emb.shard_path(3)))
    with pytest.raises(ArtifactError, match="part-00003.parquet is missing"):
        run_indexing(IndexJobConfig(embeddings=broken, output=str(tmp_path / "i3")))


def test_mined_negatives_exclude_positives_and_are_reproducible(encoded, collection, tmp_path):
    from pipeline.data.beir import read_qrels
    from pipeline.data.groups import select_negatives
    from pipeline.data.runs import read_negatives, read_trec_run
    from pipeline.data.tevatron import read_tevatron
    from pipeline.retrieval.mine import MineConfig, run_mining

    cfg, _ = encoded
    index_dir = str(tmp_path / "index")
    run_indexing(IndexJobConfig(embeddings=cfg.output, output=index_dir))
    mine = MineConfig(
        index=index_dir,
        queries=collection["queries"],
        qrels=collection["qrels"],
        output=str(tmp_path / "mined"),
        depth=40,
        count=6,
        seed=3,
        encoder=cfg.encoder,
        pool=ActorConfig(actors=1),
    )
    summary = run_mining(mine)
    mined = read_negatives(summary["negatives"])
    qrels = read_qrels(collection["qrels"])
    for qid, negatives in mined.items():
        assert len(negatives) == 6 and not set(negatives) & set(qrels[qid])
    # The draw is a function of the seed and the query's ranking (the run written beside
    # the negatives): drawn again from that run, the same negatives.
    for qid, ranked in read_trec_run(summary["run"]).items():
        ids, scores = [d for d, _, _ in ranked], [s for _, s, _ in ranked]
        again, _ = select_negatives(qid, ids, scores, set(qrels[qid]), mine)
        assert again == mined[qid]
    records = list(read_tevatron(summary["tevatron"]))
    assert len(records) == 20 and [p["docid"] for p in records[0]["negative_passages"]] == mined["q0"]

    # Margin mining: candidates within 0.02 of the query's hardest positive (its lowest score,
    # here read from the run, which holds the whole corpus) are dropped, and counted.
    margined = run_mining(
        dataclasses.replace(mine, output=str(tmp_path / "margined"), depth=N_DOCS, absolute_margin=0.02)
    )
    kept, dropped = read_negatives(margined["negatives"]), 0
    for qid, ranked in read_trec_run(margined["run"]).items():
        scores = {d: s for d, s, _ in ranked}
        assert set(qrels[qid]) <= set(scores)  # the whole corpus ranked: every positive scored
        ceiling = min(scores[d] for d in qrels[qid]) - 0.02
        allowed = [(d, s) for d, s in scores.items() if d not in qrels[qid]]
        dropped += sum(s > ceiling for _, s in allowed)
        assert all(scores[d] <= ceiling for d in kept[qid])
        assert len(kept[qid]) == min(6, sum(s <= ceiling for _, s in allowed))
    assert margined["margin_dropped"] == dropped > 0
    made_by = json.loads((tmp_path / "margined" / "made_by.json").read_text())
    assert made_by["settings"]["absolute_margin"] == 0.02 and made_by["settings"]["relative_margin"] is None
    # Below the easiest (best-scoring) positive instead: only candidates about as good as it go.
    easiest = run_mining(
        dataclasses.replace(
            mine, output=str(tmp_path / "easiest"), depth=N_DOCS, absolute_margin=0.02, margin_positive="easiest"
        )
    )
    kept = read_negatives(easiest["negatives"])
    for qid, ranked in read_trec_run(easiest["run"]).items():
        scores = {d: s for d, s, _ in ranked}
        ceiling = max(scores[d] for d in qrels[qid]) - 0.02
        allowed = [s for d, s in scores.items() if d not in qrels[qid]]
        assert all(scores[d] <= ceiling for d in kept[qid])
        assert len(kept[qid]) == min(6, sum(s <= ceiling for s in allowed))
    assert 0 < easiest["margin_dropped"] < margined["margin_dropped"]


@pytest.mark.runs_long  # three minings, one stopped: 84 s in CI's suite (stop 93)
def test_mining_killed_mid_way_resumes_from_its_finished_blocks(encoded, collection, tmp_path, monkeypatch, capsys):
    """Blocks of 6 queries: a run stopped after two blocks, rerun, searches only the rest and
    writes the same files as a run never stopped; a rerun with another setting starts over.
    The stopped runs write on the driver (where the stop can be placed exactly), the others
    in Ray tasks: both write the same bytes."""
    from pipeline.retrieval import mine as mining

    cfg, _ = encoded
    index_dir = str(tmp_path / "index")
    run_indexing(IndexJobConfig(embeddings=cfg.output, output=index_dir))
    monkeypatch.setattr(mining, "query_block_of", lambda index, searchers, k, queries: 6)  # 20 queries: 4 blocks
    settings = dict(index=index_dir, queries=collection["queries"], qrels=collection["qrels"], depth=40, count=6)
    job = dict(**settings, encoder=cfg.encoder, pool=ActorConfig(actors=1))
    whole = mining.run_mining(mining.MineConfig(**job, output=str(tmp_path / "whole")))
    assert (whole["blocks"], whole["blocks_resumed"]) == (4, 0)

    from pipeline.retrieval import mined_block

    write_block, written = mined_block.write, []

    def stopped_after_two(*args):
        if len(written) == 2:
            raise KeyboardInterrupt
        write_block(*args)
        written.append(args[5])  # the block number

    monkeypatch.setattr(mined_block, "write", stopped_after_two)
    stopped = mining.MineConfig(**job, output=str(tmp_path / "stopped"), write_in_tasks=False)
    with pytest.raises(KeyboardInterrupt):
        mining.run_mining(stopped)
    monkeypatch.setattr(mined_block, "write", write_block)
    # At most two objects a block: its results (negatives, training file, run and counts in
    # one) and its query vectors. (Five before: one per file.)
    names = os.listdir(tmp_path / "stopped" / "parts")
    per_block = collections.Counter(name.split(".")[0] for name in names if name[0].isdigit())
    assert per_block == {"000000": 2, "000001": 2, "000002": 1, "000003": 1}, sorted(names)
    asked, encoded = [], []
    store = mining.store_query_vectors

    def counted(settings, texts_of, blocks, pool, vectors):
        asked.append(sorted(blocks))
        encoded.append(store(settings, texts_of, blocks, pool, vectors))
        return encoded[-1]

    monkeypatch.setattr(mining, "store_query_vectors", counted)
    resumed = mining.run_mining(dataclasses.replace(stopped, write_in_tasks=True))
    assert written == [0, 1] and (resumed["blocks"], resumed["blocks_resumed"]) == (4, 2)
    # Blocks 2 and 3 are searched, with the vectors the stopped run stored for them.
    assert (asked, encoded) == ([[2, 3]], [0])
    for name in ("negatives.jsonl", "train.tevatron.jsonl", "run.trec"):
        assert (tmp_path / "stopped" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert not (tmp_path / "stopped" / "parts").exists()

    # Stopped again, then rerun with another count: nothing of the first setting is kept.
    written.clear()
    monkeypatch.setattr(mined_block, "write", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        mining.run_mining(mining.MineConfig(**job, output=str(tmp_path / "changed"), write_in_tasks=False))
    monkeypatch.setattr(mined_block, "write", write_block)
    capsys.readouterr()
    job["count"] = 5
    changed = mining.run_mining(mining.MineConfig(**job, output=str(tmp_path / "changed")))
    assert changed["blocks_resumed"] == 0 and "(other settings) deleted" in capsys.readouterr().err
    assert changed["negatives_per_query"] == 5


def _beir_folders(collection, root) -> list[tuple[str, dict]]:
    """The module's collection in BEIR's own layout, and a second one with a file per split:
    (folder, {"docs", "queries", "qrels"}) each."""
    import shutil

    first = root / "synthetic"
    (first / "qrels").mkdir(parents=True)
    shutil.copy(collection["corpus"], first / "corpus.jsonl")
    shutil.copy(collection["queries"], first / "queries.jsonl")
    shutil.copy(collection["qrels"], first / "qrels" / "test.tsv")
    second = root / "other"
    docs = synthetic_docs(40, seed=5)
    write_jsonl(second / "corpus.jsonl", docs)
    write_jsonl(second / "queries.test.jsonl", [{"_id": f"o{i}", "text": docs[i]["text"][:30]} for i in range(8)])
    (second / "qrels.test.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"o{i}\t{docs[i]['_id']}\t1\n" for i in range(8))
    )
    return [
        (str(first), {"docs": collection["docs"], "queries": collection["queries"], "qrels": collection["qrels"]}),
        (
            str(second),
            {"docs": docs, "queries": str(second / "queries.test.jsonl"), "qrels": str(second / "qrels.test.tsv")},
        ),
    ]


def test_evaluate_job_matches_ir_measures_on_a_brute_force_run(encoded, collection, tiny_bert, tmp_path, capsys):  # noqa: F811
    """Two BEIR collections in one call (BEIR's layout, and a file per split): each one's
    metrics equal ir_measures on a brute-force run of the same encoder, the average is theirs,
    and one table, JSON and plot hold them all."""
    import ir_measures

    from jobs.evaluate import main
    from pipeline.data.beir import read_qrels, read_queries

    folders = _beir_folders(collection, tmp_path)
    args = ["--model", tiny_bert, "--pooling", "mean", "--normalize", "--docs_per_shard", "25", "--pool.actors", "1"]
    summary = main(
        [*args, "--collections", ",".join(f for f, _ in folders), "--k", "40", "--output", str(tmp_path / "eval")]
    )
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert set(last["metrics"]) == {"MRR@10", "R@10", "nDCG@10"}  # a run cut at 40 has no R@100
    assert [row.split("|")[1].strip() for row in out if row.startswith("| ")][1:] == ["synthetic", "other", "average"]

    encoder = Encoder(EncoderSettings(model=tiny_bert, pooling="mean", similarity="cos"), tiny_bert)
    measures = [ir_measures.RR @ 10, ir_measures.R @ 10, ir_measures.nDCG @ 10]
    for (folder, c), (name, result) in zip(folders, summary["collections"].items()):
        assert name == os.path.basename(folder)
        queries = read_queries(c["queries"])
        passages = encoder.encode_texts([d["text"] for d in c["docs"]], 128, tower="passage")
        qvecs = encoder.encode_texts(list(queries.values()), 32, tower="query")
        scores, idx = brute_force_topk(qvecs, passages, 40)
        run = {
            q: {c["docs"][j]["_id"]: float(s) for s, j in zip(srow, irow)}
            for q, srow, irow in zip(queries, scores, idx)
        }
        expected = ir_measures.calc_aggregate(measures, dict(read_qrels(c["qrels"]).items()), run)
        for name, measure in (("MRR@10", measures[0]), ("R@10", measures[1]), ("nDCG@10", measures[2])):
            assert result["metrics"][name] == pytest.approx(expected[measure], abs=1e-6)
    for metric, value in summary["metrics"].items():
        assert value == pytest.approx(sum(c["metrics"][metric] for c in summary["collections"].values()) / 2)
    assert json.loads((tmp_path / "eval" / "collections.json").read_text())["metrics"] == summary["metrics"]
    assert (tmp_path / "eval" / "collections.png").stat().st_size > 0

    os.remove(folders[1][1]["qrels"])  # a broken collection fails before any work, named
    with pytest.raises(InputError, match=r"other: no qrels/test.tsv or qrels.test.tsv \(split 'test'\)"):
        main([*args, "--collections", ",".join(f for f, _ in folders), "--output", str(tmp_path / "broken")])
    assert not (tmp_path / "broken").exists()

    # A sample of the queries with every query's qrels, at the default --k 1000 on 90
    # passages: scored on the sample's judgments, every passage ranked, both said.
    # Mutation: scoring on the whole qrels counts the 12 queries left out as zeros.
    sample = write_jsonl(tmp_path / "sample.jsonl", [json.loads(line) for line in open(collection["queries"])][:8])
    capsys.readouterr()
    subset = main(
        [*args, "--corpus", collection["corpus"], "--queries", sample, "--qrels", collection["qrels"]]
        + ["--output", str(tmp_path / "eval2")]
    )
    said = capsys.readouterr().err
    assert "12 of the 20 queries judged in" in said and "scoring the 8 given" in said
    assert "--k 1000 is more than the corpus's 90 passages: every passage is ranked" in said
    assert subset["k"] == N_DOCS and subset["queries"] == 8
    queries = read_queries(sample)
    passages = encoder.encode_texts([d["text"] for d in collection["docs"]], 128, tower="passage")
    scores, idx = brute_force_topk(encoder.encode_texts(list(queries.values()), 32, tower="query"), passages, 10)
    run = {
        q: {collection["docs"][j]["_id"]: float(v) for v, j in zip(srow, irow)}
        for q, srow, irow in zip(queries, scores, idx)
    }
    judged = {q: j for q, j in read_qrels(collection["qrels"]).items() if q in queries}
    expected = ir_measures.calc_aggregate(measures, judged, run)
    assert subset["metrics"]["MRR@10"] == pytest.approx(expected[measures[0]], abs=1e-6)


@pytest.mark.runs_long  # four evaluations (whole, stopped, two reruns): 1-1.5 minutes in the suite
def test_an_evaluation_rerun_reuses_its_encoding_index_and_searched_blocks(
    encoded,
    collection,
    tiny_bert,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """Search blocks of 5 queries: stopped after two of four blocks, the rerun encodes
    nothing, builds no index shard, searches the two blocks left, and writes the same run and
    metrics as an evaluation never stopped."""
    from pipeline.retrieval import evaluate as evaluation

    monkeypatch.setattr(evaluation, "query_block_of", lambda index, searchers, k, queries: 5)
    job = evaluation.EvaluateJobConfig(
        encoder=EncoderSettings(model=tiny_bert, pooling="mean"),
        corpus=collection["corpus"],
        queries=collection["queries"],
        qrels=collection["qrels"],
        k=50,
        docs_per_shard=25,
        pool=ActorConfig(actors=1),
    )
    whole = evaluation.run_evaluation(dataclasses.replace(job, output=str(tmp_path / "whole")))
    assert (whole["search_blocks"], whole["search_blocks_resumed"]) == (4, 0)
    write_lines, lines = evaluation.write_trec_lines, []

    def stopped_in_the_third_block(out, *args, **kwargs):
        if len(lines) == 10:
            raise KeyboardInterrupt
        lines.append(args[0])
        write_lines(out, *args, **kwargs)

    stopped = dataclasses.replace(job, output=str(tmp_path / "stopped"))
    monkeypatch.setattr(evaluation, "write_trec_lines", stopped_in_the_third_block)
    with pytest.raises(KeyboardInterrupt):
        evaluation.run_evaluation(stopped)
    monkeypatch.setattr(evaluation, "write_trec_lines", write_lines)
    # The stopped state, kept to be put back for the reruns below: a stop is deterministic,
    # so this is what stopping again would leave (copy2 keeps the modification times that
    # local files' versions are made of, and the same path keeps the claims' paths).
    snapshot = tmp_path / "snapshot"
    shutil.copytree(tmp_path / "stopped", snapshot)

    def stopped_again() -> None:
        shutil.rmtree(tmp_path / "stopped")
        shutil.copytree(snapshot, tmp_path / "stopped")

    capsys.readouterr()
    resumed = evaluation.run_evaluation(stopped)
    assert (resumed["search_blocks"], resumed["search_blocks_resumed"]) == (4, 2)
    assert resumed["metrics"] == pytest.approx(whole["metrics"])
    assert (tmp_path / "stopped" / "run.trec").read_bytes() == (tmp_path / "whole" / "run.trec").read_bytes()
    assert not re.search(r"encode: \d+/[1-9]\d* passages", capsys.readouterr().err)  # every shard reused
    assert resumed["index_shards_built"] == 0
    # Stopped again, rerun with other judgments: the stored blocks' metric sums were made with
    # the old ones, so none is kept.
    stopped_again()
    judgments = open(collection["qrels"]).read().splitlines()
    (tmp_path / "fewer.tsv").write_text("\n".join(judgments[:21]) + "\n")
    rejudged = evaluation.run_evaluation(dataclasses.replace(stopped, qrels=str(tmp_path / "fewer.tsv")))
    assert rejudged["search_blocks_resumed"] == 0 and rejudged["judged_queries"] == 10
    # The put-back state was whole: its vectors and index reused, its blocks dropped for the qrels.
    assert rejudged["index_shards_built"] == 0 and "parts made otherwise (other qrels)" in capsys.readouterr().err
    # Stopped again, rerun with shorter queries: the stored blocks' vectors (and the run lines
    # searched with them) were made with the old length, so none is kept, and the metrics
    # are those of an evaluation never stopped at that length.
    stopped_again()
    short = dataclasses.replace(job.encoder, query_max_len=4)
    shortened = evaluation.run_evaluation(dataclasses.replace(stopped, encoder=short))
    assert shortened["search_blocks_resumed"] == 0 and "parts made otherwise (other encoder)" in capsys.readouterr().err
    # Never stopped: the whole evaluation again at that length (its passage vectors and index,
    # which the query length does not make, are reused).
    whole_short = evaluation.run_evaluation(dataclasses.replace(job, encoder=short, output=str(tmp_path / "whole")))
    assert whole_short["search_blocks_resumed"] == 0 and whole_short["index_shards_built"] == 0
    assert shortened["metrics"] == pytest.approx(whole_short["metrics"])
    assert whole_short["metrics"] != pytest.approx(whole["metrics"])  # the length matters here


@pytest.mark.runs_long  # two evaluations as a command, each with its own Ray: about a minute
def test_an_evaluation_sent_sigterm_mid_encoding_exits_143_and_its_rerun_resumes(tiny_bert, tmp_path):  # noqa: F811
    """``python jobs/evaluate.py`` sent SIGTERM (``ray job stop``, an eviction) once some of
    its corpus shards are encoded: exit 143, the resume hint its last line, no native stack
    dump (Ray's handler: ``*** SIGTERM received``, exit 134); the same command again keeps
    every shard encoded before the signal and finishes. Mutation: run_job not putting its
    SIGTERM handler back after ``ray.init`` (Ray's replaced it): the job aborts (-6)."""
    import subprocess
    import sys

    docs = synthetic_docs(3000, seed=5)
    queries = [{"_id": f"q{i}", "text": " ".join(docs[i]["text"].split()[:4])} for i in range(0, 3000, 150)]
    (tmp_path / "qrels.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q['_id']}\td{q['_id'][1:]}\t1\n" for q in queries)
    )
    out = tmp_path / "eval"
    command = [
        *(sys.executable, "jobs/evaluate.py", "--encoder.model", tiny_bert, "--pool.actors", "1"),
        *("--corpus", write_jsonl(tmp_path / "corpus.jsonl", docs), "--docs_per_shard", "60"),
        *("--queries", write_jsonl(tmp_path / "queries.jsonl", queries), "--qrels", str(tmp_path / "qrels.tsv")),
        *("--output", str(out), "--k", "10", "--encoder.passage_max_len", "64", "--encoder.batch_size", "8"),
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYDENSE_DEBUG")}
    job = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while job.poll() is None and time.time() < deadline and len(emb.finished_shards(str(out / "embeddings"))) < 2:
        time.sleep(0.05)
    assert job.poll() is None, job.communicate()[1][-3000:]
    stopped_by_sigterm(job)
    encoded_before = len(emb.finished_shards(str(out / "embeddings")))
    assert 2 <= encoded_before < 50 and not (out / "metrics.json").exists(), encoded_before

    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["encode_shards_resumed"] == encoded_before and summary["passages"] == 3000, summary
    assert summary["judged_queries"] == 20 and 0.0 <= summary["metrics"]["nDCG@10"] <= 1.0


def _synthetic_corpus_index(folder, n: int, dim: int) -> str:
    """An embeddings folder of ``n`` random passages in 2 shards and its Flat index."""
    vectors = np.random.default_rng(n).standard_normal((n, dim)).astype(np.float32)
    entries = [
        emb.write_shard(f"{folder}/emb", i, rows, [f"doc-{r:07d}" for r in rows], vectors[rows])
        for i, rows in enumerate(np.array_split(np.arange(n), 2))
    ]
    emb.write_manifest(f"{folder}/emb", dim, entries, normalized=False, similarity="dot", model="synthetic")
    run_indexing(IndexJobConfig(embeddings=f"{folder}/emb", output=f"{folder}/index"))
    return f"{folder}/index"


def _mining_peak(mine) -> tuple[dict, int]:
    from pipeline.retrieval.mine import run_mining

    return resident_growth(run_mining, mine)


def _fixed_query_vectors(vectors: np.ndarray):
    """A stand-in for the query encoder's pool: stores ``vectors``' rows as each block's."""
    from pipeline.retrieval.query_vectors import write_vectors

    def store(settings, texts_of, blocks, pool, stored) -> int:
        for b in blocks:
            write_vectors(stored.uri_of(b), vectors[b * stored.block : b * stored.block + len(texts_of(b))])
        return len(blocks)

    return store


def _vectors_kept_by_the_driver(seed: int, shape: tuple, kept: list):
    """The control's regressed stand-in: tasks make each block's vectors and return them,
    and the driver ``ray.get``s them, keeps them and writes them itself (a design whose
    driver holds every query's vector, which the memory bound must catch)."""
    import ray

    from pipeline.retrieval.query_vectors import write_vectors

    def generated_rows(start: int, stop: int) -> np.ndarray:  # nested: pickled by value for the workers
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)[start:stop]

    def store(settings, texts_of, blocks, pool, stored) -> int:
        make = ray.remote(generated_rows)
        kept.extend(ray.get([make.remote(b * stored.block, b * stored.block + len(texts_of(b))) for b in blocks]))
        for b, rows in zip(blocks, kept[-len(blocks) :]):
            write_vectors(stored.uri_of(b), rows)
        return len(blocks)

    return store


@pytest.mark.parametrize("margin", [None, 0.0], ids=["plain", "margin"])
def test_mining_drivers_memory_does_not_grow_with_the_query_vectors(
    margin,
    tmp_path,
    monkeypatch,
    tiny_bert,  # noqa: F811
    shared_ray,
):
    """The driver's resident peak (``resident_growth``: arrays, Arrow buffers and
    object-store pages included) mining 200 and 2,000 queries of 2,048-wide vectors in
    blocks of 64: the vectors stay in storage, each searcher reading a block as it searches
    it, so 1,800 more queries add their ids, texts, judgments and the scheduler's records
    (1-3 MiB measured), not their 14 MiB of vectors. Where the driver read each block and
    put it in the object store, the pages it wrote grew its memory by 15 MiB here (200
    queries: 2.5 MiB, 2,000: 16.8; the mutation that fails this test). With a margin, the
    positives are scored first by tasks that read the vectors themselves. The control
    (plain only) is a regressed driver that ``ray.get``s every block's vectors and keeps
    them: it must break the same bound. The mined files are those of a search over the
    vectors held in memory, and the margin drops exactly the candidates scoring above each
    query's positive."""
    from pipeline.retrieval import mine as mining
    from pipeline.retrieval.mine import MineConfig

    dim, n_docs, bound = 2048, 3000, 4 * 2**20
    index = _synthetic_corpus_index(tmp_path / "corpus", n_docs, dim)
    vectors = np.random.default_rng(9).standard_normal((2000, dim)).astype(np.float32)

    def mine(n: int, name: str) -> MineConfig:
        queries = write_jsonl(
            tmp_path / f"q{n}" / "queries.jsonl", [{"_id": f"q{i}", "text": f"query {i}"} for i in range(n)]
        )
        qrels = tmp_path / f"q{n}" / "qrels.tsv"
        qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\tdoc-{i % n_docs:07d}\t1\n" for i in range(n)))
        return MineConfig(
            index=index,
            queries=queries,
            qrels=str(qrels),
            output=str(tmp_path / name),
            depth=20,
            count=5,
            sample="top",
            query_block=64,
            absolute_margin=margin,
            encoder=EncoderSettings(model=tiny_bert),  # unused: the vectors are fixed
            pool=ActorConfig(actors=1),
        )

    monkeypatch.setattr(mining, "store_query_vectors", _fixed_query_vectors(vectors))
    monkeypatch.setattr(mining, "encoder_width", lambda model: dim)  # the fixed vectors' width
    _mining_peak(mine(200, "warm"))  # the first run in a process imports and starts what later ones reuse
    peaks = {}
    for n in (200, 2000):
        result, peaks[n] = _mining_peak(mine(n, f"mined{n}"))
        assert result["examples"] == n and result["blocks"] == -(-n // 64)
    assert peaks[2000] - peaks[200] < bound, peaks
    if margin is None:
        kept: list = []
        monkeypatch.setattr(mining, "store_query_vectors", _vectors_kept_by_the_driver(9, vectors.shape, kept))
        _, regressed = _mining_peak(mine(2000, "regressed"))
        assert len(kept) == -(-2000 // 64) and np.array_equal(np.concatenate(kept), vectors)
        assert regressed - peaks[200] > bound, (regressed, peaks)
        peaks["regressed"] = regressed
    print("driver growth, MiB:", {n: round(p / 2**20, 1) for n, p in peaks.items()})
    # The first 200 queries' negatives against brute force over the same vectors.
    _, _, corpus = read_all(str(tmp_path / "corpus" / "emb"))
    scores, top = brute_force_topk(vectors[:200], corpus, 20)
    mined = [json.loads(line) for line in open(tmp_path / "mined200" / "negatives.jsonl")]
    dropped = 0
    for i, record in enumerate(mined):
        positive = float(vectors[i] @ corpus[i % n_docs])
        kept = [r for r, score in zip(top[i], scores[i]) if margin is None or score <= positive - margin]
        dropped += len(top[i]) - len(kept)
        expected = [f"doc-{r:07d}" for r in kept if r != i % n_docs][:5]
        assert record["query_id"] == f"q{i}" and record["negatives"] == expected, i
    assert (dropped > 0) == (margin is not None)  # the margin dropped some, so it was tested


@pytest.mark.release_check
@pytest.mark.runs_long  # six evaluations, two with a 4,096-wide encoder: 2-3 minutes in the suite
def test_evaluations_driver_memory_does_not_grow_with_the_query_vectors(collection, tmp_path, monkeypatch, shared_ray):
    """The driver's resident peak (``resident_growth``) evaluating the same 1,000 queries with
    a 64-wide and a 4,096-wide encoder, in search blocks of 64: the encoders store each
    block's vectors and each searcher reads a block as it searches it, so the wide vectors'
    16 MiB must not reach the driver. The queries' ids, texts, judgments and run lines are
    the same in both runs, so the difference is what the vectors' width costs the driver
    (measured: 3.3 and 3.3 MiB; a driver that read them all, 3.5 and 34.6). Nor does the
    driver put a block of vectors in its node's object store. The metrics are ir_measures'
    on the run file, which holds brute force's top 10 of vectors encoded in the test."""
    import ray

    from pipeline.retrieval import evaluate as evaluation
    from pipeline.retrieval.encode import local_encoder
    from tests.helpers import save_tiny_bert

    docs, n = collection["docs"], 1000
    models = {
        width: save_tiny_bert(
            str(tmp_path / f"width{width}"),
            [d["text"] for d in docs],
            hidden_size=width,
            num_layers=1,
            num_heads=4,
            intermediate_size=64,
        )
        for width in (64, 4096)
    }
    monkeypatch.setattr(evaluation, "query_block_of", lambda index, searchers, k, queries: 64)
    picked = np.random.default_rng(n).integers(0, N_DOCS, n)
    queries = [{"_id": f"q{i}", "text": " ".join(docs[d]["text"].split()[:5])} for i, d in enumerate(picked)]
    qrels = tmp_path / "qrels.tsv"
    write_jsonl(tmp_path / "queries.jsonl", queries)
    qrels.write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\t{docs[d]['_id']}\t1\n" for i, d in enumerate(picked))
    )

    def job(width: int):
        return evaluation.EvaluateJobConfig(
            encoder=EncoderSettings(model=models[width], pooling="mean", similarity="cos"),
            corpus=collection["corpus"],
            queries=str(tmp_path / "queries.jsonl"),
            qrels=str(qrels),
            k=10,
            docs_per_shard=45,
            output=str(tmp_path / f"eval{width}"),
            pool=ActorConfig(actors=1),
        )

    # The first run in a process imports and loads what later ones reuse (plotting, the
    # tokenizer), and each folder's first run prepares its passages: untraced runs first, so
    # that the traced ones differ by the query vectors' width alone.
    for width in models:
        evaluation.run_evaluation(job(width))
    # Pages the driver writes into its node's object store are touched once and kept mapped,
    # so its resident peak cannot tell a block put there from one that was not: what it puts
    # is recorded instead.
    put = ray.put
    put_bytes = []
    monkeypatch.setattr(
        ray, "put", lambda value, **kw: put_bytes.append(getattr(value, "nbytes", 0)) or put(value, **kw)
    )
    peaks, summaries = {}, {}
    for width in models:
        # Allocator and thread timing move one reading by a MiB or two: the lower of two runs
        # is kept (a driver that held the vectors would hold them in both).
        (summaries[width], first), (_, again) = (
            resident_growth(evaluation.run_evaluation, job(width)) for _ in range(2)
        )
        peaks[width] = min(first, again)
        assert summaries[width]["search_blocks"] == -(-n // 64) and summaries[width]["judged_queries"] == n
        assert summaries[width]["index_shards_built"] == 0 and summaries[width]["search_blocks_resumed"] == 0
        assert not os.path.exists(tmp_path / f"eval{width}" / "search")  # the stored vectors went with the parts
    print("driver growth, MiB:", {w: round(p / 2**20, 1) for w, p in peaks.items()})
    assert peaks[4096] - peaks[64] < 5 * 2**20, peaks
    assert put_bytes and max(put_bytes) < 4096, max(put_bytes)  # none of them vectors (64 narrow ones: 16 KiB)
    # The metrics are ir_measures' on the job's run file; the run is brute force's top 10 of
    # this test's encoding, score for score (ids may swap between scores tied to 1e-6).
    run_file = str(tmp_path / "eval64" / "run.trec")
    shown, expected = summaries[64]["metrics"], ir_measures_of_run(run_file, str(qrels))
    assert set(shown) == {"MRR@10", "R@10", "nDCG@10"}  # a run 10 deep reaches no further
    assert shown == pytest.approx({m: expected[m] for m in shown}, abs=1e-6)
    encoder = local_encoder(EncoderSettings(model=models[64], pooling="mean", similarity="cos"))
    _, _, corpus = read_all(str(tmp_path / "eval64" / "embeddings"))
    texts = read_queries(str(tmp_path / "queries.jsonl"))
    scores, _ = brute_force_topk(encoder.encode_texts(list(texts.values()), 32), corpus, 10)
    ran = collections.defaultdict(list)
    for line in open(run_file):
        qid, _, _, _, score, _ = line.split()
        ran[qid].append(float(score))
    assert np.asarray([ran[q] for q in texts]) == pytest.approx(scores, abs=1e-4)


def test_mining_drivers_memory_does_not_grow_with_the_corpus(encoded, collection, tmp_path, monkeypatch):
    """The driver's resident peak (``resident_growth``) during a mining run over 20k and over
    200k passages, same queries: the corpus's ids stay on the searchers and results stream,
    so 180k more passages may add at most 2 MiB. Holding the ids here as CorpusIds would add
    ~5 MB, as a dict ~25 MB."""
    from pipeline.retrieval import mine as mining
    from pipeline.retrieval.mine import MineConfig

    cfg, summary = encoded
    # The query encoder is not what is measured (its pool is tested above): fixed vectors.
    vectors = np.random.default_rng(5).standard_normal((20, summary["dim"])).astype(np.float32)
    monkeypatch.setattr(mining, "store_query_vectors", _fixed_query_vectors(vectors))
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\tdoc-{i:07d}\t1\n" for i in range(20)))
    peaks = {}
    for n, name in ((20_000, "warm"), (20_000, "mined20000"), (200_000, "mined200000")):
        mine = MineConfig(
            index=_synthetic_corpus_index(tmp_path / f"c{n}", n, summary["dim"]),
            queries=collection["queries"],
            qrels=str(qrels),
            output=str(tmp_path / name),
            depth=100,
            count=10,
            encoder=cfg.encoder,
            pool=ActorConfig(actors=1),
        )
        result, peaks[n] = _mining_peak(mine)  # the warm run's is overwritten: it pays for first use
        assert result["negatives_per_query"] == 10 and result["examples"] == 20
    assert peaks[200_000] - peaks[20_000] < 2 * 2**20, peaks
    print("driver growth, MiB:", {n: round(p / 2**20, 1) for n, p in peaks.items()})
