"""Pre-training throughput: ingest overhead and framework overhead, side by side in one run.

Three variants train the same Condenser on the same "small" BERT (hidden 256, 4 layers,
4 heads, intermediate 1024, max_len 128, micro-batch 32, packed sequences, fp32):

  plain   a single-process PyTorch loop in this process (AdamW, same param groups, lr
          schedule and grad clipping), on batches pre-built in memory before timing;
  replay  run_pretraining(replay_batches=32): one Ray Train + DeepSpeed worker (zero_stage=2, which one worker runs as stage 0) that
          caches the first 32 streamed batches (local corpus) and cycles them (no ingest);
  stream  run_pretraining(): the same worker streaming the corpus from S3 on loopback
          (a moto server started here).

Ratios (steady state, the first log windows before step 10 are discarded):

  ingest_overhead_ratio    = steps/s(stream) / steps/s(replay)      goal >= 0.98
  framework_overhead_ratio = tokens/s(replay) / tokens/s(plain)     goal >= 0.95
  end_to_end_ratio         = tokens/s(stream) / tokens/s(plain)     (reported, no goal)

Usage: python bench/bench_pretrain.py [--steps N] [--json out.json]
Set TORCH_EXTENSIONS_DIR (cached DeepSpeed op) and, for a local Ray 2.60, RAY_AUTH_MODE=disabled.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench import record, smoke  # noqa: E402
from pipeline.core.sample import SAMPLE_CORPUS
from pipeline.training.deepspeed_config import effective_zero_stage
from pipeline.training.train_config import TrainConfig

CORPUS = REPO_ROOT / SAMPLE_CORPUS
BUCKET = "bench"
S3_ENV = {  # fake credentials, for the loopback server only
    "AWS_ACCESS_KEY_ID": "bench-key-id",
    "AWS_SECRET_ACCESS_KEY": "bench-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

# The benchmark's fixed settings (both Ray runs and the plain loop use them).
MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024, max_position=128)
MAX_LEN = 128
MICRO_BATCH = 32
REPLAY_BATCHES = 32
ZERO_STAGE = effective_zero_stage(TrainConfig(zero_stage=2), world_size=1)  # what one worker runs
CPUS_PER_WORKER = 2  # Ray resources of the one worker, and its torch threads
RAY_CPUS = 4  # logical CPUs of the local Ray, so Ray Data's readers never starve
LOG_EVERY = 5
WARMUP_STEP = 10  # steady state starts at the first log entry with step >= this
DOCS_PER_SHARD = 1000  # 11 shards, so the stream reads several files as a real corpus would
INGEST_GOAL = 0.98
FRAMEWORK_GOAL = 0.95


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- measurement -------------------------------------------------------------------------


def steady_state(history: list[dict], warmup_step: int = WARMUP_STEP) -> dict:
    """Steady-state rates from log entries (step, elapsed_s, tokens_per_s).

    steps/s = (step_last - step_first_kept) / (elapsed_last - elapsed_first_kept), with the
    first kept entry the first one at step >= warmup_step. The tokens in that span are the
    sum over the later windows of tokens_per_s x window length (elapsed_i - elapsed_{i-1}).
    """
    entries = sorted(history, key=lambda e: e["step"])
    kept = [e for e in entries if e["step"] >= warmup_step]
    if len(kept) < 2:
        raise ValueError(
            f"need two log entries at step >= {warmup_step}, got steps {[e['step'] for e in entries]}: raise --steps"
        )
    first, last = kept[0], kept[-1]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    steps = last["step"] - first["step"]
    tokens, windows = 0.0, []
    for prev, cur in zip(kept, kept[1:]):
        dt = cur["elapsed_s"] - prev["elapsed_s"]
        tokens += cur["tokens_per_s"] * dt
        windows.append((cur["step"] - prev["step"]) / dt)
    return {
        "steps_per_s": steps / seconds,
        "tokens_per_s": tokens / seconds,
        "steps_timed": steps,
        "seconds_timed": seconds,
        "first_kept_step": first["step"],
        "last_step": last["step"],
        "window_steps_per_s": windows,
        "final_loss": last.get("loss"),
    }


# -- setup --------------------------------------------------------------------------------


def start_s3() -> tuple[object, str]:
    """A moto S3 server on loopback; its variables go into os.environ before Ray starts."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access-log line per S3 request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return server, endpoint


