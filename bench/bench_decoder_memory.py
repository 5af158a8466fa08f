"""A decoder's memory per worker at ZeRO-2 and ZeRO-3: the planner against a measurement.

  planner   models/memory.py's model state (weights, gradients, AdamW's state, each
            partitioned from the stage that partitions it) of Llama-2-7B's LlamaModel, full
            fine-tuning and LoRA r=32 on its 7 projections, bf16: what --train.memory_gib is
            checked against before any work.
  measured  tiny Llamas of two depths, fully fine-tuned one step by 2 DeepSpeed workers
            (gloo, CPU, bf16) with the jobs' own ZeRO-2 and ZeRO-3 templates: every tensor
            alive on a rank after the step (unique storages, the batch freed), fitted as
            fixed + per_weight x weights. DeepSpeed's fixed buffers (ZeRO-3's prefetch and
            reduce buckets) dwarf a tiny model, so only the per-weight slope is scaled to
            the 7B model, its fixed part added once. LoRA is planned only: a tiny model's
            adapters are a far larger share of its weights than a 7B model's.

Usage: python bench/bench_decoder_memory.py [--hidden 512] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
from importlib import resources
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402
from models.biencoder import BiEncoder, BiEncoderConfig, contrastive_backward  # noqa: E402
from models.lora import LoraSettings, with_lora  # noqa: E402
from models.memory import model_state, parameter_counts  # noqa: E402
from pipeline.training.deepspeed_config import import_deepspeed, skip_inference_comm_op  # noqa: E402

LLAMA_2_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000
)
WORKERS_7B, WORKERS_MEASURED, GROUP, QUERIES = 8, 2, 4, 2
LORA = LoraSettings(rank=32, alpha=64)


def llama(lora: bool, **sizes):
    from transformers import AutoModel, LlamaConfig

    model = AutoModel.from_config(LlamaConfig(**sizes))
    return with_lora(model, LORA) if lora else model


def planned(params: int, trainable: int, stage: int, workers: int) -> float:
    return model_state(params, trainable, stage, workers, "bf16").total


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each storage once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _worker(rank: int, port: int, sizes: dict, lora: bool, stage: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(WORKERS_MEASURED), LOCAL_WORLD_SIZE=str(WORKERS_MEASURED))
    torch.set_num_threads(1)
    skip_inference_comm_op()
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    template = resources.files("pipeline.training").joinpath(f"zero_templates/zero{stage}.json").read_text()
    config = json.loads(template) | {
        "train_micro_batch_size_per_gpu": QUERIES,
        "gradient_accumulation_steps": 1,
        "train_batch_size": QUERIES * WORKERS_MEASURED,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
    }
    torch.manual_seed(0)
    model = BiEncoder(llama(lora, **sizes), None, BiEncoderConfig(pooling="last", group_size=GROUP))
    params, trainable = parameter_counts(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    del model, optimizer
    ids = torch.randint(3, sizes["vocab_size"], (QUERIES * (1 + GROUP), 32))
    batch = {
        "q_input_ids": ids[:QUERIES],
        "q_attention_mask": torch.ones_like(ids[:QUERIES]),
        "d_input_ids": ids[QUERIES:],
        "d_attention_mask": torch.ones_like(ids[QUERIES:]),
    }
    contrastive_backward(engine, batch, GROUP)
    engine.step()
    del batch, ids
    out[rank] = {"params": params, "trainable": trainable, "bytes": live_tensor_bytes()}
    torch.distributed.destroy_process_group()


def measure(sizes: dict, lora: bool, stage: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, sizes, lora, stage, out), nprocs=WORKERS_MEASURED, join=True)
    return dict(out[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hidden",
        type=int,
        default=512,
        help="the measured model's width (512: every weight matrix above ZeRO-3's persistence threshold of 100,000 elements, as a 7B model's are)",
    )
    parser.add_argument("--layers", type=int, default=4, help="the measured model's layers")
    parser.add_argument("--json", default="", help="write the figures to this results file")
    args = smoke.parse(parser, argv, hidden=64, layers=2)

    with torch.device("meta"):
        full_7b, lora_7b = parameter_counts(llama(False, **LLAMA_2_7B)), parameter_counts(llama(True, **LLAMA_2_7B))
    tiny = dict(
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.6875),  # Llama-2's 11008 / 4096
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        vocab_size=2000,
    )
    rows = []
    for stage in (2, 3):
        small, large = measure(tiny, False, stage), measure(tiny | {"num_hidden_layers": 2 * args.layers}, False, stage)
        per_weight = (large["bytes"] - small["bytes"]) / (large["params"] - small["params"])
        fixed = small["bytes"] - per_weight * small["params"]
        planned_per_weight = planned(1, 1, stage, WORKERS_MEASURED)
        rows.append(
            {
                "model": "full",
                "zero_stage": stage,
                "planner_7b_8_workers_gib": round(planned(*full_7b, stage, WORKERS_7B) / 2**30, 2),
                "planner_7b_2_workers_gib": round(planned(*full_7b, stage, WORKERS_MEASURED) / 2**30, 2),
                "measured_scaled_7b_2_workers_gib": round((fixed + per_weight * full_7b[0]) / 2**30, 2),
                "measured_bytes_per_weight": round(per_weight, 2),
                "planned_bytes_per_weight": planned_per_weight,
                "measured_fixed_mib": round(fixed / 2**20, 1),
                "measured_params": [small["params"], large["params"]],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    for stage in (2, 3):
        rows.append(
            {
                "model": "LoRA r=32",
                "zero_stage": stage,
                "planner_7b_8_workers_gib": round(planned(*lora_7b, stage, WORKERS_7B) / 2**30, 2),
                "planner_7b_2_workers_gib": round(planned(*lora_7b, stage, WORKERS_MEASURED) / 2**30, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    figures = {
        "model_7b": {"params": full_7b[0], "lora_trainable": lora_7b[1], "config": LLAMA_2_7B},
        "measured_model": tiny,
        "rows": rows,
    }
    if args.json:
        record.write(args.json, figures)


if __name__ == "__main__":
    main()
