"""What a worker process imports for the work that needs no model: each module below is what
a Ray task or server actor of that work loads. torch and transformers would cost every such
fresh process ~3 s of CPU and over 100 MB (``bench/bench_tokenize_task.py``), on CPU nodes
that never run a model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKER_MODULES = [
    "pipeline.data.shard_tokenizing",  # corpus preparation's tokenizing tasks
    "pipeline.data.text_shards",  # text staging
    "pipeline.data.shards",  # shard lookups, the training streams' read tasks
    "pipeline.data.stream",  # pre-training's Ray Data stream
    "pipeline.data.group_stream",  # fine-tuning's Ray Data stream
    "pipeline.retrieval.embeddings",  # margin mining's positive scores
    "pipeline.retrieval.index_build",  # index shard builds
    "pipeline.retrieval.search",  # searchers
    "pipeline.retrieval.fanout",  # merge-then-write tasks
    "pipeline.retrieval.mined_block",  # mined blocks written in tasks
    "pipeline.retrieval.bm25",  # BM25 shards
    "pipeline.retrieval.passages",  # passage servers
]

PROBE = """
import importlib, json, sys
pulled = {}
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    for heavy in ("torch", "transformers"):
        if heavy in sys.modules and heavy not in pulled:
            pulled[heavy] = name
print(json.dumps(pulled))
"""


def test_the_modules_of_model_free_work_import_neither_transformers_nor_torch():
    """Imported one after another in a fresh interpreter: the first module after which torch
    or transformers is loaded is named."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(WORKER_MODULES)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}, done.stderr[-2000:]
