"""CLS attention entropy per layer (Condenser paper, Figure 2) of one or more checkpoints.

Example: python jobs/analyze.py --checkpoints runs/pretrain-condenser/export,path/to/bert
--labels condenser,bert. With only --checkpoints it reads 256 passages of the bundled Bible
sample and writes entropy.json and cls_entropy.png under ./runs/analyze. Prints a JSON
summary as its last line.
"""

from pipeline.workflows.analyze import AnalyzeConfig, run_analysis
from pipeline.core.config import parse_config
from pipeline.core.runtime import print_summary


def main(argv=None) -> dict:
    cfg = parse_config(AnalyzeConfig, argv, description=__doc__)
    summary = run_analysis(cfg)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
