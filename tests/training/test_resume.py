"""A run interrupted between checkpoints and resumed ends with exactly the weights of an
uninterrupted run (CPU, fp32, one worker): the data order, the packing, the masking and
dropout draws, the optimiser and the schedule all continue as if nothing had happened."""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from typing import Callable

import pytest
import torch
from conftest import synthetic_docs, write_jsonl
from safetensors.torch import load_file

from models.backbone import BackboneConfig
from pipeline.core import model_ref
from pipeline.core.errors import ConfigError, InputError
from pipeline.data.prepare import PrepareConfig
from pipeline.training import finetune, pretrain
from pipeline.training.driver import fit
from pipeline.training.train_config import TrainConfig
from tests.helpers import memory_gib_for_state, save_tiny_bert, save_tiny_decoder

pytestmark = pytest.mark.ray


class StopOnce:
    """The wrapped task (one worker), failing once with ``error`` at the ``at + 1``-th
    micro-batch of the run: a worker dying between checkpoints, or a bad record. The marker
    file counts every micro-batch given to any attempt, one line each."""

    def __init__(self, task, at: int, marker: str, error: BaseException | Callable | None = None):
        self.task, self.at, self.marker = task, at, marker
        # An exception, or what makes one in the worker (one that does not unpickle
        # cannot be sent there)
        self.error = error or RuntimeError("interrupted between checkpoints (test)")

    def __getattr__(self, name):
        if name == "task":  # while unpickling, before __init__'s attributes exist
            raise AttributeError(name)
        return getattr(self.task, name)

    def backward(self, engine, batch):
        with open(self.marker, "a") as f:
            f.write("micro-batch\n")
        # Past the count, the first to claim the failure raises it: with two workers, both can
        # append before either reads, so an equality test on the count missed it (CI, once).
        if open(self.marker).read().count("\n") > self.at and self._claim():
            raise self.error() if callable(self.error) else self.error
        return self.task.backward(engine, batch)

    def _claim(self) -> bool:
        try:
            os.close(os.open(self.marker + ".failed", os.O_CREAT | os.O_EXCL))  # atomic: one process wins
            return True
        except FileExistsError:
            return False


