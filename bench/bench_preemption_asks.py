"""What asking for a preemption notice costs (`--train.preemption_check_s`).

The ask (`ray.train.get_preemption_info`) is a collective through Ray Train's
synchronization actor: one actor call per worker per ask. Measured here, side by side in one
run, on a local Ray:

  latency    the ask alone, timed `--asks` times in a loop inside each of two Ray Train
             workers (median and 95th percentile, ms);
  training   the same pre-training run, two ZeRO-2 workers replaying cached batches (no
             ingest) of the bundled sample, asking after every step (an interval of
             1 ms), every second, then never: tokens/s ratio = asking / never asking
             (steady state, as bench_pretrain.py). Each ask also agrees on the step
             time (one all-reduce of a number), which is in these figures.

The model is small on purpose (a step of tens of ms), where the ask weighs most; a
BERT-base step on a GPU takes hundreds of ms.

Usage: python bench/bench_preemption_asks.py [--steps 300] [--asks 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench_pretrain import say, steady_state  # noqa: E402

from bench import record, smoke  # noqa: E402
from models.backbone import BackboneConfig  # noqa: E402
from pipeline.core import storage  # noqa: E402
from pipeline.core.sample import SAMPLE_CORPUS  # noqa: E402
from pipeline.data.prepare import PrepareConfig  # noqa: E402
from pipeline.training.pretrain import PretrainConfig, StreamConfig, run_pretraining  # noqa: E402
from pipeline.training.train_config import TrainConfig  # noqa: E402

MODEL = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position=64)


def ask_latency(asks: int) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    def worker(config: dict) -> dict:
        import numpy as np

        seconds = []
        for _ in range(config["asks"]):
            t0 = time.perf_counter()
            ray.train.get_preemption_info()
            seconds.append(time.perf_counter() - t0)
        ms = np.asarray(seconds) * 1000
        return {"median_ms": float(np.median(ms)), "p95_ms": float(np.percentile(ms, 95))}

    trainer = TorchTrainer(
        worker,
        train_loop_config={"asks": asks},
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(storage_path=tempfile.mkdtemp(prefix="asks-")),
    )
    metrics = trainer.fit().return_value  # rank 0's
    say(f"one ask: median {metrics['median_ms']:.2f} ms, p95 {metrics['p95_ms']:.2f} ms")
    return {"median_ms": metrics["median_ms"], "p95_ms": metrics["p95_ms"]}


def training(folder: str, steps: int, check_s: float) -> dict:
    cfg = PretrainConfig()
    cfg.corpus = PrepareConfig(input=str(REPO_ROOT / SAMPLE_CORPUS), output=f"{folder}/corpus", vocab_size=2000)
    cfg.data = StreamConfig(max_len=64, pack=True)
    cfg.model = BackboneConfig(**MODEL)
    output = f"{folder}/run-every-{check_s:g}s"
    cfg.train = TrainConfig(
        output=output,
        num_workers=2,
        zero_stage=2,
        micro_batch_size=16,
        max_steps=steps,
        log_every=10,
        checkpoint_every=steps + 1000,
        max_failures=0,
        preemption_check_s=check_s,
    )
    summary = run_pretraining(cfg, replay_batches=16)
    rates = steady_state(storage.read_json(storage.join(output, "history.json")), warmup_step=20)
    say(
        f"{f'asking every {check_s:g} s' if check_s else 'never asking'}: {rates['tokens_per_s']:.0f} tokens/s, "
        f"{1000 / rates['steps_per_s']:.1f} ms a step"
    )
    return {
        "tokens_per_s": rates["tokens_per_s"],
        "ms_per_step": 1000 / rates["steps_per_s"],
        "steps": summary["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--asks", type=int, default=300)
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, steps=30, asks=10)  # 30: two log entries past the warm-up

    import ray

    ray.init(num_cpus=4, include_dashboard=False)
    with tempfile.TemporaryDirectory(prefix="bench-asks-") as folder:
        latency = ask_latency(args.asks)
        asking = {every: training(folder, args.steps, check_s=every) for every in (0.001, 1.0)}
        never = training(folder, args.steps, check_s=0)
    ratios = {every: run["tokens_per_s"] / never["tokens_per_s"] for every, run in asking.items()}
    results = {
        "ask": latency,
        "asking": {f"every_{every:g}_s": run for every, run in asking.items()},
        "never_asking": never,
        "tokens_per_s_ratio": {f"every_{every:g}_s": ratio for every, ratio in ratios.items()},
    }
    print(
        f"one ask {latency['median_ms']:.2f} ms (p95 {latency['p95_ms']:.2f}); steps of "
        f"{never['ms_per_step']:.1f} ms: tokens/s asking / never asking = "
        + ", ".join(f"{ratio:.3f} every {every:g} s" for every, ratio in ratios.items())
    )
    if args.json:
        record.write(args.json, results)


if __name__ == "__main__":
    main()
