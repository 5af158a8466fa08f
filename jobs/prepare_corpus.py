"""Tokenize raw documents (BEIR corpus.jsonl or blank-line separated .txt) into sharded Parquet.

Writes shards, a manifest and the tokenizer to a local folder or an s3:// prefix, using
Ray Data to tokenize shards in parallel. Prints a JSON summary as its last line.
"""

from dataclasses import dataclass, field

from pipeline.core.config import parse_config
from pipeline.core.runtime import RayConfig, init_ray, print_summary
from pipeline.data.shards import PrepareConfig, prepare_corpus


@dataclass
class PrepareJobConfig:
    corpus: PrepareConfig = field(default_factory=PrepareConfig)
    ray: RayConfig = field(default_factory=RayConfig)


def main(argv=None) -> dict:
    cfg = parse_config(PrepareJobConfig, argv, description=__doc__)
    init_ray(cfg.ray)
    manifest = prepare_corpus(cfg.corpus)
    summary = {"job": "prepare_corpus", "output": cfg.corpus.output, "shards": len(manifest["shards"]),
               **{k: manifest[k] for k in ("num_docs", "num_tokens", "vocab_size", "input_stats")}}
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
