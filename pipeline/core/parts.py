"""Work written a block at a time, so a stage killed mid-way redoes at most one block.

A stage that streams blocks of work (query blocks searched, corpus shards encoded) writes
each block's results as part files under ``<folder>/parts/``, each appearing under its final
name only once complete (:func:`pipeline.core.storage.open_output`). Before the first
block, :func:`claim` compares ``made_by.json`` (everything the results depend on: the
settings, the model and the inputs' stored versions) with what the stage would make now:
the parts are kept when it matches and deleted when it does not, so a rerun resumes its own
work and never mixes in another's. Once every block is done, the parts are joined into the
stage's output files in block order (:func:`join_parts`) and removed.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys

import pyarrow.fs as pafs

from pipeline.core import storage

MADE_BY = "made_by.json"
PARTS = "parts"
_PART = re.compile(r"^(\d{6,})\.(.+)$")


def claim(folder: str, made_by: dict, work: tuple[str, ...] = (PARTS,), what: str = "parts") -> str | None:
    """Make ``folder`` the work ``made_by`` describes, before any of it is written: what is
    there was made by it and is kept for resuming, or else ``work`` (files or folders in
    ``folder``) is deleted and ``made_by`` recorded. What was discarded, and why, is said on
    stderr and returned (None when nothing was)."""
    made_by = json.loads(json.dumps(made_by))  # as it reads back: tuples become lists
    record = storage.join(folder, MADE_BY)
    former = storage.read_json(record) if storage.exists(record) else {}
    if former == made_by:
        return None
    folders = [storage.join(folder, name) for name in work]
    found = sum(len(storage.list_files(uri)) for uri in folders if storage.info(uri).type == pafs.FileType.Directory)
    for name in work:
        storage.delete_file(storage.join(folder, name))
        storage.delete_dir(storage.join(folder, name))
    storage.write_json(record, made_by)
    if not found:
        return None
    changed = sorted(k for k in made_by.keys() | former.keys() if former.get(k) != made_by.get(k))
    why = f"other {', '.join(changed)}" if former else "no record of what made them"
    message = f"{folder}: {found} {what} made otherwise ({why}) deleted; doing the work anew"
    print(message, file=sys.stderr, flush=True)
    return message


def part_uri(folder: str, block: int, name: str) -> str:
    """Where block ``block``'s file ``name`` (e.g. ``negatives.jsonl``) goes."""
    return storage.join(folder, PARTS, f"{block:06d}.{name}")


def recorded_block(folder: str, proposed: int) -> int:
    """The query block of the work in ``folder``: the size its parts were made with, when
    an earlier run left any, else ``proposed``, recorded now. A default block follows the
    servers a run starts, so a run resumed on another cluster keeps its own blocks."""
    record = storage.join(folder, PARTS, "block.json")
    if storage.exists(record):
        return int(storage.read_json(record)["queries"])
    storage.write_json(record, {"queries": int(proposed)})
    return int(proposed)


def finished_blocks(folder: str, names: tuple[str, ...]) -> set[int]:
    """The blocks whose every file in ``names`` is written (each appears only complete)."""
    found: dict[int, set[str]] = {}
    for uri in storage.list_files(storage.join(folder, PARTS)):
        match = _PART.match(posixpath.basename(uri))
        if match:
            found.setdefault(int(match.group(1)), set()).add(match.group(2))
    return {block for block, have in found.items() if set(names) <= have}


def summed(folder: str, blocks: list[int], name: str, keys: tuple[str, ...] = ()) -> dict[str, float]:
    """The blocks' JSON files ``name`` (counts of what each block did), added key by key;
    ``keys`` start at 0 (so none is missing when there are no blocks)."""
    total: dict[str, float] = dict.fromkeys(keys, 0)
    for block in blocks:
        for key, value in storage.read_json(part_uri(folder, block, name)).items():
            total[key] = total.get(key, 0) + value
    return total


def join_parts(folder: str, blocks: list[int], name: str, output: str) -> None:
    """Block ``blocks``' files ``name``, concatenated in that order into ``output`` (streamed,
    a chunk at a time, never whole on this process)."""
    with storage.open_output(output) as out:
        for block in blocks:
            with storage.open_input(part_uri(folder, block, name)) as part:
                while chunk := part.read(1 << 20):
                    out.write(chunk)


def remove_parts(folder: str) -> None:
    storage.delete_dir(storage.join(folder, PARTS))