def interrupted(monkeypatch, module, at: int, marker: str, error: BaseException | Callable | None = None) -> None:
    """Make ``module``'s runs fail once at micro-batch ``at``."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import a test module
    monkeypatch.setattr(
        module, "fit", lambda train, task, *a, **k: fit(train, StopOnce(task, at, marker, error), *a, **k)
    )


def weights(export_dir: str) -> dict[str, torch.Tensor]:
    local = model_ref.materialize(export_dir)
    return {
        f"{name}:{key}": value
        for name in sorted(os.listdir(local))
        if name.endswith(".safetensors")
        for key, value in load_file(os.path.join(local, name)).items()
    }


def assert_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"{len(differing)} of {len(a)} tensors differ, e.g. {differing[:3]}"


def train_settings(out: str, **overrides) -> TrainConfig:
    settings = dict(output=out, num_workers=1, zero_stage=1, lr=1e-3, log_every=2, checkpoint_every=3, max_failures=1)
    return TrainConfig(**{**settings, **overrides})


@pytest.mark.runs_long  # three Ray Train runs (whole, stopped, rerun): 1.5 minutes in the suite
def test_pretraining_stopped_then_rerun_past_damaged_checkpoints_ends_with_the_uninterrupted_weights(
    tmp_path, monkeypatch, ray_session, capfd
):
    """Condenser with packing (documents cut across sequences) and dropout, rows shuffled in
    windows, 20 steps. The uninterrupted run's logs are read as a job's log file would be.
    The other run stops at micro-batch 15 (a worker lost, no retry left); its newest
    checkpoint (12) is then truncated (the listing shows it) and the one before (8) has a
    byte changed (only the worker's hashing shows it). Rerun with the same command, it
    passes both over, resumes from checkpoint 4, and ends with the same losses and weights,
    its new checkpoints saved beside (not over) the folders Ray Train registered. Each next
    micro-batch is masked in the collate thread, as on GPUs, which changes none of it."""
    raw = write_jsonl(tmp_path / "raw.jsonl", synthetic_docs(90, seed=7))

    def config(name: str) -> pretrain.PretrainConfig:
        cfg = pretrain.PretrainConfig()
        cfg.corpus = PrepareConfig(input=raw, output=str(tmp_path / "corpus"), vocab_size=120, docs_per_shard=40)
        cfg.data = pretrain.StreamConfig(max_len=24, pack=True, shuffle_window=16)
        cfg.model = BackboneConfig(
            hidden_size=32, num_layers=4, num_heads=2, intermediate_size=64, max_position=64, dropout=0.1
        )
        cfg.train = train_settings(str(tmp_path / name), micro_batch_size=8, max_steps=20, checkpoint_every=4)
        cfg.train.log_every, cfg.train.keep_checkpoints, cfg.train.max_failures = 4, 3, 0
        cfg.train.collate_ahead = "on"  # each next micro-batch masked in a thread: as on GPUs
        return cfg

    capfd.readouterr()
    whole = pretrain.run_pretraining(config("whole"))
    time.sleep(2)  # worker lines reach the driver through Ray's log monitor, a moment later
    out, err = capfd.readouterr()
    # Quiet logs: nothing on stdout (a job prints its JSON summary there, alone), one line per
    # log step (not Ray Train's copy of each report too), few lines in all.
    lines = err.splitlines()
    assert out == "" and len(lines) <= 100, (out, len(lines))
    assert [json.loads(line[line.index("{") :])["step"] for line in lines if '"loss": ' in line] == [4, 8, 12, 16, 20]
    assert not [line for line in lines if "Reporting training result" in line or "Setting accelerator" in line]

    interrupted(monkeypatch, pretrain, at=15, marker=str(tmp_path / "stopped"))
    with pytest.raises(Exception, match="interrupted between checkpoints"):
        pretrain.run_pretraining(config("resumed"))
    monkeypatch.undo()
    run_dir = tmp_path / "resumed" / "checkpoints"
    assert sorted(p.name for p in run_dir.glob("checkpoint_0*")) == [f"checkpoint_{s:09d}" for s in (4, 8, 12)]
    states = {step: sorted((run_dir / f"checkpoint_{step:09d}" / "state").rglob("*.pt")) for step in (8, 12)}
    os.truncate(states[12][0], os.path.getsize(states[12][0]) // 2)
    data = bytearray(states[8][0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    states[8][0].write_bytes(bytes(data))
    capfd.readouterr()

    rerun = config("resumed")
    rerun.train.max_failures = 1  # the start that finds checkpoint 8's bytes changed fails once
    resumed = pretrain.run_pretraining(rerun)
    time.sleep(2)
    err = capfd.readouterr().err
    assert f"checkpoint_000000012 is not whole ({states[12][0].relative_to(run_dir / 'checkpoint_000000012')}" in err
    assert "checkpoint_000000008 is damaged" in err and "SHA-256 differs" in err
    event = resumed["resumes"][-1]
    assert event["checkpoint"] == "checkpoint_000000004" and event["rows_repeated"] == event["rows_skipped"] == 0
    losses = [[h["loss"] for h in json.load(open(tmp_path / name / "history.json"))] for name in ("whole", "resumed")]
    assert losses[0] == losses[1]  # steps 4 to 20, 8 to 20 after the resume
    assert_identical(weights(whole["export_dir"]), weights(resumed["export_dir"]))
    assert (run_dir / "checkpoint_000000020-r1").is_dir()


@pytest.mark.runs_long  # three 2-worker Ray Train runs, one interrupted: 1.5 minutes alone, 2-4 in the suite
def test_a_step_sized_from_memory_trains_as_the_same_split_set_by_hand_and_a_resume_keeps_it(
    tmp_path, monkeypatch, ray_session
):
    """MLM with dropout, 2 ZeRO-2 workers, 8 rows a step. Sized from (almost) no memory, a
    step is split into 8 micro-batches of one row: the run equals one configured as 1 x 8 by
    hand, losses and weights. Interrupted, then rerun on a worker with memory for the whole
    step, it keeps its first attempt's split and still ends with the same weights."""
    raw = write_jsonl(tmp_path / "raw.jsonl", synthetic_docs(60, seed=3))

    def config(name: str, **train) -> pretrain.PretrainConfig:
        cfg = pretrain.PretrainConfig()
        cfg.method = "mlm"
        cfg.corpus = PrepareConfig(input=raw, output=str(tmp_path / "corpus"), vocab_size=120, docs_per_shard=30)
        cfg.data = pretrain.StreamConfig(max_len=24, pack=True)
        cfg.model = BackboneConfig(
            hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=64, dropout=0.1
        )
        cfg.train = train_settings(
            str(tmp_path / name), num_workers=2, zero_stage=2, max_steps=4, checkpoint_every=2, max_failures=0, **train
        )
        return cfg

    by_hand = pretrain.run_pretraining(config("by_hand", micro_batch_size=1, grad_accum=8))
    assert (by_hand["micro_batch_size"], by_hand["grad_accum"]) == (1, 8)

    sized = dict(micro_batch_size=8, grad_accum=1, size_micro_batch="on")
    # The marker counts both workers' micro-batches: the 41st falls in step 3, after checkpoint 2.
    # The error raised there does not unpickle: its message still reaches the driver (WorkerError).
    error = functools.partial(NeedsTwoArguments, "interrupted between checkpoints (test)", {})
    interrupted(monkeypatch, pretrain, at=40, marker=str(tmp_path / "stopped"), error=error)
    # (Almost) no memory beside the model's own state: one row at a time.
    params = sum(w.numel() for w in weights(by_hand["export_dir"]).values())
    with pytest.raises(Exception, match="interrupted between checkpoints"):
        pretrain.run_pretraining(config("sized", memory_gib=memory_gib_for_state(params, 2, 2), **sized))
    monkeypatch.undo()
    resumed = pretrain.run_pretraining(config("sized", memory_gib=64, **sized))  # 8 rows would fit now

    assert (resumed["micro_batch_size"], resumed["grad_accum"]) == (1, 8)
    (event,) = resumed["resumes"]
    assert event["checkpoint"] == "checkpoint_000000002" and "micro_batch_resized" not in event
    losses = [[h["loss"] for h in json.load(open(tmp_path / name / "history.json"))] for name in ("by_hand", "sized")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert_identical(weights(by_hand["export_dir"]), weights(resumed["export_dir"]))


@pytest.mark.parametrize(
    "backbone,stage",
    # 2-3 Ray Train runs each: bert's 143 s in CI's suite (stop 93), so both are long checks
    [pytest.param("bert", 1, marks=pytest.mark.runs_long), pytest.param("qwen2", 3, marks=pytest.mark.runs_long)],
)
def test_finetuning_resumed_mid_epoch_ends_with_the_weights_of_an_uninterrupted_run(
    tmp_path, monkeypatch, ray_session, backbone, stage
):
    """The contrastive retriever with hard negatives sliding through each query's list and
    dropout: interrupted at micro-batch 6 of 8 (epoch 2 of 2), resumed from checkpoint 3.
    A BERT at ZeRO-1, and a decoder (last-token pooling) at ZeRO-3 with every weight
    partitioned, whose checkpoint holds the partitions and their optimiser state."""
    import json

    docs = synthetic_docs(60, seed=2)
    texts = [d["text"] for d in docs]
    if backbone == "bert":
        model = save_tiny_bert(str(tmp_path / "init"), texts, dropout=0.1)
    else:
        model = save_tiny_decoder(str(tmp_path / "init"), backbone, texts, attention_dropout=0.1)
    deepspeed_config = ""
    if stage == 3:  # the stage-3 template, with tiny weights partitioned too (not kept whole)
        from importlib import resources

        template = json.loads(resources.files("pipeline.training").joinpath("zero_templates/zero3.json").read_text())
        template["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        deepspeed_config = str(tmp_path / "zero3.json")
        open(deepspeed_config, "w").write(json.dumps(template))
    queries, qrels, negatives = tmp_path / "queries.jsonl", tmp_path / "qrels.tsv", tmp_path / "negatives.jsonl"
    queries.write_text(
        "".join(json.dumps({"_id": f"q{i}", "text": " ".join(docs[i]["text"].split()[:4])}) + "\n" for i in range(16))
    )
    qrels.write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\t{docs[i]['_id']}\t1\n" for i in range(16)))
    negatives.write_text(
        "".join(
            json.dumps({"query_id": f"q{i}", "negatives": [docs[(i + k) % 60]["_id"] for k in range(1, 7)]}) + "\n"
            for i in range(16)
        )
    )

    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)  # once: a rewritten input is prepared again

    def config(name: str) -> finetune.FinetuneConfig:
        cfg = finetune.FinetuneConfig()
        cfg.data.queries, cfg.data.qrels, cfg.data.negatives = str(queries), str(qrels), str(negatives)
        cfg.corpus.input, cfg.corpus.docs_per_shard = corpus, 30
        cfg.corpus.output = str(tmp_path / "prepared")  # shared by the runs: prepared once
        cfg.data.query_max_len, cfg.data.passage_max_len = 12, 24
        cfg.model.init = model
        cfg.retriever.group_size = 3
        cfg.train = train_settings(
            str(tmp_path / name),
            micro_batch_size=4,
            max_steps=8,
            zero_stage=stage,
            deepspeed_config=deepspeed_config,
        )
        return cfg

    whole = finetune.run_finetuning(config("whole"))
    interrupted(monkeypatch, finetune, at=5, marker=str(tmp_path / "stopped"))
    resumed = finetune.run_finetuning(config("resumed"))

    assert resumed["restarts"] == 1 and resumed["resumes"][-1]["checkpoint"] == "checkpoint_000000003"
    # What ran, counted outside the run's own record: 6 micro-batches given to the first
    # attempt (the 6th failed), then the 5 after checkpoint 3. Mutation: a restart from step
    # 0 (which also ends with these weights) runs 6 + 8 = 14.
    assert (tmp_path / "stopped").read_text().count("\n") == 11
    assert_identical(weights(whole["export_dir"]), weights(resumed["export_dir"]))


def test_a_user_error_in_a_worker_stops_the_next_attempt_at_its_start(tmp_path, monkeypatch):
    """Ray Train retries a failed worker group max_failures times; an error the same input
    makes again (a bad record) is written down by the worker that met it, every worker of the
    next attempt stops at its start, and the driver raises the error itself (a job: exit 2).
    (Ray Train's retry between the two attempts is the one the tests above go through.)"""
    from pipeline.training import failures, worker

    run_dir = str(tmp_path / "checkpoints")

    class BadRecord:
        def __init__(self, config):
            raise InputError("train.jsonl line 6: a bad record")

    monkeypatch.setattr(worker, "WorkerRun", BadRecord)
    with pytest.raises(InputError, match="line 6: a bad record"):
        worker.train_worker({"run_dir": run_dir})  # the attempt that meets it
    monkeypatch.setattr(worker, "WorkerRun", lambda config: pytest.fail("the next attempt trained again"))
    assert worker.train_worker({"run_dir": run_dir}) == {
        "user_error": {"kind": "InputError", "message": "train.jsonl line 6: a bad record"}
    }
    with pytest.raises(InputError, match="line 6: a bad record"):
        failures.raise_user_error(os.path.join(run_dir, failures.USER_ERROR))  # what fit() does then


class NeedsTwoArguments(AssertionError):
    """Pickles, but does not unpickle: rebuilt from ``args`` alone, it misses ``config``."""

    def __init__(self, message, config):
        super().__init__(message)
        self.config = config


class HoldsALock(AssertionError):
    """Does not pickle at all."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


@pytest.mark.parametrize("error", [NeedsTwoArguments("tiling split", {}), HoldsALock("tiling split")])
def test_a_worker_error_that_cannot_reach_the_controller_is_raised_as_text(tmp_path, monkeypatch, error):
    """A worker's exception goes to Ray Train's controller pickled; one that does not come
    back whole (torch 2.11's Inductor raised such an AssertionError) is raised as a
    WorkerError carrying its type, message and traceback, which does."""
    from ray import cloudpickle

    from pipeline.training import failures, worker

    def build(config):
        raise error

    monkeypatch.setattr(worker, "WorkerRun", build)
    with pytest.raises(failures.WorkerError) as raised:
        worker.train_worker({"run_dir": str(tmp_path)})
    text = str(raised.value)
    assert text.startswith(f"{type(error).__name__}: tiling split\n") and "in build" in text
    assert str(cloudpickle.loads(cloudpickle.dumps(raised.value))) == text

    monkeypatch.setattr(worker, "WorkerRun", lambda config: (_ for _ in ()).throw(AssertionError("plain")))
    with pytest.raises(AssertionError, match="plain"):  # one that round-trips is raised as it was
        worker.train_worker({"run_dir": str(tmp_path)})


def test_a_full_disk_stops_the_next_attempt_too_and_names_the_run_folder(tmp_path, monkeypatch, shared_ray):
    """A full disk met by a worker (here in a Ray Data task's text, as pyarrow says it): its
    marker cannot be written to the run folder (that disk is full), so it goes to Ray's
    key-value store; the next attempt stops at its start, the driver raises it naming the
    folder, and the next run's start clears it. Mutation: the marker write swallowed on a
    full disk (as before): the next attempt trains again, and Ray Train's every retry met
    the same disk, a traceback each."""
    from pipeline.core.errors import OutOfSpace, StorageError
    from pipeline.training import failures, worker

    run_dir = str(tmp_path / "checkpoints")
    marker = os.path.join(run_dir, failures.USER_ERROR)

    class FullDisk:
        def __init__(self, config):
            raise RuntimeError("ray.data UserCodeException: [errno 28] No space left on device")

    def no_space(uri, obj, **_):
        raise StorageError(f"cannot write {uri}: [Errno 28] No space left on device")

    monkeypatch.setattr(worker, "WorkerRun", FullDisk)
    monkeypatch.setattr(failures.storage, "write_json", no_space)
    with pytest.raises(OutOfSpace, match=f"no space left writing {run_dir} "):
        worker.train_worker({"run_dir": run_dir})
    assert not os.path.exists(marker)
    monkeypatch.setattr(worker, "WorkerRun", lambda config: pytest.fail("the next attempt trained again"))
    assert worker.train_worker({"run_dir": run_dir})["user_error"]["kind"] == "OutOfSpace"
    with pytest.raises(OutOfSpace, match=f"no space left writing {run_dir} "):
        failures.raise_user_error(marker)
    failures.forget_user_error(marker)
    assert failures.recorded_user_error(marker) is None


def test_a_failed_compile_is_the_users_error_and_not_retried(tmp_path, monkeypatch):
    """With --train.compile, torch.compile's failure (here a backend raising, as torch 2.11's
    Inductor did on an H200) is a ConfigError naming the flag: written down, so Ray Train's
    next attempt stops at its start instead of compiling again."""
    from pipeline.training import worker

    def failing_backend(graph, example_inputs):
        raise AssertionError("tiling split")

    doubled = torch.compile(lambda x: x * 2, backend=failing_backend)

    class Compiling:
        def __init__(self, config):
            doubled(torch.ones(3))

    run_dir = str(tmp_path / "checkpoints")
    monkeypatch.setattr(worker, "WorkerRun", Compiling)
    with pytest.raises(ConfigError, match=r"--train.compile: torch .* could not compile the model .*tiling split"):
        worker.train_worker({"run_dir": run_dir, "train": TrainConfig(compile=True)})
    monkeypatch.setattr(worker, "WorkerRun", lambda config: pytest.fail("the next attempt compiled again"))
    assert worker.train_worker({"run_dir": run_dir})["user_error"]["kind"] == "ConfigError"

    # Without --train.compile the same error is no user error (not what compile_in_place made).
    monkeypatch.setattr(worker, "WorkerRun", Compiling)
    with pytest.raises(Exception, match="tiling split") as raised:
        worker.train_worker({"run_dir": str(tmp_path / "eager"), "train": TrainConfig(compile=False)})
    assert not isinstance(raised.value, ConfigError)


def test_a_damaged_shard_read_by_ray_data_reaches_the_worker_as_the_users_error(tmp_path, shared_ray):
    """A corpus shard damaged inside (its size and footer intact: only reading it finds it)
    fails a Ray Data task, which wraps the error in a UserCodeException whose cause is lost
    on the way to the training worker (``user_error`` finds nothing). The worker still
    names it, so the job ends with that one line (exit 2) instead of retrying."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from pipeline.core.errors import ArtifactError
    from pipeline.data.shards import shard_dataset

    shard = str(tmp_path / "part-00000.parquet")
    ids = pa.array([list(range(i, i + 50)) for i in range(400)], pa.list_(pa.int32()))
    pq.write_table(pa.table({"row": np.arange(400), "input_ids": ids}), shard, row_group_size=4096)
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 3 : len(data) // 3 + 200] = b"x" * 200
    open(shard, "wb").write(bytes(data))

    def rows(tokens, **_):
        return {"rows": np.array([len(tokens["row"])])}

    @ray.remote
    def consume(dataset):  # as a training worker reads its stream
        from pipeline.core.entry import user_error
        from pipeline.training.failures import fed_user_error

        try:
            for _ in dataset.iter_batches():
                pass
        except Exception as exc:  # noqa: BLE001 - whatever the iterator raises
            return user_error(exc), fed_user_error(exc)

    plain, fed = ray.get(consume.remote(shard_dataset([{"uri": shard}], rows, {})))
    assert plain is None  # the chain lost on the way
    assert isinstance(fed, ArtifactError), fed
    assert str(fed).startswith(f"corpus shard {shard} is damaged (") and str(fed).endswith(
        "): --corpus.overwrite true prepares the corpus again"
    ), fed


def test_a_full_disk_in_a_worker_ends_the_run_naming_it_though_no_marker_could_be_written():
    """A worker that fills the disk cannot write its user-error marker there: the driver
    reads the cause from the text of Ray Train's error (its workers' tracebacks) instead."""
    from pipeline.core.errors import OutOfSpace
    from pipeline.training.failures import fed_user_error

    failed = Exception(
        "Training failed due to worker errors:\n[Rank 0 Error Snippet]:\nTraceback (most recent call last):\n"
        '  File "pyarrow/error.pxi", line 92, in pyarrow.lib.check_status\n'
        "OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device\n"
    )
    full = fed_user_error(failed)
    assert isinstance(full, OutOfSpace) and str(full).startswith(
        "no space left writing the outputs (OSError: [Errno 28] Error writing bytes to file."
    ), full
    assert fed_user_error(Exception("Training failed due to worker errors: ZeroDivisionError")) is None