def pretrain_config(corpus_uri: str, output: str, steps: int):
    from models.backbone import BackboneConfig
    from pipeline.data.prepare import PrepareConfig
    from pipeline.training.pretrain import PretrainConfig, StreamConfig
    from pipeline.training.train_config import TrainConfig

    cfg = PretrainConfig()
    cfg.corpus = PrepareConfig(input="", output=corpus_uri)  # already prepared: load its manifest
    cfg.data = StreamConfig(max_len=MAX_LEN, pack=True)
    cfg.model = BackboneConfig(**MODEL)
    cfg.train = TrainConfig(
        output=output,
        num_workers=1,
        cpus_per_worker=CPUS_PER_WORKER,
        zero_stage=2,
        precision="fp32",
        micro_batch_size=MICRO_BATCH,
        max_steps=steps,
        log_every=LOG_EVERY,
        checkpoint_every=steps + 1000,
        max_failures=0,
    )
    return cfg


# -- the variants -------------------------------------------------------------------------


def run_ray(name: str, corpus_uri: str, output: str, steps: int, replay: int) -> dict:
    from pipeline.core import storage
    from pipeline.training.pretrain import run_pretraining

    say(f"{name}: run_pretraining(corpus={corpus_uri}, replay_batches={replay}, steps={steps})")
    t0 = time.perf_counter()
    summary = run_pretraining(pretrain_config(corpus_uri, output, steps), replay_batches=replay)
    wall = time.perf_counter() - t0
    if summary.get("steps") != steps:
        raise RuntimeError(f"{name}: trained {summary.get('steps')} steps, expected {steps}")
    history = storage.read_json(storage.join(output, "history.json"))
    result = steady_state(history)
    result.update(wall_s=wall, run_tokens_per_s=summary.get("tokens_per_s"), history=history)
    say(f"{name}: {result['steps_per_s']:.4f} steps/s, {result['tokens_per_s']:.1f} tokens/s (wall {wall:.1f} s)")
    return result


def plain_batches(corpus_dir: str, steps: int, seed: int) -> tuple[object, list[dict], list[int], float]:
    """The task (model built) and `steps` ready batches: the first REPLAY_BATCHES micro-batches
    of epoch 0, in the stream's file order, cycled like the replay worker's, each masked with
    the seed the worker would use at that micro-step."""
    import numpy as np
    import torch

    from models.backbone import BackboneConfig
    from models.condenser import CondenserConfig
    from pipeline.core import storage
    from pipeline.data.position import IntervalSet
    from pipeline.data.shards import load_manifest
    from pipeline.data.stream import StreamSpec, epoch_files, to_sequences
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.training.pretrain import PretrainTask
    from pipeline.training.worker import step_seed

    manifest = load_manifest(corpus_dir)
    tokenizer_dir = storage.join(corpus_dir, manifest["tokenizer"])
    tokenizer = load_tokenizer(tokenizer_dir)
    spec = StreamSpec(
        corpus=corpus_dir,
        max_len=MAX_LEN,
        pack=True,
        epochs=1,
        seed=seed,
        shuffle_files=True,
        cls_id=tokenizer.cls_token_id,
        sep_id=tokenizer.sep_token_id,
        pad_id=tokenizer.pad_token_id,
        run_dir="",
    )
    task = PretrainTask("condenser", CondenserConfig(), BackboneConfig(**MODEL), tokenizer_dir, manifest["vocab_size"])
    torch.manual_seed(seed)  # as the worker does before build_model
    model = task.build_model()

    parts = []
    for shard in epoch_files(manifest, spec, 0, IntervalSet()):
        table = storage.read_parquet(storage.join(corpus_dir, shard["path"]), ["row", "input_ids"])
        docs = np.empty(table.num_rows, dtype=object)
        docs[:] = [np.asarray(ids, dtype=np.int32) for ids in table.column("input_ids").to_pylist()]
        parts.append(to_sequences({"row": table.column("row").to_numpy(), "input_ids": docs}, spec, 0))
    seqs = {k: np.concatenate([p[k] for p in parts]) for k in ("input_ids", "length")}
    n = len(seqs["length"]) // MICRO_BATCH
    raw = [
        {k: v[i * MICRO_BATCH : (i + 1) * MICRO_BATCH] for k, v in seqs.items()} for i in range(min(n, REPLAY_BATCHES))
    ]
    batches, tokens = [], []
    t0 = time.perf_counter()
    for micro_step, numpy_batch in zip(range(steps), itertools.cycle(raw)):
        generator = torch.Generator().manual_seed(step_seed(seed, 0, micro_step))
        batches.append(task.make_batch(numpy_batch, generator))
        tokens.append(task.count_tokens(numpy_batch))
    make_batch_ms = (time.perf_counter() - t0) / steps * 1000
    return (task, model), batches, tokens, make_batch_ms


