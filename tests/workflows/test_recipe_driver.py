"""The recipe's driver as a cloud treats it, `python jobs/recipe.py` as a command: killed
(SIGKILL: a lost head) in mining and submitted again, it redoes no finished stage and ends
with the metrics of an uninterrupted run; then its dev evaluation's k changed, it trains
nothing and evaluates again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline.core import storage
from pipeline.core.config import dump_yaml
from pipeline.core.lease import LEASE
from pipeline.training.train_config import TrainConfig
from pipeline.workflows.recipe import RecipeConfig
from tests.helpers import retrieval_collection, save_tiny_bert, use_collection

pytestmark = [
    pytest.mark.ray,
    pytest.mark.runs_long,
    pytest.mark.release_check,
]  # four recipe runs as commands: 892 s in stop 94's long checks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp_path, output: str) -> str:
    data = retrieval_collection(tmp_path / "data", 120, 40, 20)
    cfg = RecipeConfig(output=output)
    cfg.model.init = save_tiny_bert(str(tmp_path / "init"), data["texts"])
    use_collection(cfg.data, data)
    cfg.data.query_max_len, cfg.data.passage_max_len = 16, 40
    cfg.pretrain.enabled = cfg.reranker.enabled = False
    for stage in (cfg.round1, cfg.round2):
        stage.retriever.group_size = 4
        stage.train = TrainConfig(micro_batch_size=8, max_steps=6, lr=1e-3, checkpoint_every=3, log_every=1)
    cfg.mine.depth, cfg.mine.count, cfg.mine.bm25_depth, cfg.mine.bm25_count = 20, 5, 20, 5
    cfg.eval.k = 50
    path = tmp_path / f"{os.path.basename(output)}.yaml"
    path.write_text(dump_yaml(cfg))
    return str(path)


def _recipe(config: str, *extra: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "jobs/recipe.py", "--config", config, *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finished(process: subprocess.Popen) -> tuple[dict, str, str]:
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), out, err


def test_a_killed_driver_resubmitted_redoes_no_finished_stage_and_ends_as_an_uninterrupted_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYDENSE_DEBUG")}
    env.update(RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1", RAYDENSE_LEASE_STALE_S="5")
    # The uninterrupted run goes on beside the one that is killed (each its own Ray): the
    # check's wall time is the two runs', not their sum.
    uninterrupted = _recipe(_config(tmp_path, str(tmp_path / "whole")), env=env)
    output = str(tmp_path / "killed")
    config = _config(tmp_path, output)
    driver = _recipe(config, env=env)
    deadline = time.time() + 900
    while time.time() < deadline:
        line = driver.stdout.readline()
        if "stage mine1: running" in line or driver.poll() is not None:
            break
    assert driver.poll() is None, driver.stderr.read()[-4000:]
    time.sleep(3)  # mining is under way
    driver.send_signal(signal.SIGKILL)  # a lost head: no handler, no clean-up, the lease left behind
    driver.wait(timeout=60)
    assert storage.exists(os.path.join(output, LEASE))
    time.sleep(6)  # past RAYDENSE_LEASE_STALE_S
    whole, _, _ = _finished(uninterrupted)

    resumed, out, err = _finished(_recipe(config, env=env))
    assert "took the run over from the driver that held it" in err and "past RAYDENSE_LEASE_STALE_S" in err
    assert resumed["ran"] == ["mine1", "round2"], resumed["ran"]  # mine2 feeds the re-ranker, off here
    for stage in ("bm25", "zeroshot", "round1"):
        assert f"stage {stage}: running" not in out
    for stage in ("round1", "round2"):  # the dev metrics (train_seconds and tokens/s are timings)
        measured = lambda run, stage=stage: {k: v for k, v in run["stages"][stage]["metrics"].items() if "@" in k}
        assert measured(resumed) == measured(whole) and measured(whole), stage

    # The dev evaluation's k: no training stage trains again, each retriever stage evaluates.
    again, out, _ = _finished(_recipe(config, "--eval.k", "30", env=env))
    assert "round1: its evaluation settings changed (eval.k: 50 -> 30)" in out
    recorded = storage.read_json(os.path.join(output, "recipe.json"))["stages"]
    for stage in ("round1", "round2"):
        train = recorded[stage]["summary"]["train"]
        assert train["steps_this_attempt"] == 0 and train["steps"] == 6, (stage, train)
        assert recorded[stage]["settings"]["eval.k"] == 30
    assert not storage.exists(os.path.join(output, LEASE))
