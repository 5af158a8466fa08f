"""``torch.compile`` applied in place, for the encoders that inference runs and the modules
that training runs."""

from __future__ import annotations

import torch


def compile_in_place(*modules: torch.nn.Module | None) -> None:
    """``torch.compile`` each module in place (its state dict keeps its keys, so checkpoints
    and exports are those of the eager module), with dynamic shapes: batches come in many
    widths (length-sorted, cut to their longest), and each new width must reuse the one
    compiled graph, not compile again. A module compiled already (a tower two encoders
    share) is left as it is."""
    for module in {id(m): m for m in modules if m is not None}.values():
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(dynamic=True)
