"""CLS attention entropy per layer (Condenser paper, Figure 2) of one or more checkpoints.

Example: python jobs/analyze.py --checkpoints runs/pretrain-condenser/export,path/to/bert
--labels condenser,bert. With only --checkpoints it reads 256 passages of the bundled Bible
sample and writes entropy.json and cls_entropy.png under ./runs/analyze. Prints a JSON
summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.workflows.analyze import AnalyzeConfig, run_analysis


def main(argv=None) -> dict:
    return run_job(AnalyzeConfig, run_analysis, __doc__, argv)


if __name__ == "__main__":
    main()
