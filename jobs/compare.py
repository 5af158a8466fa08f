"""Compare the pre-training methods the way the papers do, with one command.

From one initial checkpoint, continue pre-training with each method (none, mlm, condenser,
cocondenser warm-started from condenser, simlm with the mlm run as its generator), fine-tune
each with identical settings at several training-set sizes, evaluate each on the same dev
queries, and measure the CLS attention entropy before and after fine-tuning. Writes
results.md, results.json and comparison.png under --output; a rerun skips finished work.
With no arguments: MiniLM on the bundled Bible sample, a few steps each (a smoke run; the
real one is jobs/recipes/compare-nave.yaml). Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.workflows.compare import ComparisonConfig, run_comparison


def main(argv=None) -> dict:
    return run_job(ComparisonConfig, run_comparison, __doc__, argv)


if __name__ == "__main__":
    main()
