"""A user's mistake, tried as a new user would from the command line: one clear line that
names the bad value, exit code 2, no traceback (RAYDENSE_DEBUG=1 shows it; the mechanism,
crashes included: tests/core/test_config.py). The jobs run in this process, on the tests' Ray."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import synthetic_docs, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_each_kind_of_user_error_exits_2_with_one_line_naming_the_value(tmp_path, shared_ray, monkeypatch, capsys):
    from transformers import GPT2Config, ModernBertConfig

    from tests.helpers import index_of_random_vectors, save_tiny_bert, train_decoder_tokenizer

    tiny_model = save_tiny_bert(str(tmp_path / "tiny"), [d["text"] for d in synthetic_docs(30)])
    bad_queries = tmp_path / "queries.jsonl"
    bad_queries.write_text('{"_id": "q1", "text": "fine"}\n{"_id": "q2", "text": \n')
    corpus = str(REPO / "data" / "bible-sample")
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("weights elsewhere")
    # A config of another family over the tiny BERT's weights: transformers would load it with
    # every weight at random, and a job would report metrics of noise.
    other_family, other_weights = tmp_path / "gpt2", tmp_path / "modernbert"
    for folder, config in (
        (other_family, GPT2Config(n_embd=32, n_layer=2, n_head=2)),
        (other_weights, ModernBertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, pad_token_id=0)),
    ):
        shutil.copytree(tiny_model, folder)
        config.save_pretrained(folder)
    # A prepared corpus one of whose shards was cut short since: its reuse names the shard.
    from pipeline.data.prepare import PrepareConfig, prepare_corpus

    prepare = ["--corpus.input", write_jsonl(tmp_path / "raw.jsonl", synthetic_docs(30)), "--corpus.vocab_size", "120"]
    prepare += ["--corpus.output", str(tmp_path / "prepared")]
    prepare_corpus(PrepareConfig(input=prepare[1], output=prepare[5], vocab_size=120))
    (cut_short,) = (tmp_path / "prepared" / "shards").glob("*.parquet")
    written = cut_short.stat().st_size
    os.truncate(cut_short, written // 2)
    cases = {
        "config value": (
            ["jobs.bm25_negatives", "--corpus", "c", "--queries", "q", "--qrels", "r", "--depth", "10"],
            "count (30) must not exceed depth (10)",
        ),
        "missing file": (
            ["jobs.bm25_negatives", "--corpus", str(tmp_path / "nowhere.jsonl"), "--queries", "q", "--qrels", "r"],
            f"{tmp_path / 'nowhere.jsonl'}: no such file or directory",
        ),
        "bad reference": (
            ["jobs.encode", "--corpus", corpus, "--encoder.model", str(tmp_path / "no-model")],
            str(tmp_path / "no-model"),
        ),
        "bad input data": (
            ["jobs.bm25_negatives", "--corpus", corpus, "--queries", str(bad_queries), "--qrels", str(bad_queries)],
            "queries.jsonl line 2",
        ),
        "a folder that is not a model": (
            ["jobs.encode", "--corpus", corpus, "--encoder.model", str(not_a_model)],
            f"{not_a_model}: not a model (none of config.json, retriever.json there)",
        ),
        "a model of an unsupported family": (
            ["jobs.encode", "--corpus", corpus, "--encoder.model", str(other_family)],
            f"--encoder.model {other_family}: model_type 'gpt2' is not supported (supported: bert, roberta,",
        ),
        "weights that are not the model's": (
            ["jobs.encode", "--corpus", corpus, "--encoder.model", str(other_weights)],
            f"--encoder.model {other_weights}: only 0 of the",
        ),
        "a damaged shard of a reused corpus": (
            ["jobs.prepare_corpus", *prepare],
            f"corpus shard {cut_short} is {written // 2} bytes, written as {written}: --corpus.overwrite true prepares",
        ),
        "closed set: pooling": (["jobs.encode", "--encoder.pooling", "bogus"], "'bogus'"),
        "closed set: on_empty": (["jobs.prepare_corpus", "--corpus.on_empty", "explode"], "'explode'"),
        "closed set, former name": (["jobs.encode", "--encoder.normalize", "maybe"], "'maybe'"),
        "closed set, former flag": (["jobs.evaluate", "--normalize=maybe"], "'maybe'"),
    }
    sample = REPO / "data" / "bible-sample"
    header = "query-id\tcorpus-id\tscore\n"
    for name, lines in {
        "unknown_doc": "nave-52\tExod.6.24\t1\nnave-64\tNot.A.Verse\t1\n",
        "columns": "nave-52\tExod.6.24\n",
        "score": "nave-52\tExod.6.24\thigh\n",
        "header_only": "",
    }.items():
        (tmp_path / f"{name}.tsv").write_text(header + lines)
    evaluate = ["jobs.evaluate", "--encoder.model", str(tiny_model), "--output", str(tmp_path / "eval")]
    evaluate += ["--corpus", str(sample / "corpus.jsonl"), "--queries", str(sample / "queries.dev.jsonl")]
    dev_qrels = ["--qrels", str(sample / "qrels.dev.tsv")]
    (tmp_path / "no_queries.jsonl").write_text("")
    cases |= {
        "a queries file without a query": (  # judged none of 0 queries, said as if the qrels were wrong
            [*evaluate, *dev_qrels, "--queries", str(tmp_path / "no_queries.jsonl")],
            f"{tmp_path / 'no_queries.jsonl'}: no query to evaluate",
        ),
        "judged document not in the corpus": (
            [*evaluate, "--qrels", str(tmp_path / "unknown_doc.tsv")],
            "unknown_doc.tsv line 3: unknown document id 'Not.A.Verse'",
        ),
        "qrels columns": ([*evaluate, "--qrels", str(tmp_path / "columns.tsv")], "line 2: expected 3 columns"),
        "qrels score": ([*evaluate, "--qrels", str(tmp_path / "score.tsv")], "score must be an integer, got 'high'"),
        "qrels with no judgment": (  # all-zero metrics after the whole run, before
            [*evaluate, "--qrels", str(tmp_path / "header_only.tsv")],
            "header_only.tsv: has only its header: a qrels file needs judgments",
        ),
        "FAISS factory": ([*evaluate, *dev_qrels, "--index", "IVFbogus"], "FAISS rejects the index factory 'IVFbogus'"),
        "evaluation queries without qrels": (
            ["jobs.finetune", "--eval.queries", str(sample / "queries.dev.jsonl")],
            "queries given without qrels",
        ),
        "a bad evaluation file, found before training": (
            [
                "jobs.finetune",
                "--model.init",
                str(tiny_model),
                "--corpus.input",
                str(sample / "corpus.jsonl"),
                "--train.output",
                str(tmp_path / "run"),
                "--eval.queries",
                str(sample / "queries.dev.jsonl"),
                "--eval.qrels",
                str(tmp_path / "score.tsv"),
            ],
            "score must be an integer, got 'high'",
        ),
    }
    # A model folder whose tokenizer files were left behind: transformers loads a tokenizer of
    # 5 special tokens from it, and the job ran to exit 0 on every word as [UNK].
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "special_tokens*"))
    untokenized = "holds no tokenizer vocabulary (none of tokenizer.json, vocab.txt"
    cases["evaluating a model without its tokenizer"] = (
        [*evaluate, *dev_qrels, "--encoder.model", str(no_tokenizer)],
        f"--encoder.model {no_tokenizer}: {untokenized}",
    )
    cases["fine-tuning a model without its tokenizer"] = (
        ["jobs.finetune", "--model.init", str(no_tokenizer), "--train.output", str(tmp_path / "run")],
        f"--model.init {no_tokenizer}: {untokenized}",
    )
    # Lengths past the model's positions: a 98-line RuntimeError in its embeddings, minutes in.
    past_positions = "1024 is more than the"
    cases["an encoder length past the model's positions"] = (
        [*evaluate, *dev_qrels, "--encoder.passage_max_len", "1024"],
        f"--encoder.passage_max_len {past_positions}",
    )
    cases["a training length past the model's positions"] = (
        [
            "jobs.finetune",
            "--model.init",
            str(tiny_model),
            "--data.query_max_len",
            "1024",
            "--train.output",
            str(tmp_path / "run"),
        ],
        f"--data.query_max_len {past_positions}",
    )
    run = ["--train.output", str(tmp_path / "run")]
    for option, value, named in [
        ("num_workers", "0", "num_workers must be >= 1, got 0"),
        ("lr", "-0.001", "lr must be > 0, got -0.001"),
        ("zero_stage", "7", "zero_stage must be 0, 1, 2 or 3, got 7"),
        ("max_steps", "-1", "max_steps must be >= 0, got -1"),
        ("warmup_ratio", "1.5", "warmup_ratio must be in [0, 1), got 1.5"),
    ]:
        for job in ("jobs.pretrain", "jobs.finetune"):
            cases[f"{job} {option} out of range"] = ([job, *run, f"--train.{option}", value], named)
    for job in ("jobs.pretrain", "jobs.finetune"):  # the tests' Ray: one node of 4 CPUs
        init = ["--model.init", str(tiny_model)] if job == "jobs.finetune" else []
        cases[f"{job}: workers no node can hold"] = (
            [job, *run, *init, "--train.num_workers", "2", "--train.cpus_per_worker", "3"],
            "--train.num_workers 2 x (--train.cpus_per_worker 3): 2 x CPU 3 do not fit on this cluster's nodes (CPU 4",
        )
        cases[f"{job}: workers that leave no CPU for the ingest"] = (
            [job, *run, *init, "--train.num_workers", "2", "--train.cpus_per_worker", "2"],
            "--train.num_workers 2 x --train.cpus_per_worker 2 take 4 of this cluster's 4 CPUs, leaving none for Ray Data",
        )
    # A decoder's tokenizer has no [CLS] or [MASK]: pre-training failed on it once the corpus was
    # prepared. Mutation: check_special_tokens not called in run_pretraining (the row fails).
    decoder_tokenizer = train_decoder_tokenizer(str(tmp_path / "qwen2-tokenizer"), "qwen2", ["a b c", "d e f"])
    decoder_tokenizer.save_pretrained(str(tmp_path / "qwen2-tokenizer"))
    cases["pre-training with a tokenizer that has no [MASK]"] = (
        ["jobs.pretrain", *run, "--corpus.input", str(sample / "corpus.jsonl"), "--corpus.output", str(tmp_path / "p2")]
        + ["--corpus.tokenizer", str(tmp_path / "qwen2-tokenizer")],
        f"--corpus.tokenizer {tmp_path / 'qwen2-tokenizer'}: its tokenizer has no cls_token",
    )
    cases["no steps and no epochs"] = (
        ["jobs.finetune", *run, "--train.max_steps", "0", "--train.epochs", "0"],
        "max_steps and epochs are both 0",
    )
    cases["pre-training by epochs alone"] = (
        ["jobs.pretrain", *run, "--train.max_steps", "0", "--train.epochs", "1"],
        "train.max_steps must be >= 1",
    )
    index, _, _ = index_of_random_vectors(tmp_path / "narrow", 1, 40, 16, "Flat")
    cases["an encoder as wide as the index"] = (  # FAISS's assertion in a searcher, after encoding, before
        [
            *("jobs.mine", "--index", index, "--encoder.model", str(tiny_model), "--output", str(tmp_path / "mined")),
            *("--queries", str(sample / "queries.dev.jsonl"), *dev_qrels),
        ],
        f"--encoder.model {tiny_model} encodes 32-wide vectors, but --index {index} holds 16-wide ones (encoded by m)",
    )
    monkeypatch.delenv("RAYDENSE_DEBUG", raising=False)
    (tmp_path / "data").symlink_to(REPO / "data")  # the jobs' defaults: the bundled sample, repo-relative
    monkeypatch.chdir(tmp_path)
    for kind, (argv, named) in cases.items():
        job = importlib.import_module(argv[0])
        monkeypatch.setattr(sys, "argv", [job.__file__, *argv[1:]])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            job.main()  # as `python jobs/....py ...` runs it: argv from the command line
        out, err = capsys.readouterr()
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert exited.value.code == 2, (kind, err[-2000:])
        assert "Traceback" not in err and len(errors) == 1 and named in errors[0], (kind, err[-2000:])
        assert out == "", kind  # no summary: stdout's last line is a finished job's
        # Nothing a rerun could take for work done: no training run, no embeddings.
        assert not (tmp_path / "run").exists() and not (tmp_path / "eval" / "embeddings" / "shards").exists(), kind


def test_placement_is_judged_by_the_autoscalers_node_types_when_there_are_any(monkeypatch):
    """An autoscaling cluster with only its head alive: a request some node type holds waits
    for the autoscaler; one no node type holds fails, naming the types."""
    from pipeline.core import runtime

    types = {"cpu": {"CPU": 16.0}, "gpu-8x": {"CPU": 96.0, "GPU": 8.0}}
    monkeypatch.setattr(runtime, "_autoscaler_node_types", lambda: types)
    monkeypatch.setattr(runtime.ray, "is_initialized", lambda: True)
    assert runtime.placement_problem({"CPU": 8, "GPU": 1}, 64) == ""  # nodes will be added
    problem = runtime.placement_problem({"CPU": 8, "GPU": 16}, 1)
    assert (
        problem
        == "no node type of this autoscaling cluster holds CPU 8, GPU 16 (node types: cpu: CPU 16; gpu-8x: CPU 96, GPU 8)"
    )
