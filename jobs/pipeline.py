"""Run the whole retriever recipe from one config, stage by stage, resumable.

Stages: pretrain (optional), bm25, zeroshot, round1, mine1, round2, mine2, reranker,
rerank, teacher, distill. Finished stages are recorded in <output>/pipeline.json and
skipped on a rerun; --only STAGE reruns one stage, --from STAGE restarts from a stage.
With no arguments it runs the embedded recipe: a tiny Condenser pre-trained on the bundled
Bible sample, then every stage on its queries. Prints a JSON summary as its last line, and
writes <output>/results.md.
"""

import os
import sys

# Python puts this file's folder first on sys.path, where this very file would shadow the
# `pipeline` package it runs.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
if sys.modules.get("pipeline") is not None and not hasattr(sys.modules["pipeline"], "__path__"):
    del sys.modules["pipeline"]

from pipeline.core.config import parse_config
from pipeline.workflows.recipe import PipelineConfig, cli_args, run_pipeline
from pipeline.core.runtime import init_ray, print_summary


def main(argv=None) -> dict:
    cfg = parse_config(PipelineConfig, cli_args(sys.argv[1:] if argv is None else argv), description=__doc__,
                       exit_on_error=argv is None)
    init_ray(cfg.ray)
    summary = run_pipeline(cfg)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
