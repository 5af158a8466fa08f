"""Where a training step's time goes: ``torch.profiler`` over a few optimizer steps of a real
run (``--train.profile_steps``), on rank 0, written next to the run's history.

The job runs below its bare model step (bench/README.md): its own steps, profiled where they
run (Ray Train, DeepSpeed, the stream), show what the difference is spent on, which a bare
benchmark cannot.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pipeline.core import storage

PROFILE_AFTER = 10  # steps of warm-up (compilation, allocator growth, the stream's start) first
TABLE_ROWS = 60


def device_profile(on_gpu: bool) -> profile:
    """A ``torch.profiler`` session for the CPU, and the GPU's kernels where there is one."""
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else []))


def time_table(session: profile, on_gpu: bool) -> str:
    """A finished session's operators and kernels by their own time (the device's on a GPU,
    the CPU's otherwise), largest first."""
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return session.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS, max_name_column_width=80)


def busy_line(session: profile, wall_s: float, steps: int, on_gpu: bool) -> str:
    """How much of a window's wall time the device computed at all (its kernels' and copies'
    own time, summed as the table's "Self CUDA time total" sums them), and the kernels
    launched a step: a device idle for much of the window waits on the host, which no
    faster kernel fixes."""
    events = session.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    line = f"{steps} steps in {wall_s * 1e3:.1f} ms of wall (profiled)"
    if not on_gpu:
        return line
    busy_s = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
    return f"{line}; device busy {busy_s * 1e3:.1f} ms ({busy_s / wall_s:.0%}); {launches / steps:.0f} kernel launches a step"


def profiled_window(steps: int, max_steps: int) -> tuple[int, int]:
    """(first, last) optimizer step profiled: ``steps`` of them after PROFILE_AFTER, or the
    run's last ``steps`` when it is shorter; (0, 0) for none."""
    if steps <= 0:
        return 0, 0
    first = max(1, min(PROFILE_AFTER + 1, max_steps - steps + 1))
    return first, min(max_steps, first + steps - 1)


class StepProfiler:
    """Profiles the optimizer steps ``first..last`` (1-based, as ``TrainState.step`` counts
    them): started once step ``first - 1`` is done, stopped once ``last`` is, then writes
    ``<output>/profile/rank<r>.txt`` (operators and kernels by their own device time, or CPU
    time on a CPU) and ``rank<r>.trace.json.gz`` (a Chrome/Perfetto trace)."""

    def __init__(self, steps: int, max_steps: int, device: torch.device, output: str, rank: int):
        self.first, self.last = profiled_window(steps, max_steps)
        self.on_gpu = device.type == "cuda"
        self.output, self.rank = output, rank
        self.session: profile | None = None
        self.opened = 0.0

    @property
    def enabled(self) -> bool:
        return self.last > 0

    def before_training(self, step: int) -> None:
        """Starts at once when the window opens at the run's first step (or a resumed step)."""
        self._open_if_due(step)

    def after_step(self, step: int) -> None:
        """Called once optimizer step ``step`` is done."""
        if self.session is not None and step >= self.last:
            self._close(step)
        self._open_if_due(step)

    def _open_if_due(self, done: int) -> None:
        if self.enabled and self.session is None and done == self.first - 1:
            self.session = device_profile(self.on_gpu)
            self.session.__enter__()
            self.opened = time.perf_counter()

    def _close(self, step: int) -> None:
        session, self.session = self.session, None
        if self.on_gpu:
            torch.cuda.synchronize()  # the window's kernels end inside it
        session.__exit__(None, None, None)
        wall_s = time.perf_counter() - self.opened
        self.last = 0  # once per attempt
        table = time_table(session, self.on_gpu)
        busy = busy_line(session, wall_s, step - self.first + 1, self.on_gpu)
        steps = f"optimizer steps {self.first}-{step}: {busy}"
        folder = storage.join(self.output, "profile")
        storage.write_bytes(storage.join(folder, f"rank{self.rank}.txt"), f"{steps}\n{table}\n".encode())
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            session.export_chrome_trace(trace)
            with (
                open(trace, "rb") as src,
                storage.open_output(storage.join(folder, f"rank{self.rank}.trace.json.gz")) as out,
            ):
                while chunk := src.read(1 << 20):
                    out.write(chunk)
