"""Fine-tune a bi-encoder retriever on Ray Train + DeepSpeed (DPR-style contrastive loss).

With no arguments it runs the embedded default: the tiny Condenser that
`python jobs/pretrain.py` exports, fine-tuned on the bundled sample's training queries
with BM25 negatives (mined here with bm25s), then evaluated on its dev queries by exact
search. Prints a JSON summary as its last line.
"""

from pipeline.core.config import parse_config
from pipeline.training.finetune import FinetuneConfig, run_finetuning
from pipeline.core.runtime import init_ray, print_summary


def main(argv=None) -> dict:
    cfg = parse_config(FinetuneConfig, argv, description=__doc__)
    init_ray(cfg.ray)
    summary = run_finetuning(cfg)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
