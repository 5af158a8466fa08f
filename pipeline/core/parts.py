"""Work written a block at a time, so a stage killed mid-way redoes at most one block.

A stage that streams blocks of work (query blocks searched, corpus shards encoded) writes
each block's results as part files under ``<folder>/parts/``, each appearing under its final
name only once complete (:func:`pipeline.core.storage.open_output`). A query block's results
are one object (:class:`BlockFiles`): a JSON header line (what the block counted, and the
length of each of its files) followed by the files' bytes, so a block is one PUT whatever
the number of outputs it feeds. Before the first
block, :func:`claim` compares ``made_by.json`` (everything the results depend on: the
settings, the model and the inputs' stored versions) with what the stage would make now:
the parts are kept when it matches and deleted when it does not, so a rerun resumes its own
work and never mixes in another's. Once every block is done, its files are joined into the
stage's output files in block order, one Ray task per output file reading only its own
section of each block (:func:`join_blocks`), never a loop on the driver, and removed.
"""

from __future__ import annotations

import json
import posixpath
import re
import shutil
import sys
import tempfile
from typing import IO

import pyarrow.fs as pafs
import ray

from pipeline.core import storage
from pipeline.core.capacity import wait_for_tasks

MADE_BY = "made_by.json"
PARTS = "parts"
JOINED = "joined"  # the pieces of a join of many blocks, deleted once joined
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


BLOCK = "block"  # a query block's one results object (BlockFiles)
JOIN_CHUNK = 16 * 2**20  # bytes a join reads at once (one ranged GET on S3)


class BlockFiles:
    """One query block's files (``names``), written as they are made into spooled temporary
    files (memory up to 64 MiB each, then disk), and :meth:`commit`-ted as one object with
    what the block counted (``meta``): a header line, then the files in ``names`` order."""

    def __init__(self, names: tuple[str, ...]):
        self.files = {name: tempfile.SpooledTemporaryFile(max_size=64 * 2**20) for name in names}

    def __getitem__(self, name: str) -> IO[bytes]:
        return self.files[name]

    def commit(self, folder: str, block: int, meta: dict) -> None:
        lengths = {name: f.tell() for name, f in self.files.items()}
        with storage.open_output(part_uri(folder, block, BLOCK)) as out:
            out.write(json.dumps({"meta": meta, "files": lengths}).encode() + b"\n")
            for f in self.files.values():
                f.seek(0)
                shutil.copyfileobj(f, out, JOIN_CHUNK)
                f.close()


def finished_blocks(folder: str, names: tuple[str, ...] = (BLOCK,)) -> set[int]:
    """The blocks whose every file in ``names`` is written (each appears only complete)."""
    found: dict[int, set[str]] = {}
    for uri in storage.list_files(storage.join(folder, PARTS)):
        match = _PART.match(posixpath.basename(uri))
        if match:
            found.setdefault(int(match.group(1)), set()).add(match.group(2))
    return {block for block, have in found.items() if set(names) <= have}


def _header(f) -> tuple[dict, int]:
    """(header, its length with the newline) of an open block object."""
    head = b""
    while b"\n" not in head:
        more = f.read_at(65536, len(head))
        if not more:
            raise ValueError("a block object without its header line")
        head += more
    line = head[: head.index(b"\n") + 1]
    return json.loads(line), len(line)


def _block_metas(folder: str, blocks: list[int]) -> list[dict]:
    metas = []
    for block in blocks:
        with storage.open_input(part_uri(folder, block, BLOCK), random_access=True) as f:
            metas.append(_header(f)[0]["meta"])
    return metas


def block_metas(folder: str, blocks: list[int]) -> list[dict]:
    """What each of ``blocks`` counted (their headers), read by a Ray task, in block order."""
    if not blocks:
        return []
    ref = ray.remote(_block_metas).options(num_cpus=0.5, max_retries=3).remote(folder, list(blocks))
    wait_for_tasks([ref], "block header tasks")
    return ray.get(ref)


def _join_file(folder: str, blocks: list[int], name: str, output: str) -> list[dict]:
    """The blocks' file ``name``, concatenated in block order into ``output``, reading only
    that file's bytes of each block object; returns the blocks' metas."""
    metas = []
    with storage.open_output(output) as out:
        for block in blocks:
            with storage.open_input(part_uri(folder, block, BLOCK), random_access=True) as f:
                header, at = _header(f)
                metas.append(header["meta"])
                for other, length in header["files"].items():
                    if other == name:
                        for offset in range(0, length, JOIN_CHUNK):
                            out.write(f.read_at(min(JOIN_CHUNK, length - offset), at + offset))
                        break
                    at += length
    return metas


# Blocks one join task reads: a stage of thousands of blocks (teacher scoring at MS MARCO:
# 7,859) is joined by tasks side by side, each a contiguous range into a piece, then each
# output from its pieces: one task reading every block object one after another spent most
# of its time waiting on each GET.
BLOCKS_PER_JOIN = 256


def join_blocks(folder: str, blocks: list[int], outputs: dict[str, str]) -> list[dict]:
    """Each file ``name`` of the blocks joined into ``outputs[name]``, in Ray tasks side by
    side: one per output, or, past ``BLOCKS_PER_JOIN`` blocks, one per range of blocks and
    output, whose pieces one task per output then concatenates. Returns what each block
    counted, in block order."""
    blocks = list(blocks)
    ranges = [blocks[i : i + BLOCKS_PER_JOIN] for i in range(0, len(blocks), BLOCKS_PER_JOIN)] or [[]]
    join = ray.remote(_join_file).options(num_cpus=0.5, max_retries=3)
    if len(ranges) == 1:
        refs = [join.remote(folder, blocks, name, uri) for name, uri in outputs.items()]
        wait_for_tasks(refs, "join tasks")
        joined = ray.get(refs)
        return joined[0] if joined else block_metas(folder, blocks)
    pieces = {name: [storage.join(folder, JOINED, f"{name}.{r:05d}") for r in range(len(ranges))] for name in outputs}
    by_output = {
        name: [join.remote(folder, part, name, piece) for part, piece in zip(ranges, pieces[name])] for name in outputs
    }
    wait_for_tasks([ref for each in by_output.values() for ref in each], "join tasks")
    metas = [meta for each in ray.get(next(iter(by_output.values()))) for meta in each] if by_output else []
    concat = ray.remote(_concatenated).options(num_cpus=0.5, max_retries=3)
    done = [concat.remote(pieces[name], uri) for name, uri in outputs.items()]
    wait_for_tasks(done, "join tasks")
    ray.get(done)
    storage.delete_dir(storage.join(folder, JOINED))
    return metas or block_metas(folder, blocks)


def _concatenated(pieces: list[str], output: str) -> None:
    with storage.open_output(output) as out:
        for piece in pieces:
            with storage.open_input(piece) as f:
                while chunk := f.read(JOIN_CHUNK):
                    out.write(chunk)


def summed(metas: list[dict], keys: tuple[str, ...] = ()) -> dict[str, float]:
    """The blocks' counts (``metas``), added key by key; ``keys`` start at 0 (so none is
    missing when there are no blocks)."""
    total: dict[str, float] = dict.fromkeys(keys, 0)
    for meta in metas:
        for key, value in meta.items():
            total[key] = total.get(key, 0) + value
    return total


def remove_parts(folder: str) -> None:
    storage.delete_dir(storage.join(folder, PARTS))
