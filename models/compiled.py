"""``torch.compile`` applied in place, for the encoders that inference runs and the modules
that training runs."""

from __future__ import annotations

import torch


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks a transformer repeats, in ``module``'s tree: the classes its HF models list
    as ``_no_split_modules`` (BERT's layer and embeddings; a Condenser head's layers too)."""
    names = set()
    for sub in module.modules():
        names |= set(getattr(sub, "_no_split_modules", None) or ())
    return [sub for sub in module.modules() if type(sub).__name__ in names]


def compile_in_place(*modules: torch.nn.Module | None, blocks: bool = False) -> None:
    """``torch.compile`` each module in place (its state dict keeps its keys, so checkpoints
    and exports are those of the eager module). A module compiled already (a tower two
    encoders share) is left as it is.

    Whole modules compile with dynamic shapes: encoding's batches come in many widths
    (length-sorted, cut to their longest), and each new width must reuse the one compiled
    graph, not compile again. ``blocks``: compile each repeated block (:func:`repeated_blocks`)
    instead, as training does: its graphs are a layer's, not the whole forward's with its
    losses, and with torch's default shapes, static until one changes (training's rows are
    of one width, so its kernels are specialised to it; packed span pairs, whose row count
    varies, turn dynamic at their first change). On a CPU a Condenser (6 x 384) compiled in
    47 s this way against 114 s whole, and stepped in 1.36 s against 1.48 s (eager: 1.22 s);
    whole, torch 2.11's Inductor failed on an H200. Encoders compile whole:
    their forward is the tower and its pooling, and compiled whole MiniLM encoded 155-158
    passages/s against 133-147 by blocks (one thread, 4,000 Nave verses, two runs each)."""
    for module in {id(m): m for m in modules if m is not None}.values():
        for target in (repeated_blocks(module) if blocks else []) or [module]:
            if getattr(target, "_compiled_call_impl", None) is None:
                target.compile(dynamic=None if blocks else True)
