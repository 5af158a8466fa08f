"""Mine hard negatives for the next fine-tuning round from a sharded dense index.

Top-depth search (200) with the round's retriever, every judged positive excluded by id,
an optional answer-string filter, and `count` (30) negatives sampled per query (seeded).
Writes negatives.jsonl (for jobs/finetune.py --data.negatives), the Tevatron training
file (passages by id) and the TREC run. Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.retrieval.mine import MineConfig, run_mining


def main(argv=None) -> dict:
    return run_job(MineConfig, run_mining, __doc__, argv)


if __name__ == "__main__":
    main()
