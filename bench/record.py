"""Where a benchmark's figures go, and what they carry.

A results file is ``bench/results/<benchmark>-<device>.json``: one per benchmark (or one
measurement of a benchmark, ``<benchmark>.<part>``) and device. :func:`write` stamps it
with the device it was measured on, the versions of the stack and the date, unless the
figures already say; ``python bench/figures.py`` renders every file into bench/README.md.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "ray", "deepspeed", "transformers", "faiss-cpu", "faiss-gpu", "numpy", "pyarrow")


def device() -> dict:
    """The GPU's name where torch sees one, else the CPU and its cores."""
    try:
        import torch

        if torch.cuda.is_available():
            return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cores": os.cpu_count()}
    except ImportError:
        pass
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def write(path: str | os.PathLike, figures: dict) -> Path:
    """``figures`` as JSON at ``path``, with ``device``, ``versions`` and ``measured`` added
    where absent."""
    stamped = {**figures}
    stamped.setdefault("device", device())
    stamped.setdefault("versions", versions())
    stamped.setdefault("measured", datetime.date.today().isoformat())
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamped, indent=2) + "\n")
    return out
