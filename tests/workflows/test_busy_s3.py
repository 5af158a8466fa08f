"""Whole stages on a busy S3: every input and output behind tests/faulty_s3.py (a few per
cent of requests throttled or failed, connections reset after the server acted, a
throttling storm every few hundred requests), for the driver and every Ray worker. Each
stage finishes, and what it wrote equals what a fault-free run writes."""

from __future__ import annotations

import json
import os

import pytest
from conftest import _local_ray, _shutdown_if_owner, synthetic_docs

from pipeline.core import storage
from pipeline.core.entry import run_job
from tests.faulty_s3 import FaultPlan, FaultyS3
from tests.helpers import save_tiny_bert

pytestmark = [pytest.mark.ray, pytest.mark.release_check]  # whole runs; each storage call on a busy S3: tests/core


@pytest.fixture(scope="module")
def busy_ray(s3_endpoint, request):
    """A Ray of this module's own whose every process reaches S3 through the proxy."""
    plan = FaultPlan(error_rate=0.05, reset_rate=0.01, storm_every=500, storm_s=2.0, seed=11)
    proxy = FaultyS3(s3_endpoint, plan).start()
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "RAYDENSE_S3_RETRY_SECONDS")}
    os.environ.update(AWS_ENDPOINT_URL=proxy.endpoint, RAYDENSE_S3_RETRY_SECONDS="60")
    _local_ray(request.module.__name__)
    yield proxy
    _shutdown_if_owner(request.module.__name__)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    proxy.stop()


def _collection_on_s3(bucket: str, tmp_path) -> dict[str, str]:
    docs = synthetic_docs(120, seed=21)
    queries = [{"_id": f"q{i}", "text": " ".join(docs[i]["text"].split()[:4])} for i in range(0, 120, 6)]
    qrels = "query-id\tcorpus-id\tscore\n" + "".join(f"{q['_id']}\td{q['_id'][1:]}\t1\n" for q in queries)
    files = {
        "corpus": "".join(json.dumps(d) + "\n" for d in docs),
        "queries": "".join(json.dumps(q) + "\n" for q in queries),
        "qrels": qrels,
    }
    paths = {name: f"s3://{bucket}/beir/{name}.{'tsv' if name == 'qrels' else 'jsonl'}" for name in files}
    for name, text in files.items():
        storage.write_bytes(paths[name], text.encode())
    model = save_tiny_bert(str(tmp_path / "model"), [d["text"] for d in docs])
    paths["model"] = storage.upload_dir(model, f"s3://{bucket}/model")
    return paths


def _evaluate(paths: dict[str, str], output: str) -> dict:
    from pipeline.retrieval.evaluate import EvaluateJobConfig, run_evaluation

    argv = [
        *("--encoder.model", paths["model"], "--corpus", paths["corpus"], "--queries", paths["queries"]),
        *("--qrels", paths["qrels"], "--output", output, "--k", "20", "--docs_per_shard", "30"),
        *("--encoder.passage_max_len", "32", "--encoder.query_max_len", "12"),
    ]
    return run_job(EvaluateJobConfig, run_evaluation, None, argv)


@pytest.mark.runs_long  # two evaluations on Ray: 60-80 s on 2 cores (each storage call's faults: tests/core)
def test_an_evaluation_on_a_busy_s3_writes_what_a_quiet_one_writes(busy_ray, s3_bucket, tmp_path):
    """The issue's failure: an encoder actor's constructor met a 503 on a HeadObject and the
    job died on ActorDiedError. Here the corpus, queries, qrels, model and every output are
    on S3 and its faults reach the actors; the run file and metrics equal a quiet run's.
    Mutation: ``retrying`` calling once (pyarrow's 3 quick attempts only) fails it in the
    storms."""
    proxy = busy_ray
    proxy.faults = False
    paths = _collection_on_s3(s3_bucket, tmp_path)
    quiet = _evaluate(paths, f"s3://{s3_bucket}/quiet")
    proxy.faults = True
    injected = proxy.counts.injected
    busy = _evaluate(paths, f"s3://{s3_bucket}/busy")
    assert proxy.counts.injected - injected > 10 and proxy.counts.throttled_in_storms > 0
    assert busy["metrics"] == quiet["metrics"]
    proxy.faults = False
    assert storage.read_bytes(f"s3://{s3_bucket}/busy/run.trec") == storage.read_bytes(
        f"s3://{s3_bucket}/quiet/run.trec"
    )


