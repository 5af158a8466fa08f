"""Training throughput and model FLOP utilisation (MFU) of each pre-training method on one GPU.

    python bench/bench_methods_gpu.py                 # BERT-base and MiniLM sizes, bf16 autocast
    python bench/bench_methods_gpu.py --tiny --device cpu   # a smoke run of the same code

Each method (plain MLM, Condenser, coCondenser with and without the gradient cache, SimLM;
and coCondenser on a batch 8x larger with the cache's chunk sized from the device's free
memory, as jobs size it: its tokens/s against the no-cache row is issue 36's "within 1.3x")
trains its own module through the method interface of ``models/method.py`` (``make_batch``
then ``backward``) with torch's AdamW, on random token ids of full-length sequences (the
models are randomly initialised: throughput does not depend on the weights). No Ray and no
DeepSpeed: this measures the methods' own cost on the device, which is what the Ray Train
runs multiply by their workers.

Reported per method and size: the device's step time and tokens/s (input tokens of the
encoder; coCondenser's spans count as sequences of the same length), the CPU time of the
method's masking of one batch (timed apart: in a run it overlaps the device), the FLOPs of one step as counted by
``torch.utils.flop_counter.FlopCounterMode`` (the generator's forward included for SimLM),
and MFU against two ceilings: the datasheet's dense bf16 rate and a bf16 matrix product
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import record, smoke  # noqa: E402
from models import backbone
from models.backbone import BackboneConfig, build_mlm
from models.batches import to_device
from models.cocondenser import CoCondenserConfig, CoCondenserMethod
from models.compiled import repeated_blocks
from models.condenser import CondenserConfig, CondenserMethod
from models.masking import MaskingVocab
from models.memory import free_memory
from models.method import PlainEngine
from models.mlm import MLMConfig, MLMMethod
from models.packed_linears import pack_linears
from models.simlm import SimLMConfig, SimLMMethod
from pipeline.training.profiling import busy_line, device_profile, time_table

SIZES = {  # hidden, layers, heads, intermediate
    "bert-base": (768, 12, 12, 3072),
    "minilm": (384, 6, 12, 1536),
    "tiny": (64, 4, 2, 128),
}
DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12}  # dense, SXM parts


def vocab(size: int = 30522) -> MaskingVocab:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = size - len(tokens)
    tokens += [f"w{i}" for i in range(words * 4 // 5)]
    tokens += [f"##p{i}" for i in range(size - len(tokens))]
    return MaskingVocab(tokens, special_ids=[0, 1, 2, 3, 4], mask_token_id=4)


def batch_ids(
    batch: int, length: int, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, vocab_size, (batch, length), generator=generator)
    ids[:, 0], ids[:, -1] = 2, 3
    return ids, torch.ones_like(ids)


def small_generator(vocab_size: int, folder: str) -> str:
    """A randomly initialised small MLM (a third of BERT-base's width) as SimLM's frozen generator."""
    cfg = BertConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
    )
    BertForMaskedLM(cfg).save_pretrained(folder)
    return folder


SIZED_BATCH_SCALE = 8  # the memory-sized cache's batch: 8x one that fits without the cache


def methods(generator_dir: str, batch: int, length: int):
    """(name, method class, config, batch scale, chunk sized from memory)."""
    yield "mlm", MLMMethod, MLMConfig(), 1, False
    yield "condenser", CondenserMethod, CondenserConfig(), 1, False
    yield "cocondenser", CoCondenserMethod, CoCondenserConfig(head="", chunk_size=batch), 1, False
    yield "cocondenser-gradcache", CoCondenserMethod, CoCondenserConfig(head="", chunk_size=batch // 4), 1, False
    # The cache as jobs run it (chunk_size 0): the chunk sized from the device's free memory,
    # on a batch too large for one graph; its spans as long as the rows (the probe's length).
    sized = CoCondenserConfig(head="", chunk_size=0, span_length=length - 2)
    yield "cocondenser-gradcache-sized", CoCondenserMethod, sized, SIZED_BATCH_SCALE, True
    # The same batch in one graph, no cache, where memory holds it (issue 36's "within 1.3x
    # of the time without it", like for like).
    whole = CoCondenserConfig(head="", chunk_size=batch * SIZED_BATCH_SCALE, span_length=length - 2)
    yield "cocondenser-sized-batch", CoCondenserMethod, whole, SIZED_BATCH_SCALE, False
    yield "simlm", SimLMMethod, SimLMConfig(generator=generator_dir), 1, False


def free_bytes(device: str, pretend_gib: float = 0.0) -> int:
    return int(pretend_gib * 2**30) if pretend_gib else free_memory(device)


def matmul_ceiling(device: str, precision: str, packed: bool = False) -> float:
    """FLOP/s of a large matrix product on this device, in the job's precision. ``packed``:
    through oneDNN's packed linear (:mod:`models.packed_linears`, what CPU inference runs),
    where PyTorch's own product on a CPU goes through MKL."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    n = 8192 if device == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    product = lambda: a @ b  # noqa: E731
    if packed:
        layer = torch.nn.Linear(n, n, bias=False, device=device, dtype=dtype)
        pack_linears(layer)
        product = lambda: layer(a)  # noqa: E731
    with torch.inference_mode():
        for _ in range(3):
            product()
        if device == "cuda":
            torch.cuda.synchronize()
        start, repeats = time.perf_counter(), 20
        for _ in range(repeats):
            product()
        if device == "cuda":
            torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def profiled(step, batches: list, device: str) -> str:
    """Where a step's time goes: torch.profiler over ``batches`` (after the timed steps),
    how busy the device was, then the operators' and kernels' own device time, largest first."""
    start = time.perf_counter()
    with device_profile(device == "cuda") as session:
        for cpu_batch in batches:
            loss = step(cpu_batch)
        float(loss)
    busy = busy_line(session, time.perf_counter() - start, len(batches), device == "cuda")
    return f"{busy}\n" + time_table(session, device == "cuda")


VARIANTS = ("autocast", "held", "fp32", "blocks", "whole", "auto", "unpadded", "fullfirst")
PADDED_VOCAB = backbone.VOCAB_MULTIPLE["cuda"]  # before any variant sets it


def parse_variant(variant: str) -> dict:
    """``autocast`` (fp32 weights, bf16 autocast, as before), ``held`` (the module held in
    bf16, as DeepSpeed's bf16 runs it in the job) or ``fp32``, with ``+blocks`` or ``+whole`` for
    torch.compile of the transformer blocks or the whole module, with dynamic shapes, or with
    ``+auto`` torch's default: static until a shape changes (training's rows are of one
    width; the MLM loss's count of masked positions changes every step): e.g.
    ``held+whole+auto``. ``+unpadded``: the MLM projection on the vocabulary as it is, not
    padded to a multiple of 64 rows (``models.backbone.VOCAB_MULTIPLE``, 2026-11-27 late).
    ``+fullfirst``: coCondenser's gradient cache with its first pass through the whole model
    (head and MLM losses too), as before 2026-11-27 (late), not the backbone alone."""
    parts = variant.split("+")
    unknown = set(parts) - set(VARIANTS)
    if unknown or len({"autocast", "held", "fp32"} & set(parts)) != 1:
        raise SystemExit(
            f"--variants: {variant!r} is not autocast|held|fp32[+blocks|+whole][+auto][+unpadded][+fullfirst]"
        )
    compile_ = "blocks" if "blocks" in parts else "whole" if "whole" in parts else ""
    return {
        "autocast": "autocast" in parts,
        "full_first_pass": "fullfirst" in parts,
        "held": "held" in parts,
        "compile": compile_,
        "dynamic": None if "auto" in parts else True,
        "vocab_multiple": 1 if "unpadded" in parts else PADDED_VOCAB,
    }


def bench_one(
    name,
    cls,
    cfg,
    size: str,
    batch: int,
    length: int,
    steps: int,
    device: str,
    masking: MaskingVocab,
    sized: bool = False,
    free_gib: float = 0.0,
    profile: str = "",
    variant: str = "autocast",
):
    hidden, layers, heads, inter = SIZES[size]
    torch.manual_seed(0)
    mlm = build_mlm(
        BackboneConfig(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            intermediate_size=inter,
            max_position=512,
            dropout=0.1,
        ),
        masking.vocab_size,
    )
    method = cls(cfg, masking)
    how = parse_variant(variant)
    backbone.VOCAB_MULTIPLE["cuda"] = how["vocab_multiple"]  # each variant sets its own; CPUs keep theirs (none)
    model = method.build(mlm).to(device).train()
    if how["held"]:
        model.to(torch.bfloat16)
    if how["full_first_pass"]:  # the gradient cache's first pass as it was: the whole forward
        model.late_cls = lambda **batch: model(**batch, per_sequence=True).late_cls
    if how["compile"] == "blocks":
        for block in repeated_blocks(model):
            block.compile(dynamic=how["dynamic"])
    elif how["compile"] == "whole":
        model.compile(dynamic=how["dynamic"])
    engine = PlainEngine(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device == "cuda")
    rng = torch.Generator().manual_seed(0)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=how["autocast"])
    chunk = getattr(method, "chunk_size", None)
    if sized:
        with autocast:
            chunk = method.fit_chunk(model, free_bytes(device, free_gib), batch // 2)  # pairs

    def make_batch():
        ids, mask = batch_ids(batch, length, masking.vocab_size, rng)
        return method.corrupt_batch(ids, mask, rng)

    def step(cpu_batch):
        tensors = to_device(cpu_batch, device, non_blocking=True)
        with autocast:
            loss, _ = method.backward(engine, tensors)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    warm_start = time.perf_counter()
    for _ in range(3):
        step(make_batch())
    float(step(make_batch()))
    warm_s = time.perf_counter() - warm_start  # a compiled variant's compile time is in here
    with FlopCounterMode(display=False) as counter:
        step(make_batch())
    flops = counter.get_total_flops()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # The batches' masking runs on the CPU (in a run, on the worker while the device trains):
    # timed apart, so the device time and the MFU are the model's alone.
    start = time.perf_counter()
    batches = [make_batch() for _ in range(steps)]
    make_batch_s = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for cpu_batch in batches:
        loss = step(cpu_batch)
    float(loss)  # waits for the device
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    if profile:
        Path(profile).write_text(profiled(step, batches[:3], device))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "method": name,
        "variant": variant,
        "warm_s": round(warm_s, 1),
        "size": size,
        "batch": batch,
        "length": length,
        "params_m": round(trained / 1e6, 1),
        "chunk": chunk,
        "step_ms": round(seconds * 1e3, 2),
        "make_batch_ms": round(make_batch_s * 1e3, 2),
        "tokens_per_s": round(batch * length / seconds),
        "step_tflops": round(flops / 1e12, 3),
        "achieved_tflop_s": round(flops / seconds / 1e12, 1),
        "peak_gib": round(peak, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="bert-base,minilm")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="tiny model, batch 8, 2 steps (smoke run)")
    parser.add_argument(
        "--free_gib", type=float, default=0.0, help="size the cache's chunk for this much free memory (smoke runs)"
    )
    parser.add_argument(
        "--methods",
        default="",
        help="comma-separated rows to run (e.g. cocondenser,cocondenser-gradcache-sized); empty = all",
    )
    parser.add_argument(
        "--variants",
        default="autocast",
        help="comma-separated ways to run each row: autocast|held|fp32[+blocks|+whole][+auto][+unpadded][+fullfirst] (parse_variant)",
    )
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument(
        "--profile", default="", help="write each row's torch.profiler table (3 steps) to PREFIX-<size>-<method>.txt"
    )
    args = smoke.parse(parser, tiny=True, device="cpu")
    chosen = set(args.methods.split(",")) if args.methods else None
    if args.tiny:
        args.sizes, args.batch, args.length, args.steps = "tiny", 8, 32, 2
    torch.backends.cuda.matmul.allow_tf32 = True
    masking = vocab(30522 if not args.tiny else 200)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    datasheet = next((v for k, v in DATASHEET_BF16.items() if k in device_name), float("nan"))
    ceiling = matmul_ceiling(args.device, "bf16")
    print(
        f"device: {device_name}; bf16 matmul ceiling measured {ceiling / 1e12:.0f} TFLOP/s, "
        f"datasheet {datasheet / 1e12:.0f}",
        flush=True,
    )
    rows = []

    def save() -> None:  # after each row: a deadline keeps those done
        if args.json:
            summary = {"device": device_name, "matmul_tflop_s": ceiling / 1e12, "rows": rows}
            record.write(args.json, summary)

    with tempfile.TemporaryDirectory() as tmp:
        generator_dir = small_generator(masking.vocab_size, os.path.join(tmp, "generator"))
        for size in args.sizes.split(","):
            for name, cls, cfg, scale, sized in methods(generator_dir, args.batch, args.length):
                if chosen is not None and name not in chosen:
                    continue
                for variant in args.variants.split(","):
                    tag = name if variant == "autocast" else f"{name}-{variant.replace('+', '_')}"
                    try:
                        row = bench_one(
                            name,
                            cls,
                            cfg,
                            size,
                            args.batch * scale,
                            args.length,
                            args.steps,
                            args.device,
                            masking,
                            sized,
                            args.free_gib,
                            f"{args.profile}-{size}-{tag}.txt" if args.profile else "",
                            variant,
                        )
                    except Exception as exc:  # a variant that fails (a compile) leaves the others
                        if args.smoke:
                            raise
                        print(f"{size} {tag} failed: {type(exc).__name__}: {exc}"[:2000], flush=True)
                        continue
                    finally:
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                    row["mfu_datasheet"] = round(row["achieved_tflop_s"] * 1e12 / datasheet, 3)
                    row["mfu_measured_matmul"] = round(row["achieved_tflop_s"] * 1e12 / ceiling, 3)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save()
    print(
        "\n| size | method | variant | trained params (M) | device step (ms) | CPU masking (ms) | tokens/s | TFLOP/step "
        "| TFLOP/s | MFU (datasheet) | MFU (measured matmul) | peak GiB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size']} | {r['method']} | {r['variant']} | {r['params_m']} | {r['step_ms']} | {r['make_batch_ms']} | "
            f"{r['tokens_per_s']:,} | "
            f"{r['step_tflops']} | {r['achieved_tflop_s']} | {r['mfu_datasheet']} | {r['mfu_measured_matmul']} | "
            f"{r['peak_gib']} |"
        )
    save()


if __name__ == "__main__":
    main()
