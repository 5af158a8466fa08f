"""Pre-train a BERT encoder (Condenser) on Ray Train + DeepSpeed, streaming a prepared corpus.

With no arguments it runs the embedded default: a tiny Condenser on the bundled Bible
sample, on a local Ray, writing under ./runs/. Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.training.pretrain import PretrainConfig, run_pretraining


def main(argv=None) -> dict:
    return run_job(PretrainConfig, run_pretraining, __doc__, argv)


if __name__ == "__main__":
    main()
