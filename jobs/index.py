"""Build FAISS index shards from embedding shards (jobs/encode.py output), in parallel Ray tasks.

The index type is a FAISS factory string (Flat, IVF4096,Flat, IVF4096,PQ64, HNSW32, ...),
trained on one seeded sample of the corpus. Before building, the memory each shard needs
is printed, and a plan that cannot fit is refused. faiss-gpu is used where a GPU is seen.
Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.retrieval.index_build import IndexJobConfig, run_indexing


def main(argv=None) -> dict:
    return run_job(IndexJobConfig, run_indexing, __doc__, argv)


if __name__ == "__main__":
    main()
