"""Re-rank a first-stage TREC run with a cross-encoder on Ray actors.

  python jobs/rerank_score.py --model runs/rerank/export --run runs/evaluate/run.trec \
      --queries FILE --corpus FILE [--qrels FILE] [--depth 100] [--include_positives]

Scores the top-depth candidates of every query (with --include_positives also the judged
positives the run missed: the distillation teacher's scores), writes run.trec with the
re-ranker's scores under --output and, with qrels, prints MRR@10, R@10, R@100, R@1000 and
nDCG@10 (ir_measures) of the re-ranked and the first-stage run. The last line is a JSON summary.
"""

from pipeline.core.entry import run_job
from pipeline.retrieval.rerank_scoring import (
    RerankScoreConfig,
    print_metrics,
    run_scoring,
)


def main(argv=None) -> dict:
    return run_job(RerankScoreConfig, run_scoring, __doc__, argv, report=print_metrics)


if __name__ == "__main__":
    main()
