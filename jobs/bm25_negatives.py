"""Round-1 hard negatives for retriever fine-tuning: BM25 (bm25s) top-depth minus judged positives.

With no arguments it mines the bundled sample's training queries. On another collection:
python jobs/bm25_negatives.py --corpus data/nave/corpus.jsonl
--queries data/nave/queries.train.jsonl --qrels data/nave/qrels.train.tsv
--output runs/bm25/negatives.jsonl. Writes the negatives jsonl and a TREC run of the BM25
results next to it. The index runs on Ray actors, one per --docs_per_shard documents (a local
Ray unless --ray.address or RAY_ADDRESS names a cluster). Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.retrieval.bm25_negatives import Bm25Config, mine_negatives


def main(argv=None) -> dict:
    return run_job(Bm25Config, mine_negatives, __doc__, argv)


if __name__ == "__main__":
    main()
