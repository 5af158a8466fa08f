import gzip
import json
import pickle
import zlib
from pathlib import Path

import pytest

from pipeline.core.errors import InputError
from pipeline.core.sample import SAMPLE_CORPUS
from pipeline.data.corpus import CorpusStats, Document, corpus_files, iter_documents
from pipeline.data.join import JoinConfig, join_consecutive

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def jsonl(*objs) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def triples(docs):
    return [(d.doc_id, d.text, d.line) for d in docs]


# ---------------------------------------------------------------- good input


def test_jsonl_documents_title_join_and_line_numbers(tmp_path):
    path = write(
        tmp_path / "corpus.jsonl",
        '{"_id": "a", "title": "Title A", "text": "Body A"}\n'
        "\n"
        '{"_id": "b", "text": "Body B", "extra": [1, 2]}\r\n'
        '{"_id": 7, "title": "", "text": "Body seven"}\n'
        "   \n"
        '{"_id": "c", "title": null, "text": "Body C"}\n'
        '{"_id": "d", "title": "  ", "text": "Body D"}',
    )  # no final newline
    stats = CorpusStats()
    docs = list(iter_documents(str(path), stats=stats))
    assert triples(docs) == [
        ("a", "Title A\nBody A", 1),
        ("b", "Body B", 3),
        ("7", "Body seven", 4),
        ("c", "Body C", 6),
        ("d", "Body D", 7),
    ]
    assert all(d.source == str(path) for d in docs)
    assert stats.as_dict() == {"documents": 5, "skipped_empty": 0, "skipped_examples": []}


def test_title_only_document_is_not_empty(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"_id": "t", "title": "Only a title", "text": ""}))
    assert triples(iter_documents(str(path))) == [("t", "Only a title\n", 1)]


def test_utf8_text_and_bom(tmp_path):
    path = write(tmp_path / "c.jsonl", "\ufeff" + '{"_id": "x", "text": "God\u2019s \u201cday\u201d"}\n')
    assert triples(iter_documents(str(path))) == [("x", "God\u2019s \u201cday\u201d", 1)]


def test_txt_split_on_blank_lines(tmp_path):
    path = write(
        tmp_path / "notes.txt",
        "\n"
        "\n"
        "first doc line one\n"
        "first doc line two\r\n"
        "\n"
        "  \t\n"
        "\n"
        "second doc\n"
        "\r\n"
        "  third doc, indented\n"
        "third again\n"
        "\n"
        "\n",
    )
    docs = list(iter_documents(str(path)))
    assert triples(docs) == [
        ("notes:0", "first doc line one\nfirst doc line two", 3),
        ("notes:1", "second doc", 8),
        ("notes:2", "  third doc, indented\nthird again", 10),
    ]


def test_txt_without_trailing_newline(tmp_path):
    path = write(tmp_path / "n.txt", "one\n\ntwo")
    assert triples(iter_documents(str(path))) == [("n:0", "one", 1), ("n:1", "two", 3)]


def test_gzip_jsonl_and_txt(tmp_path):
    gz_json = write(
        tmp_path / "c.jsonl.gz",
        gzip.compress(b'{"_id": "g1", "text": "zipped one"}\n\n{"_id": "g2", "title": "T", "text": "zipped two"}\n'),
    )
    assert triples(iter_documents(str(gz_json))) == [("g1", "zipped one", 1), ("g2", "T\nzipped two", 3)]
    gz_txt = write(tmp_path / "book.txt.gz", gzip.compress(b"alpha\nbeta\n\n\ngamma\n"))
    assert triples(iter_documents(str(gz_txt))) == [("book:0", "alpha\nbeta", 1), ("book:1", "gamma", 5)]


