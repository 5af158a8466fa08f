"""Pre-train a BERT encoder (Condenser) on Ray Train + DeepSpeed, streaming a prepared corpus.

With no arguments it runs the embedded default: a tiny Condenser on the bundled Bible
sample, on a local Ray, writing under ./runs/. Prints a JSON summary as its last line.
"""

from pipeline.core.config import parse_config
from pipeline.training.pretrain import PretrainConfig, run_pretraining
from pipeline.core.runtime import init_ray, print_summary


def main(argv=None) -> dict:
    cfg = parse_config(PretrainConfig, argv, description=__doc__)
    init_ray(cfg.ray)
    summary = run_pretraining(cfg)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
