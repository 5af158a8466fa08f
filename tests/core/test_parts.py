"""A query block's results as one object, and its files joined in Ray tasks, on a local
folder and on S3 (moto on loopback)."""

from __future__ import annotations

import pytest

from pipeline.core import storage
from pipeline.core.parts import BLOCK, BlockFiles, block_metas, finished_blocks, join_blocks, part_uri, summed

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("where", ["local", "s3"])
def test_blocks_are_one_object_each_and_join_into_each_output_in_block_order(where, tmp_path, request, shared_ray):
    folder = str(tmp_path / "stage") if where == "local" else f"s3://{request.getfixturevalue('s3_bucket')}/stage"
    expected = {"a.jsonl": b"", "b.trec": b""}
    for block in (2, 0, 1):  # committed out of order, as tasks finish
        files = BlockFiles(tuple(expected))
        a = b"".join(f'{{"block": {block}, "line": {i}}}\n'.encode() for i in range(3))
        b = b"x" * (70_000 * block)  # past the header's first read, and empty for block 0
        files["a.jsonl"].write(a)
        files["b.trec"].write(b)
        files.commit(folder, block, {"lines": 3, "bytes": len(b)})
    for block in range(3):
        expected["a.jsonl"] += b"".join(f'{{"block": {block}, "line": {i}}}\n'.encode() for i in range(3))
        expected["b.trec"] += b"x" * (70_000 * block)
    assert finished_blocks(folder) == {0, 1, 2}
    assert [p.rsplit("/", 1)[1] for p in storage.list_files(storage.join(folder, "parts"))] == [
        f"{b:06d}.{BLOCK}" for b in range(3)
    ]
    outputs = {name: storage.join(folder, "out", name) for name in expected}
    metas = join_blocks(folder, [0, 1, 2], outputs)
    assert metas == block_metas(folder, [0, 1, 2]) == [{"lines": 3, "bytes": 70_000 * b} for b in range(3)]
    assert summed(metas, ("lines", "bytes", "none")) == {"lines": 9, "bytes": 210_000, "none": 0}
    for name, uri in outputs.items():
        assert storage.read_bytes(uri) == expected[name], name
    assert storage.exists(part_uri(folder, 0, BLOCK))


def test_each_output_is_joined_by_a_task_of_its_own_side_by_side(tmp_path, shared_ray, monkeypatch):
    """Mutation: the joins run as a plain loop on the driver (``[_join_file(...) for ...]``
    in ``join_blocks``): their process is the driver's, and each waits alone."""
    import os

    from pipeline.core import parts
    from tests.helpers import side_by_side, side_by_side_seen

    folder = str(tmp_path / "stage")
    files = BlockFiles(("a.jsonl", "b.trec"))
    files["a.jsonl"].write(b"a\n")
    files["b.trec"].write(b"b\n")
    files.commit(folder, 0, {"lines": 1})
    marks = str(tmp_path / "marks")
    monkeypatch.setattr(parts, "_join_file", side_by_side(parts._join_file, marks))
    outputs = {name: str(tmp_path / "out" / name) for name in ("a.jsonl", "b.trec")}
    assert join_blocks(folder, [0], outputs) == [{"lines": 1}]
    pids, met = side_by_side_seen(marks)
    assert os.getpid() not in pids and len(pids) == 2, pids
    assert met, "the joins ran one after another"
    assert storage.read_bytes(outputs["b.trec"]) == b"b\n"


def test_many_blocks_are_joined_by_ranges_side_by_side_then_concatenated(tmp_path, shared_ray, monkeypatch):
    """Past ``BLOCKS_PER_JOIN`` (2 here) blocks, each output is joined by a task per range of
    blocks (3 for 5 blocks), side by side off the driver, then its pieces concatenated: the
    same bytes and counts, in block order, and no piece left. Mutation: one task over every
    block (the range split dropped) makes one join call per output, and the ranges never meet."""
    import os

    from pipeline.core import parts
    from tests.helpers import side_by_side, side_by_side_seen

    folder = str(tmp_path / "stage")
    expected = b""
    for block in (4, 0, 3, 1, 2):
        files = BlockFiles(("run.trec",))
        files["run.trec"].write(f"block {block}\n".encode() * (block + 1))
        files.commit(folder, block, {"block": block})
    for block in range(5):
        expected += f"block {block}\n".encode() * (block + 1)
    marks = str(tmp_path / "marks")
    monkeypatch.setattr(parts, "BLOCKS_PER_JOIN", 2)
    monkeypatch.setattr(parts, "_join_file", side_by_side(parts._join_file, marks, peers=3))
    output = str(tmp_path / "out" / "run.trec")
    assert join_blocks(folder, list(range(5)), {"run.trec": output}) == [{"block": b} for b in range(5)]
    assert storage.read_bytes(output) == expected
    pids, met = side_by_side_seen(marks)
    assert len([m for m in os.listdir(marks) if m.endswith(".started")]) == 3 and met
    assert os.getpid() not in pids
    assert not storage.exists(storage.join(folder, parts.JOINED))
