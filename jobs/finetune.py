"""Fine-tune a bi-encoder retriever on Ray Train + DeepSpeed (DPR-style contrastive loss).

With no arguments it runs the embedded default: the tiny Condenser that
`python jobs/pretrain.py` exports, fine-tuned on the bundled sample's training queries
with BM25 negatives (mined here with bm25s). With --eval.queries and --eval.qrels it then
evaluates the export (encoders, FAISS, searchers); the default run does not. Prints a JSON
summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.training.finetune import FinetuneConfig, run_finetuning


def main(argv=None) -> dict:
    return run_job(FinetuneConfig, run_finetuning, __doc__, argv)


if __name__ == "__main__":
    main()