def ray_worker_niceness() -> int:
    """The niceness Ray's raylet gives its worker processes (Ray's default: 15)."""
    return int(os.environ.get("RAY_worker_niceness", "15"))


def renice_threads(value: int) -> dict[int, int]:
    """Set the niceness of every thread of this process (on Linux, niceness is per thread);
    returns the previous values. Threads started later inherit it from their creator."""
    previous = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            previous[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except (ProcessLookupError, PermissionError):
            pass
    return previous


def restore_niceness(previous: dict[int, int]) -> bool:
    ok = True
    for tid, value in previous.items():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:
            pass
        except PermissionError:  # lowering niceness needs privileges
            ok = False
    return ok


def run_plain(corpus_dir: str, steps: int, niceness: int | None) -> dict:
    """The same model and optimiser step, in this process, no Ray and no DeepSpeed.

    Ray starts its workers at niceness 15: under any other load on the machine the worker
    yields to normal-priority processes, so the plain loop runs at the same niceness
    (``niceness``; None = leave this process as it is) to see that load the same way.
    """
    import torch

    from models.method import PlainEngine
    from pipeline.training.engine import linear_schedule, param_groups
    from pipeline.training.train_config import TrainConfig

    train = TrainConfig(micro_batch_size=MICRO_BATCH, max_steps=steps)  # defaults = the Ray runs' lr etc.
    say(f"plain: building model and {steps} batches (threads={CPUS_PER_WORKER})")
    torch.set_num_threads(CPUS_PER_WORKER)
    (task, model), batches, tokens, make_batch_ms = plain_batches(corpus_dir, steps, train.seed)
    model.train()
    engine = PlainEngine(model)
    optimizer = torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr, eps=train.adam_eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(train.max_steps, train.warmup_ratio))

    history, window_loss, window_tokens = [], [], 0
    previous = renice_threads(niceness) if niceness is not None else {}
    niceness_used = os.getpriority(os.PRIO_PROCESS, 0)
    say(f"plain: timing (niceness {niceness_used})")
    t_start = time.perf_counter()
    window_start = t_start
    for step in range(1, steps + 1):
        batch = batches[step - 1]
        loss, _ = task.backward(engine, batch)  # the trainer's step, over a plain module
        if train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window_loss.append(loss)
        window_tokens += tokens[step - 1]
        if step % LOG_EVERY == 0 or step == steps:
            now = time.perf_counter()
            history.append(
                {
                    "step": step,
                    "loss": float(torch.stack(window_loss).mean()),
                    "tokens_per_s": window_tokens / (now - window_start),
                    "elapsed_s": now - t_start,
                }
            )
            window_loss, window_tokens, window_start = [], 0, time.perf_counter()
    wall = time.perf_counter() - t_start
    restored = restore_niceness(previous)
    if not restored:
        say(f"plain: could not restore this process' niceness (no privilege); it stays at {niceness_used}")
    result = steady_state(history)
    result.update(
        wall_s=wall,
        make_batch_ms=make_batch_ms,
        torch_threads=torch.get_num_threads(),
        niceness=niceness_used,
        niceness_restored=restored,
        parameters=sum(p.numel() for p in model.parameters()),
        history=history,
    )
    say(f"plain: {result['steps_per_s']:.4f} steps/s, {result['tokens_per_s']:.1f} tokens/s")
    return result


# -- report -------------------------------------------------------------------------------


def machine_info() -> dict:
    import deepspeed
    import ray
    import torch

    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "deepspeed": deepspeed.__version__,
        "torch_threads": CPUS_PER_WORKER,
        "ray_logical_cpus": RAY_CPUS,
        "ray_worker_niceness": ray_worker_niceness(),
        "loadavg_start": list(os.getloadavg()),
    }


