"""Train a cross-encoder re-ranker on Ray Train + DeepSpeed (listwise CE, SimLM stage 3).

Each training query is read with 1 positive and group_size-1 negatives, by default drawn
from the round-2 top-k that jobs/mine.py wrote (--data.negatives runs/mine/negatives.jsonl;
'bm25' mines BM25 negatives here for a standalone run). Exports an HF sequence classifier
(one logit) with its tokenizer and reranker.json; with --eval.run, re-ranks that run on Ray
actors and evaluates it. Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.training.rerank import RerankConfig, run_reranker_training


def main(argv=None) -> dict:
    return run_job(RerankConfig, run_reranker_training, __doc__, argv)


if __name__ == "__main__":
    main()