@pytest.mark.runs_long  # two pre-trainings: about 2 minutes
def test_pretraining_streamed_from_a_busy_s3_trains_the_weights_of_a_quiet_one(busy_ray, s3_bucket, tmp_path):
    """One worker, the corpus prepared on S3 and streamed from it by Ray Data, checkpoints and
    the export on S3: the exported weights are bit-equal to a fault-free run's. The issue's
    failure: exit 2, "cannot stat .../user_error.json ... HTTP status 503"."""
    from models.backbone import BackboneConfig
    from pipeline.data.prepare import PrepareConfig
    from pipeline.training.pretrain import PretrainConfig, StreamConfig, run_pretraining
    from pipeline.training.train_config import TrainConfig

    proxy = busy_ray
    proxy.faults = False
    corpus = f"s3://{s3_bucket}/raw/corpus.jsonl"
    storage.write_bytes(corpus, "".join(json.dumps(d) + "\n" for d in synthetic_docs(96, seed=4)).encode())

    def pretrain(name: str) -> bytes:
        cfg = PretrainConfig()
        cfg.corpus = PrepareConfig(
            input=corpus, output=f"s3://{s3_bucket}/{name}/corpus", vocab_size=120, docs_per_shard=24
        )
        cfg.data = StreamConfig(max_len=32, pack=False)
        cfg.model = BackboneConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=64)
        cfg.train = TrainConfig(
            output=f"s3://{s3_bucket}/{name}/run", num_workers=1, micro_batch_size=6, max_steps=16, checkpoint_every=4
        )
        summary = run_pretraining(cfg)
        assert summary["steps"] == 16
        proxy.faults = False
        weights = storage.read_bytes(storage.join(summary["export_dir"], "model.safetensors"))
        return weights

    quiet = pretrain("quiet")
    proxy.faults = True
    injected = proxy.counts.injected
    busy = pretrain("busy")
    assert proxy.counts.injected - injected > 10
    assert busy == quiet


@pytest.mark.runs_long  # two fine-tunings on Ray Train: about 2 minutes
def test_fine_tuning_on_a_busy_s3_trains_the_weights_of_a_quiet_one(busy_ray, s3_bucket, tmp_path):
    """BEIR data, the corpus's preparation, BM25 negatives, checkpoints and the export all on
    S3, one worker: the exported weights are bit-equal to a fault-free run's. Mutation:
    ``storage.is_transient`` answering False for every error: the corpus's staging meets
    SlowDown on a CreateMultipartUpload and the run ends on StorageError (exit 2)."""
    from pipeline.training.finetune import FinetuneConfig, run_finetuning
    from pipeline.training.train_config import TrainConfig

    proxy = busy_ray
    proxy.faults = False
    paths = _collection_on_s3(s3_bucket, tmp_path)

    def finetune(name: str) -> bytes:
        cfg = FinetuneConfig()
        cfg.data.queries, cfg.data.qrels, cfg.data.negatives = paths["queries"], paths["qrels"], "bm25"
        cfg.data.bm25_count, cfg.data.query_max_len, cfg.data.passage_max_len = 6, 12, 24
        cfg.corpus.input, cfg.corpus.docs_per_shard = paths["corpus"], 40
        cfg.model.init = paths["model"]
        cfg.retriever.group_size = 3
        cfg.train = TrainConfig(
            output=f"s3://{s3_bucket}/{name}/run",
            num_workers=1,
            micro_batch_size=4,
            max_steps=0,
            epochs=1,
            lr=1e-3,
            checkpoint_every=2,
        )
        summary = run_finetuning(cfg)
        assert summary["steps"] == 5  # 20 queries, 4 a step
        proxy.faults = False
        return storage.read_bytes(storage.join(summary["export_dir"], "model.safetensors"))

    quiet = finetune("quiet")
    proxy.faults = True
    injected = proxy.counts.injected
    busy = finetune("busy")
    assert proxy.counts.injected - injected > 10
    assert busy == quiet
