"""Corpora as data lakes keep them: Parquet files read a row group at a time, in tasks,
with their columns found by name or mapped; errors name the file and row."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import synthetic_docs, write_jsonl

from pipeline.core.errors import InputError
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.data.text_shards import read_text_load, stage_text


def write_parquet(path, docs: list[dict], row_group: int, id_column: str = "docid", text_column: str = "text") -> str:
    table = pa.table(
        {
            id_column: [d["_id"] for d in docs],
            "title": [d.get("title") for d in docs],
            text_column: [d["text"] for d in docs],
            "lang": ["en"] * len(docs),  # another column, not read
        }
    )
    pq.write_table(table, path, row_group_size=row_group)
    return str(path)


def rows(manifest: dict) -> list[tuple[str, str]]:
    return [(r["doc_id"], r["text"]) for r in read_text_load(manifest["shards"]).to_pylist()]


def docs_with_titles(n: int) -> list[dict]:
    docs = synthetic_docs(n, seed=11)
    for i in range(0, n, 3):
        docs[i]["title"] = f"Title {i}"
    return docs


@pytest.mark.ray
def test_a_parquet_corpus_prepares_as_the_same_corpus_in_beir_jsonl(tmp_path, shared_ray, monkeypatch):
    """Tevatron's column names (docid, title, text) in row groups of 16: staged, each row
    group in its own task (none on the driver, counted by the tasks' marks), and prepared
    into the same shards as the BEIR jsonl of the same documents. Mutation: the row groups
    staged as one piece leaves one mark; staged on the driver, the driver's."""
    from pipeline.data import text_shards
    from tests.helpers import side_by_side, side_by_side_seen

    docs = docs_with_titles(70)
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", docs)
    parquet = write_parquet(tmp_path / "corpus.parquet", docs, row_group=16)
    marks = str(tmp_path / "marks")
    monkeypatch.setattr(text_shards, "_staged_piece", side_by_side(text_shards._staged_piece, marks))
    staged = stage_text(parquet, str(tmp_path / "text"), 25)
    pids, met = side_by_side_seen(marks)
    assert len([m for m in os.listdir(marks) if m.endswith(".started")]) == 5  # ceil(70 / 16) row groups
    assert os.getpid() not in pids and met
    assert rows(staged) == rows(stage_text(jsonl, str(tmp_path / "text-jsonl"), 25))

    prepared = {
        name: prepare_corpus(PrepareConfig(input=src, output=str(tmp_path / name), vocab_size=150, docs_per_shard=30))
        for name, src in (("from-jsonl", jsonl), ("from-parquet", parquet))
    }
    tables = {  # every row in corpus order (a row group ends a shard, so the cuts differ)
        name: [r for s in p.manifest["shards"] for r in pq.read_table(tmp_path / name / s["path"]).to_pylist()]
        for name, p in prepared.items()
    }
    assert tables["from-parquet"] == tables["from-jsonl"]


def test_columns_are_mapped_and_bad_rows_are_named_by_file_and_row(tmp_path):
    """A mapping names columns no default would find; a column the file lacks, an unknown
    key and a row with a null text are errors naming the file (and the row)."""
    docs = docs_with_titles(20)
    path = write_parquet(tmp_path / "lake.parquet", docs, row_group=8, id_column="key", text_column="body")
    with pytest.raises(InputError, match=r"lake\.parquet: no id column \(it has key, title, body, lang; name it with"):
        stage_text(path, str(tmp_path / "text"), 10)
    staged = stage_text(path, str(tmp_path / "text"), 10, columns="id=key, text=body")
    assert rows(staged) == [(d["_id"], f"{d['title']}\n{d['text']}" if d.get("title") else d["text"]) for d in docs]
    untitled = stage_text(path, str(tmp_path / "text"), 10, columns="id=key,text=body,title=")
    assert rows(untitled) == [(d["_id"], d["text"]) for d in docs]
    with pytest.raises(InputError, match=r"no column 'heading' for the title \(it has key, title, body, lang\)"):
        stage_text(path, str(tmp_path / "text"), 10, columns="id=key,text=body,title=heading")
    with pytest.raises(InputError, match=r"'body=text' is not id=, title= or text=COLUMN"):
        stage_text(path, str(tmp_path / "text"), 10, columns="body=text")

    docs[13]["text"] = None
    bad = write_parquet(tmp_path / "bad.parquet", docs, row_group=8)
    with pytest.raises(
        InputError, match=rf"{bad} row 14: the text must be a string, got null \(id {docs[13]['_id']}\)"
    ):
        stage_text(bad, str(tmp_path / "bad-text"), 10)


def tevatron_records(n: int) -> list[dict]:
    docs = docs_with_titles(3 * n)
    passage = lambda d: {"docid": d["_id"], "title": d.get("title", ""), "text": d["text"]}  # noqa: E731
    return [
        {
            "query_id": f"q{i}",
            "query": f"query {i}",
            "positive_passages": [passage(docs[3 * i])],
            "negative_passages": [passage(docs[3 * i + 1]), passage(docs[(3 * i + 5) % (3 * n)])],
        }
        for i in range(n)
    ]


def test_a_tevatron_training_file_in_parquet_reads_as_its_jsonl(tmp_path):
    """Tevatron's layout as the hub stores it (passages as lists of structs), in row groups:
    the same validated records, the same extracted corpus and the same training examples
    as the jsonl; a bad row is named by file and row."""
    from pipeline.data.records import write_json_line
    from pipeline.data.tevatron import extract_tevatron_corpus, read_tevatron, tevatron_example

    records = tevatron_records(12)
    with open(tmp_path / "train.jsonl", "wb") as f:
        for r in records:
            write_json_line(f, r)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "train.parquet", row_group_size=5)
    from_jsonl = list(read_tevatron(str(tmp_path / "train.jsonl")))
    from_parquet = list(read_tevatron(str(tmp_path / "train.parquet")))
    assert from_parquet == from_jsonl and len(from_parquet) == 12
    assert [tevatron_example(r) for r in from_parquet] == [tevatron_example(r) for r in from_jsonl]
    counts = [
        extract_tevatron_corpus(str(tmp_path / f"train.{kind}"), str(tmp_path / f"{kind}.corpus.jsonl"))
        for kind in ("jsonl", "parquet")
    ]
    assert (
        counts[0] == counts[1]
        and (tmp_path / "jsonl.corpus.jsonl").read_bytes() == (tmp_path / "parquet.corpus.jsonl").read_bytes()
    )

    records[7]["query"] = ""
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "bad.parquet", row_group_size=5)
    with pytest.raises(InputError, match=r"bad\.parquet row 8: empty query \(query q7\)"):
        list(read_tevatron(str(tmp_path / "bad.parquet")))


def test_queries_in_parquet_read_as_their_jsonl(tmp_path):
    from pipeline.data.beir import read_queries

    queries = [{"_id": f"q{i}", "text": f"query {i}"} for i in range(9)]
    write_jsonl(tmp_path / "queries.jsonl", queries)
    pq.write_table(pa.Table.from_pylist(queries), tmp_path / "queries.parquet", row_group_size=4)
    assert dict(read_queries(str(tmp_path / "queries.parquet")).items()) == dict(
        read_queries(str(tmp_path / "queries.jsonl")).items()
    )
