"""Evaluate a retriever: encode the corpus on Ray actors, build a FAISS index, search, score.

  python jobs/evaluate.py --model DIR --corpus FILE --queries FILE --qrels FILE
      [--pooling cls|mean] [--normalize] [--index FACTORY] [--k 1000]

Writes a TREC run and metrics.json under --output, prints a table of MRR@10, R@10, R@100,
R@1000 and nDCG@10 (ir_measures), and as its last line a JSON summary with a `metrics` key.
"""

from pipeline.core.config import parse_config
from pipeline.retrieval.evaluate import EvaluateJobConfig, run_evaluation
from pipeline.retrieval.metrics import metrics_table
from pipeline.core.runtime import init_ray, print_summary


def main(argv=None) -> dict:
    cfg = parse_config(EvaluateJobConfig, argv, description=__doc__)
    init_ray(cfg.ray)
    summary = run_evaluation(cfg)
    print(metrics_table(summary["metrics"]), flush=True)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
