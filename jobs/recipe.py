"""Run the whole retriever recipe from one config, stage by stage, resumable.

Stages: pretrain (optional), bm25 (unless --bm25.enabled false), zeroshot, mine0 (with
--mine.bm25_negatives false), round1, mine1, round2, mine2, reranker, rerank, teacher,
distill. Finished stages are recorded in <output>/recipe.json and
skipped on a rerun; --only STAGE reruns one stage, --from STAGE restarts from a stage.
With no arguments it runs the embedded recipe: a tiny Condenser pre-trained on the bundled
Bible sample, then every stage on its queries. Prints a JSON summary as its last line, and
writes <output>/results.md.
"""

from pipeline.core.entry import run_job
from pipeline.workflows.recipe import RecipeConfig, cli_args, run_recipe


def main(argv=None) -> dict:
    return run_job(RecipeConfig, run_recipe, __doc__, argv, translate_argv=cli_args)


if __name__ == "__main__":
    main()
