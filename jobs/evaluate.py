"""Evaluate a retriever: encode the corpus on Ray actors, build a FAISS index, search, score.

  python jobs/evaluate.py --encoder.model DIR --corpus FILE --queries FILE --qrels FILE
      [--encoder.pooling cls|mean] [--encoder.similarity cos|dot] [--index FACTORY] [--k 1000]
  python jobs/evaluate.py --encoder.model DIR --collections DIR1,DIR2,... [--split test]

Writes a TREC run and metrics.json under --output, prints a table of MRR@10, R@10, R@100,
R@1000 and nDCG@10 (ir_measures), and as its last line a JSON summary with a `metrics` key.
With --collections (BEIR folders), each is evaluated under --output/<name>, and one table
(each collection and the average) goes to collections.md, collections.json and collections.png.
"""

from pipeline.core.entry import run_job
from pipeline.retrieval.evaluate import EvaluateJobConfig, print_metrics, run_evaluation


def main(argv=None) -> dict:
    return run_job(EvaluateJobConfig, run_evaluation, __doc__, argv, report=print_metrics)


if __name__ == "__main__":
    main()
