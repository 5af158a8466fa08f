"""The head's memory preparing a trainer's examples does not grow with the corpus: it holds
the ids the training data names, and one task a shard finds their rows."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.shards import PreparedCorpus
from pipeline.training import group_training
from tests.helpers import resident_growth

PER_SHARD = 250_000


def _corpus(folder, docs: int) -> PreparedCorpus:
    """A prepared corpus's id columns (all a lookup reads): ``docs`` MS MARCO-like ids."""
    os.makedirs(folder)
    shards = []
    for i, start in enumerate(range(0, docs, PER_SHARD)):
        rows = np.arange(start, min(start + PER_SHARD, docs))
        path = f"shard-{i:05d}.parquet"
        ids = pa.array(np.char.add(b"msmarco-", rows.astype("S8")).astype(object)).cast(pa.string())
        pq.write_table(pa.table({"row": rows, "doc_id": ids}), os.path.join(folder, path))
        shards.append({"path": path, "first_row": int(rows[0]), "rows": len(rows)})
    return PreparedCorpus(str(folder), {"shards": shards, "num_docs": docs})


def _training_data(folder, queries: int, corpus_docs: int) -> SimpleNamespace:
    """``queries`` training queries, each with a positive and 20 negatives spread over the
    whole corpus: the same data, whatever the corpus's size, names the same number of ids."""
    rng = np.random.default_rng(3)
    named = rng.choice(min(corpus_docs, 250_000), size=(queries, 21), replace=True)
    os.makedirs(folder)
    with open(os.path.join(folder, "queries.jsonl"), "w") as out:
        out.writelines(f'{{"_id": "q{q}", "text": "query {q}"}}\n' for q in range(queries))
    with open(os.path.join(folder, "qrels.tsv"), "w") as out:
        out.write("query-id\tcorpus-id\tscore\n")
        out.writelines(f"q{q}\tmsmarco-{named[q, 0]}\t1\n" for q in range(queries))
    with open(os.path.join(folder, "negatives.jsonl"), "w") as out:
        for q in range(queries):
            negatives = ", ".join(f'"msmarco-{d}"' for d in dict.fromkeys(named[q, 1:]) if d != named[q, 0])
            out.write(f'{{"query_id": "q{q}", "negatives": [{negatives}]}}\n')
    return SimpleNamespace(
        tevatron="",
        queries=os.path.join(folder, "queries.jsonl"),
        qrels=os.path.join(folder, "qrels.tsv"),
        negatives=os.path.join(folder, "negatives.jsonl"),
    )


def test_preparing_examples_holds_no_more_on_the_head_for_a_corpus_ten_times_larger(tmp_path, shared_ray):
    """The driver's resident peak (``resident_growth``) joining the same 2,000 training
    queries to a corpus of 250k and of 2.5M passages: within 8 MiB of each other (measured:
    no growth past the start at either size). Reading every corpus id on the driver
    (``CorpusIds.read``, the mutation: as before) grew it by 26 and 146 MB. The examples
    are the same rows."""
    data = _training_data(tmp_path / "data", 2_000, 250_000)
    grown, examples = {}, {}
    for docs in (250_000, 2_500_000):
        corpus = _corpus(tmp_path / f"corpus-{docs}", docs)
        cfg = SimpleNamespace(data=data)
        (rows, stats, _), grown[docs] = resident_growth(
            group_training._examples_by_row, cfg, corpus, group_training.load_examples
        )
        examples[docs] = (rows.positives.tolist(), rows.negatives.tolist(), stats.examples)
    assert examples[250_000] == examples[2_500_000] and examples[250_000][2] == 2_000
    assert grown[2_500_000] - grown[250_000] < 8 * 2**20, grown
