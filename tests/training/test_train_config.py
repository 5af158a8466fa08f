"""The loop's pure helpers: DeepSpeed config filling, LR schedule, parameter groups, seeds,
and the workers' config as it travels through Ray Train's controller."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch

from models.backbone import BackboneConfig
from models.mlm import MLMConfig
from pipeline.training.batches import collated, timed
from pipeline.training.deepspeed_config import deepspeed_config
from pipeline.training.driver import _sealed_for_workers
from pipeline.training.engine import linear_schedule, param_groups
from pipeline.training.pretrain import PretrainTask
from pipeline.training.train_config import TrainConfig
from pipeline.training.worker import step_seed

IMPORT_PROBE = """
import json, sys
from pipeline.training.deepspeed_config import import_deepspeed
deepspeed = import_deepspeed()
from deepspeed.autotuning import autotuner
report = {"imported": "deepspeed" in sys.modules, "mlflow_loaded": "mlflow" in sys.modules,
          "autotuner_has_mlflow": autotuner.has_mlflow}
import mlflow  # still importable afterwards: the mlflow tracker imports it itself
report["mlflow_after"] = mlflow.__name__
print(json.dumps(report))
"""


def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    # A fresh interpreter: this one may have imported either module already.
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "imported": True,
        "mlflow_loaded": False,
        "autotuner_has_mlflow": False,
        "mlflow_after": "mlflow",
    }


# What Ray Train's controller does with train_loop_config: unpickle it, in a process that
# has imported only Ray. The task inside must not be unpickled there.
CONTROLLER_PROBE = """
import pickle, sys
config = pickle.loads(sys.stdin.buffer.read())
heavy = [m for m in ("torch", "transformers", "deepspeed", "models", "pipeline") if m in sys.modules]
print(sorted(config), heavy)
"""


def test_the_workers_config_passes_the_controller_unopened_and_reaches_the_workers_whole():
    train = TrainConfig(micro_batch_size=4, max_steps=3)
    task = PretrainTask("mlm", MLMConfig(), BackboneConfig(hidden_size=32), "tokenizer/", 120, None, max_len=24)
    config = {"train": train, "task": task, "run_dir": "runs/x", "deepspeed": deepspeed_config(train, 1)}
    sealed = _sealed_for_workers(config)
    done = subprocess.run(
        [sys.executable, "-c", CONTROLLER_PROBE], input=pickle.dumps(sealed), capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode().split() == ["['pickled']", "[]"]
    # A worker unseals it (train_worker does): the same settings and task.
    opened = pickle.loads(pickle.loads(pickle.dumps(sealed))["pickled"])
    assert opened["train"] == train and opened["deepspeed"] == config["deepspeed"]
    assert type(opened["task"]) is PretrainTask and vars(opened["task"]).keys() == vars(task).keys()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shipped_templates_get_every_auto_filled(stage):
    cfg = deepspeed_config(
        TrainConfig(zero_stage=stage, micro_batch_size=8, grad_accum=4, precision="bf16", grad_clip=0.5), world_size=3
    )
    assert "auto" not in json.dumps(cfg)
    assert cfg["zero_optimization"]["stage"] == stage
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (8, 4)
    assert cfg["train_batch_size"] == 8 * 4 * 3
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False


def test_one_worker_skips_zero_partitioning_but_keeps_stage_3_and_bf16_runs_its_optimizer():
    assert deepspeed_config(TrainConfig(zero_stage=2), world_size=1)["zero_optimization"]["stage"] == 0
    assert deepspeed_config(TrainConfig(zero_stage=1), world_size=1)["zero_optimization"]["stage"] == 0
    assert deepspeed_config(TrainConfig(zero_stage=3), world_size=1)["zero_optimization"]["stage"] == 3
    assert deepspeed_config(TrainConfig(zero_stage=2), world_size=2)["zero_optimization"]["stage"] == 2
    # One bf16 worker: stage 1 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer,
    # tests/training/test_bf16_worker.py); several keep their stage and DeepSpeed's own accumulation.
    one = deepspeed_config(TrainConfig(zero_stage=2, precision="bf16"), world_size=1)
    assert one["zero_optimization"]["stage"] == 1 and one["data_types"] == {"grad_accum_dtype": "fp32"}
    several = deepspeed_config(TrainConfig(zero_stage=2, precision="bf16"), world_size=2)
    assert several["zero_optimization"]["stage"] == 2 and "data_types" not in several
    assert "data_types" not in deepspeed_config(TrainConfig(zero_stage=3, precision="bf16"), world_size=1)


def test_explicit_values_in_a_user_config_win(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"gradient_clipping": 2.0, "bf16": {"enabled": False}, "zero_optimization": {"stage": 1}})
    )
    cfg = deepspeed_config(TrainConfig(deepspeed_config=str(path), zero_stage=3, precision="bf16"), world_size=1)
    assert cfg["gradient_clipping"] == 2.0 and cfg["bf16"]["enabled"] is False
    assert cfg["zero_optimization"]["stage"] == 1  # the file's stage, not train.zero_stage


def test_linear_warmup_then_linear_decay_to_zero():
    f = linear_schedule(max_steps=100, warmup_ratio=0.1)
    assert [round(f(s), 6) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.5) and f(100) == 0.0
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


def test_no_weight_decay_on_biases_and_layernorm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3  # linear bias, LayerNorm weight and bias


def test_input_wait_counts_the_time_next_blocks_not_the_consumers():
    """The loop's ``input_wait_frac``: a slow source shows, a slow step does not."""
    import time

    def slow_source():
        for item in range(3):
            time.sleep(0.1)
            yield item

    waited, seen = [0.0], []
    started = time.perf_counter()
    for item in timed(slow_source(), waited):
        time.sleep(0.2)  # the training step
        seen.append(item)
    elapsed = time.perf_counter() - started
    assert seen == [0, 1, 2]
    assert 0.3 <= waited[0] <= elapsed - 3 * 0.2