def test_directory_mixed_files_sorted(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b.jsonl", jsonl({"_id": "b1", "text": "B one"}))
    write(root / "a.txt", "A zero\n\nA one\n")
    write(root / "sub" / "c.jsonl.gz", gzip.compress(jsonl({"_id": "c1", "text": "C one"}).encode()))
    write(root / "a2.txt.gz", gzip.compress(b"A2 zero\n"))
    write(root / "README.md", "not a corpus file\n")
    write(root / "ids.csv", "x\ty\n")
    docs = list(iter_documents(str(root)))
    assert [(d.doc_id, d.text, Path(d.source).name, d.line) for d in docs] == [
        ("a:0", "A zero", "a.txt", 1),
        ("a:1", "A one", "a.txt", 3),
        ("a2:0", "A2 zero", "a2.txt.gz", 1),
        ("b1", "B one", "b.jsonl", 1),
        ("c1", "C one", "c.jsonl.gz", 1),
    ]
    assert [Path(f).name for f in corpus_files(str(root))] == ["a.txt", "a2.txt.gz", "b.jsonl", "c.jsonl.gz"]


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"empty: directory holds no corpus files"):
        list(iter_documents(str(tmp_path / "empty")))
    write(tmp_path / "other" / "README.md", "hi\n")
    with pytest.raises(InputError, match=r"other: directory holds no corpus files"):
        list(iter_documents(str(tmp_path / "other")))


def test_streams_documents_before_a_later_error(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"_id": "ok", "text": "fine"}) + "{broken\n")
    it = iter_documents(str(path))
    assert next(it) == Document("ok", "fine", str(path), 1)
    with pytest.raises(InputError, match=r"c\.jsonl line 2: malformed JSON"):
        next(it)


def test_bundled_bible_sample():
    stats = CorpusStats()
    docs = list(iter_documents(str(REPO / SAMPLE_CORPUS), on_empty="error", stats=stats))
    assert stats.documents == len(docs) == 10904
    assert docs[0].doc_id == "Gen.1.1" and docs[-1].doc_id == "Acts.28.31"
    books = {}
    for d in docs:
        books[d.doc_id.split(".")[0]] = books.get(d.doc_id.split(".")[0], 0) + 1
    assert books == {
        "Gen": 1533,
        "Exod": 1213,
        "Ps": 2461,
        "Prov": 915,
        "Matt": 1071,
        "Mark": 678,
        "Luke": 1150,
        "John": 879,
        "Acts": 1004,
    }


# ---------------------------------------------------------------- bad input


def test_malformed_json(tmp_path):
    path = write(tmp_path / "bad.jsonl", jsonl({"_id": "1", "text": "x"}) + "\n" + '{"_id": "2" "text": "y"}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl line 3: malformed JSON \(Expecting ',' delimiter: column 13\)"):
        list(iter_documents(str(path)))


@pytest.mark.parametrize(
    "value, kind", [('["a", "b"]', "array"), ('"just a string"', "string"), ("42", "number"), ("null", "null")]
)
def test_non_object_json(tmp_path, value, kind):
    path = write(tmp_path / "arr.jsonl", jsonl({"_id": "1", "text": "x"}) + value + "\n")
    with pytest.raises(InputError, match=rf"arr\.jsonl line 2: expected a JSON object, got {kind}"):
        list(iter_documents(str(path)))


def test_missing_text(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"_id": "1", "text": "x"}, {"_id": "2", "title": "T"}))
    with pytest.raises(InputError, match=r"c\.jsonl line 2: missing field 'text' \(id 2\)"):
        list(iter_documents(str(path)))


