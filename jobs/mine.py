"""Mine hard negatives for the next fine-tuning round from a sharded dense index.

Top-depth search (200) with the round's retriever, every judged positive excluded by id,
an optional answer-string filter, and `count` (30) negatives sampled per query (seeded).
Writes negatives.jsonl (for jobs/finetune.py --data.negatives), the Tevatron training
file (passages by id) and the TREC run. Prints a JSON summary as its last line.
"""

from pipeline.core.config import parse_config
from pipeline.retrieval.mine import MineConfig, run_mining
from pipeline.core.runtime import init_ray, print_summary


def main(argv=None) -> dict:
    cfg = parse_config(MineConfig, argv, description=__doc__)
    init_ray(cfg.ray)
    summary = run_mining(cfg)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
