"""Model FLOP utilisation of the real pre-training job: ``jobs/pretrain.py`` on Ray Train +
DeepSpeed, as a user runs it, with MFU from the job's own tokens/s.

    python bench/bench_pretrain_mfu.py --size bert-base --gpus 1      # one GPU, bf16 (issue 36: >= 40%)
    python bench/bench_pretrain_mfu.py --size bert-base --gpus 8      # every GPU of a machine
    python bench/bench_pretrain_mfu.py --size tiny --gpus 0 --steps 30 --precision fp32   # the CPU check

1. Runs ``jobs/pretrain.py`` in a subprocess on the bundled sample (prepared by the job; packed
   sequences of --max_len), ``--train.num_workers`` = GPUs (one per worker), ZeRO-2, no
   checkpoint before the end. The job's log entries (``history.json``) give its steady
   tokens/s per worker: log windows from step 10 on, as ``bench_pretrain.py`` reads them.
2. Counts the FLOPs of one micro-batch's step of the same method and model (the job's
   tokenizer, full-length rows) with ``torch.utils.flop_counter.FlopCounterMode``, in this
   process: FLOPs per token.
3. MFU = tokens/s per worker x FLOPs per token / the device's peak: the datasheet's dense
   bf16 rate on GPUs (H100 and H200 SXM: 989 TFLOP/s), and a matrix product measured here
   (bf16 on GPUs, fp32 on CPUs) as a second ceiling.

Methods: mlm, condenser, cocondenser (SimLM's generator would be trained first, and its
forward counted too: use bench_methods_gpu.py for it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench_methods_gpu import DATASHEET_BF16, SIZES, matmul_ceiling  # noqa: E402
from bench_pretrain import steady_state  # noqa: E402

from bench import record, smoke  # noqa: E402
from models.backbone import BackboneConfig, build_mlm  # noqa: E402
from models.batches import to_device  # noqa: E402
from models.masking import MaskingVocab  # noqa: E402
from models.method import PlainEngine  # noqa: E402
from pipeline.data.tokenizer import load_tokenizer  # noqa: E402
from pipeline.training.pretrain import METHODS, PretrainConfig  # noqa: E402

LOG_EVERY = 5
EXIT_GRACE_S = 30.0


def job_command(args, corpus: str, output: str) -> list[str]:
    hidden, layers, heads, inter = SIZES[args.size]
    settings = {
        "method": args.method,
        "corpus.output": corpus,
        "data.max_len": args.max_len,
        "model.hidden_size": hidden,
        "model.num_layers": layers,
        "model.num_heads": heads,
        "model.intermediate_size": inter,
        "model.max_position": 512,
        "model.dropout": 0.1,
        "train.output": output,
        "train.num_workers": max(1, args.gpus),
        "train.use_gpu": str(args.gpus > 0).lower(),
        "train.cpus_per_worker": args.cpus_per_worker,
        "train.precision": args.precision,
        "train.zero_stage": 2,
        "train.micro_batch_size": args.micro_batch,
        "train.grad_accum": args.grad_accum,
        "train.max_steps": args.steps,
        "train.log_every": LOG_EVERY,
        "train.checkpoint_every": args.steps + 1000,
        "train.max_failures": 0,
        "train.compile": str(args.compile).lower(),
        "train.profile_steps": 3 if args.profile else 0,
    }
    if args.gpus == 0:
        settings["ray.num_cpus"] = max(4, os.cpu_count() or 1)
    command = [sys.executable, str(REPO_ROOT / "jobs" / "pretrain.py")]
    for key, value in settings.items():
        command += [f"--{key}", str(value)]
    return command


def flops_per_token(args, tokenizer_dir: str, device: str) -> float:
    """FLOPs of one step (forward, backward) of the job's method and model on full-length
    rows, per input token. The optimiser's update is left out, as MFU conventions do."""
    hidden, layers, heads, inter = SIZES[args.size]
    tokenizer = load_tokenizer(tokenizer_dir)
    cfg = getattr(PretrainConfig(), args.method)
    if args.method == "cocondenser":
        cfg.head = ""
    method = METHODS[args.method](cfg, MaskingVocab.from_tokenizer(tokenizer))
    backbone = BackboneConfig(
        hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=inter, max_position=512
    )
    model = method.build(build_mlm(backbone, len(tokenizer))).to(device)
    rows, rng = 4, np.random.default_rng(0)
    ids = method.vocab.replacement_ids.numpy()
    if method.example_format == "span_pairs":
        width = cfg.span_length + 2
        arrays = {"input_ids": rng.choice(ids, (rows // 2, 2, width)), "length": np.full((rows // 2, 2), width)}
    else:
        width = args.max_len
        arrays = {"input_ids": rng.choice(ids, (rows, width)), "length": np.full(rows, width)}
    batch = method.make_batch(arrays, torch.Generator().manual_seed(0))
    batch = to_device(batch, device)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    with FlopCounterMode(display=False) as counter, autocast:
        method.backward(PlainEngine(model), batch)
    return counter.get_total_flops() / (rows * width)


class Deadline(Exception):
    """SIGTERM from the caller's time limit: report what the job has logged so far."""


def _on_sigterm(signum, frame):
    raise Deadline


def watch_job(job: subprocess.Popen, history_path: Path, steps: int) -> tuple[str, list[dict]]:
    """Watches the job's ``history.json`` (rewritten as it grows) until the job exits, or
    EXIT_GRACE_S after its last step is logged (Ray Train's final checkpoint, export and
    shutdown took over 20 s on the H200), or the caller's deadline. The figures come from the
    log entries, so a job slow to exit or cut short still gives them."""
    history, trained_at = [], None
    try:
        while True:
            time.sleep(1.0)
            if history_path.exists():
                try:
                    history = json.loads(history_path.read_text())
                except json.JSONDecodeError:  # caught mid-rewrite
                    pass
            if trained_at is None and history and history[-1]["step"] >= steps:
                trained_at = time.perf_counter()
            if job.poll() is not None:
                return f"exited {job.returncode}", history
            if trained_at is not None and time.perf_counter() - trained_at > EXIT_GRACE_S:
                return f"stopped {EXIT_GRACE_S:.0f} s after its last step", history
    except Deadline:
        # The caller's SIGKILL follows within seconds: no graceful stop, so that no Ray
        # process of the job outlives this one and holds the GPU for the next bench.
        os.killpg(job.pid, signal.SIGKILL)
        return "stopped by the caller's deadline", history


def stop(job: subprocess.Popen) -> str:
    """The job's stdout, once it and its process group are gone: SIGTERM first (the driver
    then shuts its Ray down), SIGKILL after 10 s."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGTERM)
    try:
        return job.communicate(timeout=10)[0] or ""
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        return job.communicate()[0] or ""
    finally:
        try:  # the Ray processes left in the group after the driver exited
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def versions() -> dict:
    """From the installed metadata: importing DeepSpeed here took seconds the deadline lacked."""
    found = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("transformers", "ray", "deepspeed"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "unknown"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="bert-base", choices=sorted(SIZES))
    parser.add_argument("--method", default="condenser", choices=["mlm", "condenser", "cocondenser"])
    parser.add_argument("--gpus", type=int, default=1, help="Ray Train workers, one GPU each; 0 = one CPU worker")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--micro_batch", type=int, default=128)
    parser.add_argument(
        "--grad_accum",
        type=int,
        default=1,
        help="rows per step = micro_batch x grad_accum; on GPUs the job splits them into the fewest micro-batches that fit (--train.size_micro_batch auto)",
    )
    parser.add_argument("--max_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cpus_per_worker", type=float, default=4)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="--train.compile: torch.compile the trained module (its compile falls before the steady window)",
    )
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--profile",
        default="",
        help="profile 3 of the job's steps after its warm-up (--train.profile_steps) and copy rank 0's table here",
    )
    args = smoke.parse(
        parser, size="tiny", gpus=0, steps=20, precision="fp32", micro_batch=8, max_len=64, cpus_per_worker=1
    )
    device = "cuda" if args.gpus > 0 else "cpu"
    if args.gpus == 0:
        torch.set_num_threads(max(1, int(args.cpus_per_worker)))
    with tempfile.TemporaryDirectory() as tmp:
        corpus, output = f"{tmp}/corpus", f"{tmp}/run"
        command = job_command(args, corpus, output)
        print("running:", " ".join(command), file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, _on_sigterm)
        started = time.perf_counter()
        # Its own process group, so that stopping it stops the Ray processes it started.
        job = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
        job_exit, history = watch_job(job, Path(output, "history.json"), args.steps)
        wall = time.perf_counter() - started
        print(f"job {job_exit} after {wall:.0f} s, {len(history)} log entries", file=sys.stderr, flush=True)
        if job_exit.startswith("exited") and job.returncode:
            raise SystemExit(f"jobs/pretrain.py {job_exit}")
        steady = steady_state(history)
        if args.json:  # the job's own figures first: a deadline may cut what follows
            record.write(args.json, {"job_exit": job_exit, "steady": steady})
        lines = stop(job).strip().splitlines()
        table = Path(output, "profile", "rank0.txt")
        if args.profile and table.exists():
            Path(args.profile).write_text(table.read_text())
        summary = json.loads(lines[-1]) if job.returncode == 0 and lines else {}
        per_token = flops_per_token(args, f"{corpus}/tokenizer", device)
    achieved = steady["tokens_per_s"] * per_token  # per worker: rank 0's log entries
    ceiling = matmul_ceiling(device, args.precision)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    datasheet = next((v for k, v in DATASHEET_BF16.items() if k in name), None) if args.precision == "bf16" else None
    result = {
        "device": name,
        "workers": max(1, args.gpus),
        "size": args.size,
        "method": args.method,
        "precision": args.precision,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "compiled": args.compile,
        "sized_micro_batch": [summary.get("micro_batch_size"), summary.get("grad_accum")],
        "max_len": args.max_len,
        "steps": args.steps,
        "versions": versions(),
        "job_wall_s": round(wall, 1),
        "job_exit": job_exit,
        "job_tokens_per_s": summary.get("tokens_per_s"),
        "steady_tokens_per_s_per_worker": round(steady["tokens_per_s"], 1),
        "steady_steps_per_s": round(steady["steps_per_s"], 3),
        "flops_per_token": per_token,
        "achieved_tflop_s_per_worker": round(achieved / 1e12, 3),
        "measured_matmul_tflop_s": round(ceiling / 1e12, 3),
        "mfu_measured_matmul": round(achieved / ceiling, 3),
        "mfu_datasheet": round(achieved / datasheet, 3) if datasheet else None,
        "input_wait_frac": [round(e.get("input_wait_frac", 0.0), 3) for e in history],
    }
    print(json.dumps(result), flush=True)
    if args.json:
        record.write(args.json, result)


if __name__ == "__main__":
    main()