def test_missing_id(tmp_path):
    path = write(tmp_path / "c.jsonl", "\n\n" + jsonl({"id": "1", "text": "x"}))
    with pytest.raises(InputError, match=r"c\.jsonl line 3: missing field '_id'"):
        list(iter_documents(str(path)))


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"_id": "1", "text": 5}, r"field 'text' must be a string, got number"),
        ({"_id": "1", "text": None}, r"field 'text' must be a string, got null"),
        ({"_id": ["1"], "text": "x"}, r"field '_id' must be a string or a number, got array"),
        ({"_id": True, "text": "x"}, r"field '_id' must be a string or a number, got boolean"),
        ({"_id": "", "text": "x"}, r"field '_id' is empty"),
        ({"_id": "1", "title": 3, "text": "x"}, r"field 'title' must be a string, got number"),
    ],
)
def test_wrong_field_types(tmp_path, obj, message):
    path = write(tmp_path / "types.jsonl", jsonl({"_id": "0", "text": "ok"}, obj))
    with pytest.raises(InputError, match=r"types\.jsonl line 2: " + message):
        list(iter_documents(str(path)))


def test_empty_documents_skipped_and_counted(tmp_path):
    path = write(
        tmp_path / "c.jsonl",
        jsonl(
            {"_id": "1", "text": "one"},
            {"_id": "2", "text": ""},
            {"_id": "3", "title": " ", "text": " \t\n "},
            {"_id": "4", "text": "four"},
        ),
    )
    stats = CorpusStats()
    assert [d.doc_id for d in iter_documents(str(path), stats=stats)] == ["1", "4"]
    assert stats.documents == 2 and stats.skipped_empty == 2
    assert stats.skipped_examples == [f"{path} line 2: empty text (id 2)", f"{path} line 3: empty text (id 3)"]
    assert stats.as_dict()["skipped_empty"] == 2


def test_skipped_examples_are_capped(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl(*({"_id": str(i), "text": " "} for i in range(30))))
    stats = CorpusStats()
    assert list(iter_documents(str(path), stats=stats)) == []
    assert stats.skipped_empty == 30 and len(stats.skipped_examples) == 20
    assert stats.skipped_examples[-1] == f"{path} line 20: empty text (id 19)"


def test_empty_document_error_mode(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"_id": "1", "text": "one"}, {"_id": "2", "text": "   "}))
    with pytest.raises(InputError, match=r"c\.jsonl line 2: empty text \(id 2\)"):
        list(iter_documents(str(path), on_empty="error"))


def test_bad_on_empty_value_raises_immediately(tmp_path):
    with pytest.raises(ValueError, match="on_empty"):
        iter_documents(str(tmp_path / "whatever.jsonl"), on_empty="drop")


def test_duplicate_ids_across_files(tmp_path):
    write(tmp_path / "d" / "a.jsonl", "\n\n" + jsonl({"_id": "X", "text": "first"}))
    write(
        tmp_path / "d" / "b.jsonl",
        jsonl(*({"_id": f"b{i}", "text": "t"} for i in range(6)), {"_id": "X", "text": "second"}),
    )
    with pytest.raises(InputError, match=r"duplicate id 'X' at \S*b\.jsonl line 7 \(first at \S*a\.jsonl line 3\)"):
        list(iter_documents(str(tmp_path / "d")))


def test_duplicate_ids_within_a_file(tmp_path):
    path = write(tmp_path / "c.jsonl", jsonl({"_id": 1, "text": "a"}, {"_id": "1", "text": "b"}))
    with pytest.raises(InputError, match=r"duplicate id '1' at \S*c\.jsonl line 2 \(first at \S*c\.jsonl line 1\)"):
        list(iter_documents(str(path)))


def test_invalid_utf8(tmp_path):
    path = write(
        tmp_path / "c.jsonl", jsonl({"_id": "1", "text": "ok"}).encode() + b'{"_id": "2", "text": "caf\xe9"}\n'
    )
    with pytest.raises(InputError, match=r"c\.jsonl line 2: invalid UTF-8 at byte offset 25 .*0xe9"):
        list(iter_documents(str(path)))


def test_invalid_utf8_in_txt(tmp_path):
    path = write(tmp_path / "t.txt", b"fine\n\nstill fine\n\xff\xfe bad\n")
    with pytest.raises(InputError, match=r"t\.txt line 4: invalid UTF-8 at byte offset 0 "):
        list(iter_documents(str(path)))


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match=r"nope\.jsonl: no such file or directory"):
        list(iter_documents(str(tmp_path / "nope.jsonl")))


