"""MS MARCO's own files read as they come: ``collection.tsv`` (id, text), ``queries.*.tsv``
(id, text) and TREC's four-column ``qrels.*.tsv``, giving what the same data gives in BEIR's
layout; and an evaluation's queries cut to the ones its qrels judge."""

from __future__ import annotations

import gzip
import json

import pytest

from pipeline.core.errors import InputError
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus import iter_documents

DOCS = [("0", "The presence of communication amid scientific minds"), ("1", "Manhattan Project"), ("7", "x\u00e9 y")]
QUERIES = [("1185869", ")what was the immediate impact of the success"), ("1185868", "_________ justice is designed")]
QRELS = [("1185869", "0", 1), ("1185868", "7", 1), ("1185868", "1", 0)]


def _beir(root):
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in DOCS))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in QUERIES))
    (root / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in QRELS))
    return root / "corpus.jsonl", root / "queries.jsonl", root / "qrels.tsv"


def _msmarco(root):
    with gzip.open(root / "collection.tsv.gz", "wt") as f:  # as MS MARCO ships it, or unpacked
        f.write("".join(f"{i}\t{t}\n" for i, t in DOCS))
    (root / "queries.train.tsv").write_text("".join(f"{i}\t{t}\n" for i, t in QUERIES))
    (root / "qrels.train.tsv").write_text("".join(f"{q}\t0\t{d}\t{s}\n" for q, d, s in QRELS))
    return root / "collection.tsv.gz", root / "queries.train.tsv", root / "qrels.train.tsv"


def test_msmarco_files_read_as_the_same_data_in_beir_layout(tmp_path):
    (tmp_path / "beir").mkdir(), (tmp_path / "msmarco").mkdir()
    beir, msmarco = _beir(tmp_path / "beir"), _msmarco(tmp_path / "msmarco")
    assert [(d.doc_id, d.text) for d in iter_documents(str(msmarco[0]))] == DOCS
    assert [(d.doc_id, d.text) for d in iter_documents(str(msmarco[0]))] == [
        (d.doc_id, d.text) for d in iter_documents(str(beir[0]))
    ]
    assert dict(read_queries(str(msmarco[1])).items()) == dict(read_queries(str(beir[1])).items()) == dict(QUERIES)
    assert dict(read_qrels(str(msmarco[2])).items()) == dict(read_qrels(str(beir[2])).items())
    assert read_qrels(str(msmarco[2]))["1185868"] == {"7": 1, "1": 0}


def test_a_malformed_msmarco_line_is_named(tmp_path):
    (tmp_path / "collection.tsv").write_text("0\tfine\n1 no tab here\n")
    with pytest.raises(
        InputError, match=r"collection.tsv line 2: expected 2 tab-separated columns \(id, text\), got 1"
    ):
        list(iter_documents(str(tmp_path / "collection.tsv")))
    (tmp_path / "queries.dev.tsv").write_text("5\tok\n6\ta\tb\n")
    with pytest.raises(InputError, match=r"queries.dev.tsv line 2: expected 2 tab-separated columns"):
        read_queries(str(tmp_path / "queries.dev.tsv"))


def test_an_evaluation_keeps_only_the_queries_its_qrels_judge(tmp_path):
    """BEIR's combined queries.jsonl holds every split: the dev qrels judge a few of them,
    and only those are evaluated (in file order)."""
    _beir(tmp_path)
    queries = read_queries(str(tmp_path / "queries.jsonl"))
    (tmp_path / "dev.tsv").write_text("1185868\t7\t1\n")
    judged = queries.judged_only(read_qrels(str(tmp_path / "dev.tsv"), query_ids=queries))
    assert dict(judged.items()) == {"1185868": QUERIES[1][1]} and judged.ids() == ["1185868"]
    assert queries.judged_only(read_qrels(str(tmp_path / "qrels.tsv"))) is queries
