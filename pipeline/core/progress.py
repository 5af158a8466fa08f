"""Progress of the driver's long stages, with rate and ETA, by ``tqdm``.

A line reads ``encode: 812,000/8,841,823 passages (9.2%), 14,300/s, ETA 9m21s``. On a
terminal it redraws in place; when stderr is a log file (``ray job submit``, CI, nohup)
each update is a line of its own, at most one every ``LOG_INTERVAL`` seconds plus the last,
with no carriage returns.
"""

from __future__ import annotations

import os
import sys

import ray
from tqdm import tqdm

from pipeline.core.capacity import wait_for_tasks

FORMAT = "{desc}: {count}/{of} {unit} ({pct}), {speed}, ETA {eta}"
LOG_INTERVAL = 15.0


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class _Progress(tqdm):
    @property
    def format_dict(self):
        d = super().format_dict
        n, total, rate = d["n"], d["total"], d["rate"]
        if rate is None and d["elapsed"]:
            rate = n / d["elapsed"]
        d["count"] = f"{n:,}"
        d["of"] = f"{total:,}" if total else "?"
        d["pct"] = f"{100 * n / total:.1f}%" if total else "?"
        d["speed"] = f"{rate:,.0f}/s" if rate else "?/s"
        d["eta"] = _duration((total - n) / rate if rate and total else (0 if total and n >= total else None))
        return d


class _Lines:
    """tqdm's output for a log file: each refresh its own line, no carriage returns."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress(total: int | None, desc: str, unit: str) -> tqdm:
    """A progress counter on stderr: ``update(n)`` as work completes, ``close()`` (or
    ``with``) at the end, which prints the final count. A total of 0 prints nothing."""
    stream = sys.stderr
    tty = stream.isatty()
    return _Progress(
        total=total,
        desc=desc,
        unit=unit,
        file=stream if tty else _Lines(stream),
        bar_format=FORMAT,
        mininterval=0.5 if tty else LOG_INTERVAL,
        maxinterval=LOG_INTERVAL * 4,
        dynamic_ncols=tty,
        disable=total == 0,  # nothing to do: no line
    )


def get_counted(refs: list, desc: str, unit: str, sizes: list[int] | None = None) -> list:
    """``ray.get(refs)`` (results in order), counting ``sizes[i]`` units (default 1) as each
    task finishes, in the order they finish; tasks never placed end the wait
    (:func:`pipeline.core.capacity.wait_for_tasks`)."""
    sizes = sizes if sizes is not None else [1] * len(refs)
    position = {ref: i for i, ref in enumerate(refs)}
    with progress(sum(sizes), desc, unit) as bar:
        wait_for_tasks(refs, f"{desc} tasks", lambda ref: bar.update(sizes[position[ref]]))
    return ray.get(refs)


def quiet_library_bars() -> None:
    """When stderr is a log file, turn off the Hugging Face libraries' own progress bars
    (``Loading weights``, downloads): they redraw with carriage returns. The variable also
    reaches the Ray workers started after this (``pipeline.core.runtime``)."""
    if sys.stderr.isatty():
        return
    import huggingface_hub.utils
    import transformers.utils.logging

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