def test_unsupported_file_type(tmp_path):
    path = write(tmp_path / "c.csv", "a,b\n")
    with pytest.raises(InputError, match=r"c\.csv: unsupported corpus file type"):
        list(iter_documents(str(path)))


def test_corrupt_gzip(tmp_path):
    data = gzip.compress(jsonl(*({"_id": str(i), "text": "t" * 50} for i in range(2000))).encode())
    path = write(tmp_path / "c.jsonl.gz", data[: len(data) // 2])
    # Cut short: every whole line before the cut is read; the error names the line it cuts.
    cut = zlib.decompressobj(zlib.MAX_WBITS | 16).decompress(data[: len(data) // 2]).count(b"\n") + 1
    assert cut > 500  # far past the first line
    with pytest.raises(InputError, match=rf"c\.jsonl\.gz line {cut}: corrupt gzip data \(the file ends before"):
        list(iter_documents(str(path)))
    two_members = write(tmp_path / "two.jsonl.gz", data + gzip.compress(jsonl({"_id": "last", "text": "t"}).encode()))
    assert [d.doc_id for d in iter_documents(str(two_members))][-2:] == ["1999", "last"]
    path = write(tmp_path / "plain.jsonl.gz", jsonl({"_id": "1", "text": "not zipped"}))
    with pytest.raises(InputError, match=r"plain\.jsonl\.gz line 1: corrupt gzip data"):
        list(iter_documents(str(path)))


def test_corpus_error_pickles_with_location(tmp_path):
    err = InputError("f.jsonl line 3: boom", source="f.jsonl", line=3)
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, InputError) and isinstance(back, ValueError)
    assert (str(back), back.source, back.line) == ("f.jsonl line 3: boom", "f.jsonl", 3)


# ---------------------------------------------------------------- passages of consecutive records


def _verses(*specs):
    return [Document(doc_id, text, "bible.jsonl", line) for line, (doc_id, text) in enumerate(specs, 1)]


def test_consecutive_verses_join_into_passages_within_a_chapter():
    verses = _verses(
        ("Gen.1.1", "a b c"),
        ("Gen.1.2", "d e"),
        ("Gen.1.3", "f g h i"),  # 3 + 2 + 4 > 8 words: a new passage
        ("Gen.2.1", "j"),  # a new chapter: a new passage
        ("Gen.2.2", "k l m n o p q r s t"),  # longer than max_words alone: kept whole
        ("Exod.1.1", "u"),
    )
    joined = list(join_consecutive(iter(verses), JoinConfig(group_by=r"^(.+)\.\d+$", max_words=8)))
    assert [(d.doc_id, d.text, d.line) for d in joined] == [
        ("Gen.1.1..Gen.1.2", "a b c d e", 1),
        ("Gen.1.3", "f g h i", 3),
        ("Gen.2.1", "j", 4),
        ("Gen.2.2", "k l m n o p q r s t", 5),
        ("Exod.1.1", "u", 6),
    ]
    # Every word once, in order: nothing lost or repeated.
    assert " ".join(d.text for d in joined).split() == " ".join(v.text for v in verses).split()
    assert list(join_consecutive(iter(verses), JoinConfig())) == verses  # no pattern: unchanged


def test_an_id_outside_the_join_pattern_names_its_file_and_line():
    verses = _verses(("Gen.1.1", "a"), ("intro", "b"))
    with pytest.raises(InputError, match="bible.jsonl line 2: id 'intro' does not match"):
        list(join_consecutive(iter(verses), JoinConfig(group_by=r"^(.+)\.\d+$")))


@pytest.mark.parametrize("group_by, message", [("(", "not a regex"), (r"^\w+$", "needs a group")])
def test_bad_join_patterns_are_refused(group_by, message):
    with pytest.raises(ValueError, match=message):
        JoinConfig(group_by=group_by)