def test_collating_ahead_gives_the_same_tensors_off_the_steps_critical_path():
    """``collated`` seeds each micro-batch's generator by its micro-step, ahead or not; ahead,
    the next batch is made (in a thread) while the step trains on this one."""
    import threading
    import time

    events = []

    def make_batch(batch, generator):
        events.append(("made", batch, threading.current_thread().name))
        time.sleep(0.05)
        return {"noise": torch.rand(3, generator=generator)}

    batches = list(range(5))
    plain = [(b, t["noise"]) for b, t in collated(iter(batches), make_batch, lambda s: 100 + s, 7, ahead=False)]
    want = [torch.rand(3, generator=torch.Generator().manual_seed(100 + 7 + i)) for i in range(5)]
    assert [b for b, _ in plain] == batches and all(torch.equal(a, w) for (_, a), w in zip(plain, want))

    events.clear()
    ahead = []
    for batch, tensors in collated(iter(batches), make_batch, lambda s: 100 + s, 7, ahead=True):
        ahead.append((batch, tensors["noise"]))
        time.sleep(0.05)  # the training step
        events.append(("stepped", batch, threading.current_thread().name))
    assert [b for b, _ in ahead] == batches and all(torch.equal(a, w) for (_, a), w in zip(ahead, want))
    # In the collate thread, batch i + 1 was being made while the step on batch i ran.
    order = [(what, batch) for what, batch, _ in events]
    assert all(name.startswith("collate") for what, _, name in events if what == "made")
    assert all(order.index(("made", i + 1)) < order.index(("stepped", i)) for i in range(4))


def test_step_seeds_differ_across_ranks_and_steps():
    seeds = {step_seed(42, r, s) for r in range(4) for s in range(1000)}
    assert len(seeds) == 4000


def test_rerunning_into_another_methods_output_is_refused(tmp_path):
    from pipeline.training.pretrain import PretrainConfig, run_pretraining

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("method: condenser\n")
    cfg = PretrainConfig(method="mlm")
    cfg.train.output = str(tmp_path / "run")
    cfg.corpus.output = str(tmp_path / "corpus")
    with pytest.raises(ValueError, match="holds a condenser run"):
        run_pretraining(cfg)


def test_resuming_checkpoints_made_with_other_settings_is_refused_before_any_work(tmp_path):
    """A rerun into a run's output resumes its checkpoints: with another model shape or
    corpus, every worker would fail to load them (or train on other data from the stored
    position). Named up front instead; a changed step budget resumes."""
    from pipeline.core.runtime import write_run_files
    from pipeline.training.pretrain import PretrainConfig, run_pretraining

    def config() -> PretrainConfig:
        cfg = PretrainConfig()
        cfg.train.output, cfg.corpus.output = str(tmp_path / "run"), str(tmp_path / "missing-corpus")
        cfg.corpus.input = str(tmp_path / "raw.jsonl")
        return cfg

    write_run_files(config(), str(tmp_path / "run"))
    (tmp_path / "run" / "checkpoints" / "checkpoint_000000005").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "checkpoint_000000005" / "trainer_state.json").write_text("{}")
    changed = config()
    changed.model.hidden_size, changed.corpus.vocab_size = 64, 120
    with pytest.raises(
        ValueError,
        match=r"holds checkpoints made with other settings: --model.hidden_size 128 \(now 64\), --corpus.vocab_size 8000 \(now 120\)\. ",
    ):
        run_pretraining(changed)
    longer = config()
    longer.train.max_steps *= 2  # past the settings check: on to the corpus, which is not there
    with pytest.raises(OSError, match="raw.jsonl: no such file"):
        run_pretraining(longer)


