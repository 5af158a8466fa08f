"""--train.profile_steps: which optimizer steps are profiled, and what is written."""

import gzip
import json
import re

import torch

from pipeline.training.profiling import PROFILE_AFTER, StepProfiler, profiled_window


def test_the_window_follows_the_warm_up_or_ends_a_short_run():
    assert profiled_window(0, 100) == (0, 0)
    assert profiled_window(3, 100) == (PROFILE_AFTER + 1, PROFILE_AFTER + 3) == (11, 13)
    assert profiled_window(2, 12) == (11, 12)  # exactly after the warm-up, at the run's end
    assert profiled_window(2, 6) == (5, 6)  # shorter than the warm-up: its last steps
    assert profiled_window(10, 4) == (1, 4)  # more than the run: all of it


def test_the_profiled_steps_and_only_they_are_written_as_a_table_and_a_trace(tmp_path):
    layer = torch.nn.Linear(16, 16)
    profiler = StepProfiler(2, 6, torch.device("cpu"), str(tmp_path), rank=0)
    profiler.before_training(0)
    calls = []
    for step in range(1, 7):
        with torch.autograd.profiler.record_function(f"step{step}"):
            layer(torch.ones(4, 16)).sum().backward()
        calls.append(profiler.session is not None)  # inside the window as the step ran
        profiler.after_step(step)
    assert calls == [False, False, False, False, True, True]
    table = (tmp_path / "profile" / "rank0.txt").read_text()
    # The window's steps and its wall time first (on a GPU also how busy the device was).
    assert re.match(r"optimizer steps 5-6: 2 steps in [0-9.]+ ms of wall \(profiled\)\n", table), table[:200]
    assert "aten::linear" in table and "Self CPU" in table
    trace = json.loads(gzip.decompress((tmp_path / "profile" / "rank0.trace.json.gz").read_bytes()))
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step")}
    assert steps == {"step5", "step6"}


def test_a_window_at_the_first_step_opens_before_training_and_none_on_other_ranks(tmp_path):
    profiler = StepProfiler(3, 2, torch.device("cpu"), str(tmp_path), rank=0)
    profiler.before_training(0)
    assert profiler.session is not None
    profiler.after_step(1)
    profiler.after_step(2)
    assert profiler.session is None and (tmp_path / "profile" / "rank0.txt").read_text().startswith(
        "optimizer steps 1-2"
    )
    off = StepProfiler(0, 100, torch.device("cpu"), str(tmp_path / "other"), rank=1)
    for step in range(1, 101):
        off.after_step(step)
    assert not (tmp_path / "other").exists()
