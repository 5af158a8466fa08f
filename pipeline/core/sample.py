"""The bundled sample collection: the data of every embedded default.

``data/bible-sample`` holds 10,904 public-domain Bible verses with train and dev queries
and judgments in BEIR layout. The paths are relative to the repository root, where jobs
run (``python jobs/X.py``, or ``ray job submit --working-dir .``, which ships the folder).
"""

SAMPLE_DIR = "data/bible-sample"
SAMPLE_CORPUS = f"{SAMPLE_DIR}/corpus.jsonl"
SAMPLE_TRAIN_QUERIES = f"{SAMPLE_DIR}/queries.train.jsonl"
SAMPLE_TRAIN_QRELS = f"{SAMPLE_DIR}/qrels.train.tsv"
SAMPLE_DEV_QUERIES = f"{SAMPLE_DIR}/queries.dev.jsonl"
SAMPLE_DEV_QRELS = f"{SAMPLE_DIR}/qrels.dev.tsv"
