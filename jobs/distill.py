"""Distil a cross-encoder's scores into a bi-encoder retriever on Ray Train + DeepSpeed.

The loss is KL(teacher softmax || student softmax) over each query's group plus
--distill.alpha (0.2) times the contrastive loss; the teacher's scores are the TREC run
the scoring stage writes (--data.teacher_scores, required). Ends with the same export
(retriever.json) and evaluation as jobs/finetune.py. Prints a JSON summary as its last line.
"""

from pipeline.core.entry import run_job
from pipeline.training.distill import DistillConfig, run_distillation


def main(argv=None) -> dict:
    return run_job(DistillConfig, run_distillation, __doc__, argv)


if __name__ == "__main__":
    main()
