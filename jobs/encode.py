"""Encode a corpus into embedding shards on a pool of Ray actors (one per GPU, or N CPU actors).

Resumable: a rerun skips the shards already written, and a shard whose actor died is
redone by a fresh actor. Pooling and normalisation come from the model's retriever.json
(written by jobs/finetune.py); flags override them for any HF checkpoint.
Prints a JSON summary as its last line.
"""

from pipeline.core.config import parse_config
from pipeline.retrieval.encode import EncodeConfig, run_encoding
from pipeline.core.runtime import init_ray, print_summary


def main(argv=None) -> dict:
    cfg = parse_config(EncodeConfig, argv, description=__doc__)
    init_ray(cfg.ray)
    summary = run_encoding(cfg)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