def report(results: dict, ratios: dict, info: dict, settings: dict) -> str:
    lines = []
    lines.append("== raydense pre-training benchmark ==")
    lines.append(
        f"machine: {info['cpu']}; {info['cores']} cores ({info['cores_available']} available); "
        f"python {info['python']}, torch {info['torch']}, ray {info['ray']}, "
        f"deepspeed {info['deepspeed']}"
    )
    lines.append(
        f"threads: torch {info['torch_threads']} (plain loop: torch.get_num_threads()="
        f"{results['plain']['torch_threads']}; Ray worker: cpus_per_worker={CPUS_PER_WORKER}); "
        f"local Ray with {info['ray_logical_cpus']} logical CPUs"
    )
    lines.append(
        f"niceness: plain loop {results['plain']['niceness']}, Ray workers {info['ray_worker_niceness']} "
        "(Ray's worker_niceness; the same value makes both yield alike to other load)"
    )
    lines.append(
        "load average (1/5/15 min): start "
        + " ".join(f"{x:.2f}" for x in info["loadavg_start"])
        + ", end "
        + " ".join(f"{x:.2f}" for x in info["loadavg_end"])
    )
    lines.append(
        f"model: Condenser on BERT hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, "
        f"{MODEL['num_heads']} heads, intermediate {MODEL['intermediate_size']} "
        f"(+2 head layers), {settings['parameters']:,} parameters; vocab {settings['vocab_size']}; "
        f"max_len {MAX_LEN}, micro-batch {MICRO_BATCH}, packed, fp32, DeepSpeed ZeRO stage {ZERO_STAGE} "
        "(configured 2; one worker runs stage 0), 1 worker"
    )
    lines.append(
        f"corpus: {settings['corpus_docs']:,} docs, {settings['corpus_tokens']:,} tokens, "
        f"{settings['corpus_shards']} shards; steps {settings['steps']}, log every {LOG_EVERY}, "
        f"steady state from the first log entry at step >= {WARMUP_STEP}"
    )
    lines.append("")
    header = f"{'variant':<44} {'steps/s':>9} {'tokens/s':>10} {'window steps/s min..max':>24} {'wall s':>8}"
    lines.append(header)
    lines.append("-" * len(header))
    labels = {
        "plain": "plain PyTorch loop (in memory, 1 process)",
        "replay": "Ray Train + DeepSpeed, replay (in memory)",
        "stream": "Ray Train + DeepSpeed, streaming from S3",
    }
    for key in ("plain", "replay", "stream"):
        r = results[key]
        w = r["window_steps_per_s"]
        lines.append(
            f"{labels[key]:<44} {r['steps_per_s']:>9.4f} {r['tokens_per_s']:>10.1f} "
            f"{min(w):>11.4f}..{max(w):<11.4f} {r['wall_s']:>9.1f}"
        )
    lines.append("")
    lines.append(
        "(wall s: plain = its timed loop only; Ray runs = the whole run_pretraining call, "
        "worker start, warm-up, final checkpoint and export included)"
    )
    first = {k: results[k]["history"][0] for k in ("plain", "replay", "stream")}
    lines.append(
        "loss check, first window (steps 1-%d; same init, data and masks, so these should agree): %s"
        % (first["plain"]["step"], ", ".join(f"{k} {e['loss']:.4f}" for k, e in first.items()))
    )
    lines.append(
        "final-window loss: " + ", ".join(f"{k} {results[k]['final_loss']:.4f}" for k in ("plain", "replay", "stream"))
    )
    lines.append(
        f"plain loop: task.make_batch took {results['plain']['make_batch_ms']:.1f} ms/batch "
        f"(done before timing there; inside the step in the Ray worker)"
    )
    lines.append("")
    for key, goal in (("ingest_overhead_ratio", INGEST_GOAL), ("framework_overhead_ratio", FRAMEWORK_GOAL)):
        met = ratios[key] >= goal
        lines.append(f"{key} = {ratios[key]:.4f}   (goal >= {goal}: {'MET' if met else 'MISSED'})")
    lines.append(
        f"end_to_end_ratio = {ratios['end_to_end_ratio']:.4f}   (streaming tokens/s / plain-loop tokens/s; no goal)"
    )
    lines.append(f"total benchmark time: {settings['total_s']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimiser steps per variant (default 60)")
    parser.add_argument("--json", default="", help="also write every number to this JSON file")
    parser.add_argument(
        "--plain-niceness",
        type=int,
        default=None,
        help="niceness of the plain loop (default: Ray's worker niceness, RAY_worker_niceness or 15)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (for debugging)")
    args = smoke.parse(parser, argv, steps=WARMUP_STEP + LOG_EVERY)
    if args.smoke:  # the module's sizes, which every variant reads: a smaller model and batch
        global MICRO_BATCH
        MODEL.update(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
        MICRO_BATCH = 8
    if args.steps < WARMUP_STEP + LOG_EVERY:
        parser.error(f"--steps must be at least {WARMUP_STEP + LOG_EVERY} (warm-up plus one log window)")

    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="raydense-bench-")
    server = None
    import ray

    try:
        # 1. S3 on loopback, its variables set before Ray starts (the workers inherit them).
        server, endpoint = start_s3()
        say(f"moto S3 server at {endpoint}; temp folder {tmp}")
        from pipeline.core import storage
        from pipeline.core.runtime import RayConfig, init_ray
        from pipeline.data.prepare import PrepareConfig, prepare_corpus

        if ray.is_initialized():
            raise RuntimeError("Ray is already initialised in this process: the S3 variables would not reach it")
        init_ray(RayConfig(num_cpus=RAY_CPUS))
        info = machine_info()

        # 2. The corpus, prepared once locally and uploaded: both runs read identical shards.
        local_corpus = os.path.join(tmp, "corpus")
        say(f"preparing {CORPUS} -> {local_corpus}")
        manifest = prepare_corpus(
            PrepareConfig(input=str(CORPUS), output=local_corpus, docs_per_shard=DOCS_PER_SHARD)
        ).manifest
        s3_corpus = f"s3://{BUCKET}/corpus"
        storage.upload_dir(local_corpus, s3_corpus)
        say(f"uploaded to {s3_corpus}")

        # 3. The plain loop first, while Ray is up but idle (no trainer, no Ray Data work).
        niceness = args.plain_niceness if args.plain_niceness is not None else ray_worker_niceness()
        results = {"plain": run_plain(local_corpus, args.steps, niceness)}
        parameters = results["plain"]["parameters"]
        # 4. The two Ray Train + DeepSpeed runs, one after the other.
        results["replay"] = run_ray("replay", local_corpus, os.path.join(tmp, "run-replay"), args.steps, REPLAY_BATCHES)
        results["stream"] = run_ray("stream", s3_corpus, os.path.join(tmp, "run-stream"), args.steps, 0)
        info["loadavg_end"] = list(os.getloadavg())
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if server is not None:
            server.stop()
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    ratios = {
        "ingest_overhead_ratio": results["stream"]["steps_per_s"] / results["replay"]["steps_per_s"],
        "framework_overhead_ratio": results["replay"]["tokens_per_s"] / results["plain"]["tokens_per_s"],
        "end_to_end_ratio": results["stream"]["tokens_per_s"] / results["plain"]["tokens_per_s"],
    }
    settings = {
        "steps": args.steps,
        "log_every": LOG_EVERY,
        "warmup_step": WARMUP_STEP,
        "model": MODEL,
        "max_len": MAX_LEN,
        "micro_batch": MICRO_BATCH,
        "replay_batches": REPLAY_BATCHES,
        "cpus_per_worker": CPUS_PER_WORKER,
        "zero_stage": ZERO_STAGE,
        "precision": "fp32",
        "docs_per_shard": DOCS_PER_SHARD,
        "parameters": parameters,
        "vocab_size": manifest["vocab_size"],
        "corpus_docs": manifest["num_docs"],
        "corpus_tokens": manifest["num_tokens"],
        "corpus_shards": len(manifest["shards"]),
        "total_s": time.perf_counter() - started,
    }
    text = report(results, ratios, info, settings)
    print(text, flush=True)
    out = {
        "machine": info,
        "settings": settings,
        "results": results,
        "ratios": ratios,
        "goals": {"ingest_overhead_ratio": INGEST_GOAL, "framework_overhead_ratio": FRAMEWORK_GOAL},
        "goals_met": {
            "ingest_overhead_ratio": ratios["ingest_overhead_ratio"] >= INGEST_GOAL,
            "framework_overhead_ratio": ratios["framework_overhead_ratio"] >= FRAMEWORK_GOAL,
        },
    }
    if args.json:
        record.write(args.json, out)
    return out


if __name__ == "__main__":
    main()