def test_pair_fraction_counts_documents_long_enough_for_two_spans(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from models.cocondenser import CoCondenserConfig
    from pipeline.data.shards import PreparedCorpus
    from pipeline.training.pretrain import _pair_fraction

    (tmp_path / "shards").mkdir()
    lengths = [3, 15, 16, 40, 7, 100, 16, 2]  # with min_span_length 8: 16, 40, 100, 16 hold a pair
    pq.write_table(pa.table({"input_ids": [list(range(n)) for n in lengths]}), tmp_path / "shards" / "p.parquet")
    corpus = PreparedCorpus(str(tmp_path), {"shards": [{"path": "shards/p.parquet"}]})
    assert _pair_fraction(corpus, CoCondenserConfig(min_span_length=8)) == pytest.approx(4 / 8)
    with pytest.raises(ValueError, match="lower --cocondenser.min_span_length"):
        _pair_fraction(corpus, CoCondenserConfig(min_span_length=60))


def test_a_step_larger_than_an_epoch_warns_once_naming_the_ratio(capsys):
    from pipeline.training.train_config import warn_if_a_step_exceeds_an_epoch

    warn_if_a_step_exceeds_an_epoch(TrainConfig(micro_batch_size=100, num_workers=2), 250, "sequences")
    assert capsys.readouterr().err == ""
    warn_if_a_step_exceeds_an_epoch(TrainConfig(micro_batch_size=1000), 150, "sequences")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "warning: one step reads 1000 sequences (micro_batch_size x grad_accum x num_workers), "
        "more than an epoch (~150): each step spans ~6.7 epochs"
    ]


def test_ctrl_c_stops_a_job_with_one_line_saying_how_to_resume(monkeypatch, capsys):
    from dataclasses import dataclass

    from pipeline.core.entry import run_job

    @dataclass
    class Job:
        steps: int = 1

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["job.py"])
    with pytest.raises(SystemExit) as exited:
        run_job(Job, interrupted, "a job")
    assert exited.value.code == 130
    assert capsys.readouterr().err == "interrupted: rerun the same command to resume\n"


def test_ray_trains_health_checks_slow_down_with_the_worker_group():
    """0.1 s a worker for a couple of workers (a short run ends sooner); then the group is
    polled about 20 times a second, not 10 times a second per worker (1,280 at 128)."""
    from pipeline.training.driver import health_check_interval

    assert [health_check_interval(n) for n in (1, 2, 8, 64, 128, 1024)] == [0.1, 0.1, 0.4, 3.2, 6.4, 10.0]


def test_preemption_asks_are_spaced_by_seconds_at_the_slowest_ranks_step_time():
    """10 s at 0.1 s a step is 100 steps; at 2.5 s, 4; a step longer than the interval asks
    after each; a step timed at nothing (a clock that did not move) too; and no more than
    10,000 steps apart whatever the steps' speed."""
    from pipeline.training.worker import steps_between_checks

    assert [steps_between_checks(10, s) for s in (0.1, 2.5, 30.0, 0.0, 1e-7)] == [100, 4, 1, 1, 10_000]


def test_the_log_line_says_the_step_of_how_many_and_the_time_left_at_this_attempts_pace(monkeypatch):
    """Resumed at step 40 of 100, 60 s in at step 70: 2 s a step this attempt, 60 s left.
    Mutation: the pace over every step since 0 (the resumed attempt never trained the first
    40) says 26 s."""
    from types import SimpleNamespace

    from pipeline.training import worker

    monkeypatch.setattr(worker.time, "perf_counter", lambda: 1060.0)
    run = SimpleNamespace(
        state=SimpleNamespace(step=70), start_step=40, started=1000.0, train=SimpleNamespace(max_steps=100)
    )
    assert worker.WorkerRun._progress(run) == {"step": 70, "of": 100, "eta_s": 60}
