"""Tokenize raw documents (BEIR corpus.jsonl or blank-line separated .txt) into sharded Parquet.

Writes shards, a manifest and the tokenizer to a local folder or an s3:// prefix, using
Ray Data to tokenize shards in parallel. Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.data.prepare import PrepareJobConfig, run_preparation


def main(argv=None) -> dict:
    return run_job(PrepareJobConfig, run_preparation, __doc__, argv)


if __name__ == "__main__":
    main()
