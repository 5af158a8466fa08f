"""Encode a corpus into embedding shards on a pool of Ray actors (one per GPU, or N CPU actors).

Resumable: a rerun skips the shards already written, and a shard whose actor died is
redone by a fresh actor. Pooling and normalisation come from the model's retriever.json
(written by jobs/finetune.py); flags override them for any HF checkpoint.
Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.retrieval.encode import EncodeConfig, run_encoding


def main(argv=None) -> dict:
    return run_job(EncodeConfig, run_encoding, __doc__, argv)


if __name__ == "__main__":
    main()
