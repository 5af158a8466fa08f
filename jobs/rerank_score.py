"""Re-rank a first-stage TREC run with a cross-encoder on Ray actors.

  python jobs/rerank_score.py --model runs/rerank/export --run runs/evaluate/run.trec \
      --queries FILE --corpus FILE [--qrels FILE] [--depth 100] [--include_positives]

Scores the top-depth candidates of every query (with --include_positives also the judged
positives the run missed: the distillation teacher's scores), writes run.trec with the
re-ranker's scores under --output and, with qrels, prints MRR@10, R@10, R@100, R@1000 and
nDCG@10 (ir_measures) of the re-ranked and the first-stage run. The last line is a JSON summary.
"""

from pipeline.core.config import parse_config
from pipeline.retrieval.metrics import metrics_table
from pipeline.retrieval.rerank_scoring import RerankScoreConfig, run_scoring
from pipeline.core.runtime import init_ray, print_summary


def main(argv=None) -> dict:
    cfg = parse_config(RerankScoreConfig, argv, description=__doc__)
    init_ray(cfg.ray)
    summary = run_scoring(cfg)
    if "metrics" in summary:
        print("first stage\n" + metrics_table(summary["first_stage_metrics"]), flush=True)
        print("re-ranked\n" + metrics_table(summary["metrics"]), flush=True)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
