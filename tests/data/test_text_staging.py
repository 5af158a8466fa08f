"""A run's corpus staged once as text shards (``stage_text``), read by every consumer, and
reused only while the stored corpus is the one it was made from."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
from conftest import synthetic_docs, write_jsonl

from pipeline.core.errors import InputError
from pipeline.data.corpus_store import CorpusStore
from pipeline.data.join import JoinConfig
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.data.text_shards import group_shards, read_text_load, stage_text


def written_at(manifest: dict) -> list[int]:
    """Each shard file's modification time: unchanged means it was not written again."""
    return [os.stat(item["text_uri"]).st_mtime_ns for item in manifest["shards"]]


def test_a_staging_is_reused_until_the_corpus_at_that_path_changes(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", synthetic_docs(50, seed=1))
    first = stage_text(corpus, str(tmp_path / "text"), 20)
    assert [i["rows"] for i in first["shards"]] == [20, 20, 10] and first["docs"] == 50
    ids = [r["doc_id"] for item in first["shards"] for r in pq.read_table(item["text_uri"]).to_pylist()]
    assert ids == [d["_id"] for d in synthetic_docs(50, seed=1)]

    # Another reader with another cut reuses it (it regroups shards into its own loads).
    again = stage_text(corpus, str(tmp_path / "text"), 1000)
    assert again == first and written_at(again) == written_at(first)

    # The corpus cut short at the same path: staged anew, in the same place.
    write_jsonl(tmp_path / "corpus.jsonl", synthetic_docs(7, seed=2))
    cut = stage_text(corpus, str(tmp_path / "text"), 20)
    assert cut["docs"] == 7 and cut["version"] != first["version"]
    assert [r["doc_id"] for r in read_text_load(cut["shards"]).to_pylist()] == [
        d["_id"] for d in synthetic_docs(7, seed=2)
    ]
    assert len(list((tmp_path / "text").iterdir())) == 1


def test_inputs_and_readings_share_a_folder_without_evicting_each_other(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", synthetic_docs(12, seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", synthetic_docs(5, seed=2))
    folder = str(tmp_path / "text")
    plain_a = stage_text(a, folder, 4)
    joined_a = stage_text(a, folder, 4, join=JoinConfig(group_by=r"^(\D+)\d+$", max_words=60))
    plain_b = stage_text(b, folder, 4)
    assert (plain_a["docs"], plain_b["docs"]) == (12, 5)
    assert joined_a["docs"] < plain_a["docs"]  # records joined into passages
    assert stage_text(a, folder, 4) == plain_a and written_at(stage_text(a, folder, 4)) == written_at(plain_a)
    assert len(list((tmp_path / "text").iterdir())) == 3


def test_shards_are_grouped_into_consecutive_loads():
    shards = [{"rows": n, "first_row": f} for n, f in ((4, 0), (4, 4), (3, 8), (9, 11), (1, 20))]
    loads = group_shards(shards, 8)
    assert [[s["first_row"] for s in load] for load in loads] == [[0, 4], [8], [11], [20]]
    assert group_shards(shards, 100) == [shards]
    assert [len(load) for load in group_shards(shards, 1)] == [1, 1, 1, 1, 1]


@pytest.mark.ray
def test_a_corpus_rewritten_at_the_same_path_is_prepared_again(tmp_path, shared_ray, monkeypatch):
    """Reuse follows what is stored, not the path: the corpus cut from 70 to 10 documents
    at the same path is prepared anew; a relative and an absolute path are one input."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", synthetic_docs(70))
    cfg = PrepareConfig(input=corpus, output=str(tmp_path / "out"), vocab_size=150, docs_per_shard=30)
    full = prepare_corpus(cfg).manifest
    assert full["num_docs"] == 70
    write_jsonl(tmp_path / "corpus.jsonl", synthetic_docs(10))
    cut = prepare_corpus(cfg).manifest
    assert cut["num_docs"] == 10 and cut["input_version"] != full["input_version"]

    monkeypatch.chdir(tmp_path)
    relative = PrepareConfig(input="corpus.jsonl", output="out", vocab_size=150, docs_per_shard=30)
    assert prepare_corpus(relative).manifest["seconds"] == cut["seconds"]  # reused, not redone


@pytest.mark.ray
@pytest.mark.ray
def test_a_prepared_corpus_is_reused_only_with_the_settings_that_made_it(tmp_path, shared_ray, capsys):
    """The same input and output prepared with another vocabulary size, then another shard
    size: each time prepared anew, its manifest naming the new setting, its vocabulary or
    its shards rewritten; asked again with the last settings, reused. Mutation: dropping the
    settings comparison in ``prepare_corpus`` returns the first manifest every time
    (vocabulary 100, shards of 30). A reuse says so, on stderr and in the manifest returned."""
    import json

    corpus = write_jsonl(tmp_path / "corpus.jsonl", synthetic_docs(70, seed=3))
    out = tmp_path / "out"

    def prepared(**settings) -> tuple[dict, int]:
        manifest = prepare_corpus(PrepareConfig(input=corpus, output=str(out), **settings)).manifest
        vocab = json.loads((out / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
        return manifest, len(vocab)

    first, vocab = prepared(vocab_size=100, docs_per_shard=30)
    assert (first["settings"]["vocab_size"], vocab, [s["rows"] for s in first["shards"]]) == (100, 100, [30, 30, 10])
    written = os.stat(out / first["shards"][0]["path"]).st_mtime_ns

    wider, vocab = prepared(vocab_size=120, docs_per_shard=30)
    assert (wider["settings"]["vocab_size"], wider["vocab_size"], vocab) == (120, 120, 120)
    assert os.stat(out / wider["shards"][0]["path"]).st_mtime_ns != written

    recut, _ = prepared(vocab_size=120, docs_per_shard=20)
    assert recut["settings"]["docs_per_shard"] == 20 and [s["rows"] for s in recut["shards"]] == [20, 20, 20, 10]
    assert not any(m["reused"] for m in (first, wider, recut))
    capsys.readouterr()
    again, _ = prepared(vocab_size=120, docs_per_shard=20)
    assert again["reused"] and again["seconds"] == recut["seconds"]
    assert f"prepare: reusing {out}, prepared from the same input with the same settings" in capsys.readouterr().err


def test_a_run_stages_its_corpus_once_for_every_tokenizer(tmp_path, shared_ray):
    from tests.helpers import save_tiny_bert

    texts = [d["text"] for d in synthetic_docs(30)]
    first, second = (save_tiny_bert(str(tmp_path / name), texts) for name in ("first", "second"))
    store = CorpusStore(write_jsonl(tmp_path / "corpus.jsonl", synthetic_docs(30)), str(tmp_path / "run"), 10)
    staged = store.text()
    before = written_at(staged)
    for tokenizer in (first, second):
        manifest = store.prepared(tokenizer).manifest
        assert manifest["num_docs"] == 30 and [s["rows"] for s in manifest["shards"]] == [10, 10, 10]
    assert store.folder(first) != store.folder(second)
    assert written_at(store.text()) == before and store.docs() == 30


def staged_rows(manifest: dict) -> list[tuple[str, str]]:
    return [(r["doc_id"], r["text"]) for r in read_text_load(manifest["shards"]).to_pylist()]


@pytest.mark.ray
def test_staging_tasks_read_pieces_of_one_file_side_by_side_as_one_reader_would(tmp_path, shared_ray, monkeypatch):
    """A TSV file cut at byte offsets that fall mid-line, in empty lines and on a newline,
    each piece read by its own task: the same documents in the same order as one reader,
    first rows in sequence, stats summed; a bad record in a late piece named by the file's
    own line; an id repeated across pieces refused. Mutations: a piece that keeps the line
    it starts inside duplicates documents; one that drops the line starting at its first
    byte loses one; line numbers counted from the piece give the wrong line."""
    from pipeline.data import text_shards

    docs = synthetic_docs(300, seed=4)
    lines = [f"{d['_id']}\t{d['text']}" for d in docs]
    lines[40] = "e40\t "  # an empty text, skipped and counted
    lines.insert(100, "")  # a blank line, ignored
    path = tmp_path / "collection.tsv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    expected = [(line.split("\t")[0], line.split("\t")[1]) for line in lines if line and line != "e40\t "]

    for piece in (97, 1000, len(lines[0]) + 1):  # mid-line cuts, and one on a newline
        monkeypatch.setattr(text_shards, "PIECE_BYTES", piece)
        staged = stage_text(str(path), str(tmp_path / f"text-{piece}"), 37)
        assert staged_rows(staged) == expected
        firsts = [item["first_row"] for item in staged["shards"]]
        assert firsts == [sum(i["rows"] for i in staged["shards"][:k]) for k in range(len(firsts))]
        assert staged["docs"] == len(expected) and staged["corpus_stats"]["skipped_empty"] == 1
        assert staged["corpus_stats"]["skipped_examples"] == [f"{path} line 41: empty text (id e40)"]

    monkeypatch.setattr(text_shards, "PIECE_BYTES", 200)
    bad = list(lines)
    bad[250] = "no tab here"
    path.write_text("\n".join(bad) + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=rf"{path} line 251: expected 2 tab-separated columns"):
        stage_text(str(path), str(tmp_path / "bad"), 37)

    repeated = list(lines)
    repeated[280] = "d3\tagain"
    path.write_text("\n".join(repeated) + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=rf"duplicate id 'd3' at {path} line 281 \(first at {path} line 4\)"):
        stage_text(str(path), str(tmp_path / "repeated"), 37)


def test_without_ray_staging_reads_the_pieces_in_this_process(tmp_path, monkeypatch):
    from pipeline.data import text_shards

    monkeypatch.setattr(text_shards, "PIECE_BYTES", 150)
    docs = synthetic_docs(60, seed=5)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    staged = stage_text(corpus, str(tmp_path / "text"), 25)
    assert staged_rows(staged) == [(d["_id"], d["text"]) for d in docs]
    assert len(staged["shards"]) > 3  # a piece ends a shard


def test_staging_writes_its_pieces_in_tasks_side_by_side(tmp_path, shared_ray, monkeypatch):
    """Mutation: every piece staged one after another on the driver (``tasks.map`` of
    ``_staged_piece`` as ``[_staged_piece(*c) for c in calls]``): the pieces' process
    is the driver's, and each waits alone."""
    import os

    from pipeline.data import text_shards
    from tests.helpers import side_by_side, side_by_side_seen

    monkeypatch.setattr(text_shards, "PIECE_BYTES", 300)
    docs = synthetic_docs(40, seed=6)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    marks = str(tmp_path / "marks")
    monkeypatch.setattr(text_shards, "_staged_piece", side_by_side(text_shards._staged_piece, marks))
    staged = stage_text(corpus, str(tmp_path / "text"), 25)
    assert staged_rows(staged) == [(d["_id"], d["text"]) for d in docs]
    pids, met = side_by_side_seen(marks)
    assert os.getpid() not in pids and len(pids) >= 2, pids
    assert met, "the pieces were staged one after another"


def test_a_staging_cut_short_resumes_from_the_pieces_it_stored(tmp_path, monkeypatch):
    """The third of six pieces fails: the rerun stages the pieces from the third on, and
    reads the first two back (their shards not written again), giving what one staging
    gives; an id repeated between a stored piece and a new one is still refused, and a
    staging of another cut starts afresh. Mutation: the piece records not looked for
    stages all six again and fails on the count."""
    from pipeline.core import tasks
    from pipeline.data import text_shards

    monkeypatch.setattr(tasks.ray, "is_initialized", lambda: False)  # staged in this process, as counted
    monkeypatch.setattr(text_shards, "PIECE_BYTES", 400)
    docs = synthetic_docs(60, seed=8)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    staged_prefixes: list[str] = []
    real = text_shards.write_text_shards

    def third_fails(pieces, folder, prefix, *args):
        if prefix == "text-00002" and "failed" not in staged_prefixes:
            staged_prefixes.append("failed")
            raise OSError("node lost")
        staged_prefixes.append(prefix)
        return real(pieces, folder, prefix, *args)

    monkeypatch.setattr(text_shards, "write_text_shards", third_fails)
    pieces = len(text_shards.corpus_pieces(corpus, 400))
    assert pieces >= 6
    with pytest.raises(OSError, match="node lost"):
        stage_text(corpus, str(tmp_path / "text"), 7)
    first_two = sorted((tmp_path / "text").rglob("text-0000[01]-*.parquet"))
    before = [p.stat().st_mtime_ns for p in first_two]
    staged = stage_text(corpus, str(tmp_path / "text"), 7)
    assert staged_prefixes == ["text-00000", "text-00001", "failed"] + [f"text-{i:05d}" for i in range(2, pieces)]
    assert [p.stat().st_mtime_ns for p in first_two] == before and first_two
    assert staged_rows(staged) == [(d["_id"], d["text"]) for d in docs]
    assert not list((tmp_path / "text").rglob("pieces"))  # the records go once the manifest is written

    # An id of the first piece repeated in the last: found on the rerun, from the stored
    # piece's id hashes.
    write_jsonl(tmp_path / "corpus.jsonl", docs[:59] + [{"_id": docs[1]["_id"], "text": "again"}])
    staged_prefixes.clear()
    with pytest.raises(OSError):
        stage_text(corpus, str(tmp_path / "again"), 7)
    with pytest.raises(InputError, match=f"duplicate id '{docs[1]['_id']}'"):
        stage_text(corpus, str(tmp_path / "again"), 7)
    assert staged_prefixes.count("text-00000") == 1


def test_a_folder_of_gzip_files_stages_one_task_a_file_and_a_large_one_is_warned_of(tmp_path, monkeypatch, capsys):
    """Three .gz files: three staging calls, one file each, and the documents in order. A
    file past ``ONE_TASK_WARN_BYTES`` is named on stderr with its one task's time and how
    to split it. Mutation: the warning's size check inverted warns of none."""
    import gzip
    import json

    from pipeline.core import tasks
    from pipeline.data import text_shards

    monkeypatch.setattr(tasks.ray, "is_initialized", lambda: False)  # staged in this process, as counted
    docs = synthetic_docs(90, seed=9)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for part in range(3):
        with gzip.open(folder / f"part-{part}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs[30 * part : 30 * part + 30])
    calls: list[list] = []
    real = text_shards._staged_piece
    monkeypatch.setattr(text_shards, "_staged_piece", lambda pieces, *a: calls.append(pieces) or real(pieces, *a))
    monkeypatch.setattr(text_shards, "ONE_TASK_WARN_BYTES", (folder / "part-1.jsonl.gz").stat().st_size - 1)
    staged = stage_text(str(folder), str(tmp_path / "text"), 1000)
    assert staged_rows(staged) == [(d["_id"], d["text"]) for d in docs]
    assert [[p.source.rsplit("/", 1)[1] for p in c] for c in calls] == [[f"part-{i}.jsonl.gz"] for i in range(3)]
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert warned and all("one compressed file" in w and " h at 8 MB/s" in w and "split" in w for w in warned)
