"""The cost table of cluster/guide/cost.md: one run of jobs/recipes/msmarco.yaml, stage by stage,
on on-demand and on spot nodes, with the arithmetic shown.

    python cluster/cost.py            # prints the Markdown that page carries

Steps, batch sizes, lengths and depths are read from the recipe itself; FLOPs per passage
come from cluster/sizing.py's forward count. Time = FLOPs / (GPUs x datasheet peak x MFU),
with the MFU measured on a lent H100/H200 (bench/README.md) applied to every GPU type: an
estimate, not a measurement of these instance types. Prices are assumptions (us-west-2 list
prices, USD per hour; look yours up with the commands in cluster/guide/cost.md) and so is the
spot discount. tests/cluster/test_cluster.py checks that the page's table is this script's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sizing import BERT_BASE, forward_flops  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "jobs" / "recipes" / "msmarco.yaml"
PASSAGES = 8_841_823
TRAIN_QUERIES = 502_939
DEV_QUERIES = 6_980

# bf16/fp16 dense datasheet peaks, TFLOP/s per GPU.
PEAK = {"A100": 312.0, "L4": 121.0}
# Measured on a lent H100/H200 (bench/README.md): the pre-training job at 0.203-0.221 of the
# datasheet; BERT-base encoding (fp16 held) at 23,695 passages/s of 31 tokens = 0.127.
TRAIN_MFU = 0.20
INFER_MFU = 0.127
# Assumed prices, USD per hour (on-demand list prices, us-west-2), and spot as a fraction of
# them, plus the work a spot run redoes (preemptions: steps since the notice, node starts).
ON_DEMAND = {"p4d.24xlarge": 21.96, "g6.4xlarge": 1.323, "m6i.8xlarge": 1.536, "m6i.2xlarge": 0.384}
SPOT_FRACTION = 0.40
SPOT_REDONE = 0.10
STARTUP_H = 10 / 60  # a node's boot, image pull and Ray start, per stage that brings it up
ALLOWANCE_CPU_H = 1.0  # corpus preparation and BM25 negatives on one cpu node: not measured
GPU8 = ("p4d.24xlarge", "A100", 8)
GPU1 = ("g6.4xlarge", "L4", 1)


def recipe():
    from pipeline.core.config import parse_config
    from pipeline.workflows.recipe import RecipeConfig

    return parse_config(RecipeConfig, ["--config", str(RECIPE)])


def stages(cfg) -> list[dict]:
    """Each stage's FLOPs and where they run, from the recipe's own settings."""
    fwd = lambda tokens: forward_flops(tokens, **BERT_BASE)  # noqa: E731
    data, pre = cfg.data, cfg.pretrain.job
    sequences = pre.train.max_steps * pre.train.micro_batch_size * pre.train.num_workers
    head = (pre.condenser.n_head_layers + BERT_BASE["layers"]) / BERT_BASE["layers"]
    retriever_query = data.query_max_len

    def retriever(stage, queries: int) -> tuple[float, str]:
        group = stage.retriever.group_size
        per_query = group * fwd(data.passage_max_len) + fwd(retriever_query)
        passes = 4 if stage.retriever.chunk_size else 3  # the gradient cache's extra forward
        total = queries * stage.train.epochs * per_query * passes
        return (
            total,
            f"{queries:,} q x {stage.train.epochs} ep x ({group} x {data.passage_max_len} + 1 x {retriever_query} tok) x {passes} fwd",
        )

    rows = [
        {
            "stage": "pretrain",
            "flops": sequences * 3 * fwd(pre.data.max_len) * head,
            "how": f"{pre.train.max_steps:,} steps x {pre.train.micro_batch_size * pre.train.num_workers:,} seq x "
            f"{pre.data.max_len} tok x 3 fwd, head x{head:.2f}",
            "on": GPU8,
            "mfu": TRAIN_MFU,
            "nodes": 1,
        }
    ]
    for name, stage in (("round1", cfg.round1), ("round2", cfg.round2)):
        flops, how = retriever(stage, TRAIN_QUERIES)
        rows.append({"stage": name, "flops": flops, "how": how, "on": GPU8, "mfu": TRAIN_MFU, "nodes": 1})
    rr = cfg.reranker
    rows.append(
        {
            "stage": "reranker",
            "flops": TRAIN_QUERIES * rr.train.epochs * rr.group_size * fwd(rr.max_len) * 3,
            "how": f"{TRAIN_QUERIES:,} q x {rr.train.epochs} ep x {rr.group_size} pairs x {rr.max_len} tok x 3 fwd",
            "on": GPU8,
            "mfu": TRAIN_MFU,
            "nodes": 1,
        }
    )
    teacher_queries = rr.teacher_queries or TRAIN_QUERIES
    scored = teacher_queries * rr.teacher_depth + DEV_QUERIES * rr.dev_depth
    rows.append(
        {
            "stage": "teacher, rerank",
            "flops": scored * fwd(rr.max_len),
            "how": f"({teacher_queries:,} q x {rr.teacher_depth} + {DEV_QUERIES:,} x {rr.dev_depth}) pairs x {rr.max_len} tok",
            "on": GPU1,
            "mfu": INFER_MFU,
            "nodes": rr.pool.actors,
        }
    )
    if cfg.distill.enabled:
        flops, how = retriever(cfg.distill, teacher_queries)
        rows.append({"stage": "distill", "flops": flops, "how": how, "on": GPU8, "mfu": TRAIN_MFU, "nodes": 1})
    encodings = 3 + int(cfg.distill.enabled)  # zeroshot, round1, round2, distill; mining reuses the indexes
    queries = 2 * TRAIN_QUERIES + encodings * DEV_QUERIES
    rows.append(
        {
            "stage": "encode",
            "flops": encodings * PASSAGES * fwd(data.passage_max_len) + queries * fwd(data.query_max_len),
            "how": f"{encodings} x {PASSAGES:,} passages x {data.passage_max_len} tok + {queries:,} queries",
            "on": GPU1,
            "mfu": INFER_MFU,
            "nodes": cfg.eval.pool.actors,
        }
    )
    return rows


def table() -> str:
    cfg = recipe()
    lines = [
        "| stage | work (from msmarco.yaml) | PFLOP | on | hours | node-hours | on-demand USD | spot USD |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    total_hours = on_demand = spot = 0.0
    for row in stages(cfg):
        instance, gpu, gpus = row["on"]
        rate = row["nodes"] * gpus * PEAK[gpu] * 1e12 * row["mfu"]
        hours = row["flops"] / rate / 3600
        node_hours = row["nodes"] * (hours + STARTUP_H)
        price = node_hours * ON_DEMAND[instance]
        total_hours += hours + STARTUP_H
        on_demand += price
        spot += price * SPOT_FRACTION * (1 + SPOT_REDONE)
        lines.append(
            f"| {row['stage']} | {row['how']} | {row['flops'] / 1e15:,.0f} | {row['nodes']} x {instance} "
            f"({gpu}, MFU {row['mfu']}) | {hours:.1f} | {node_hours:.1f} | {price:,.0f} "
            f"| {price * SPOT_FRACTION * (1 + SPOT_REDONE):,.0f} |"
        )
    cpu = ALLOWANCE_CPU_H * ON_DEMAND["m6i.8xlarge"]
    total_hours += ALLOWANCE_CPU_H
    head = total_hours * ON_DEMAND["m6i.2xlarge"]
    cpu_spot = cpu * SPOT_FRACTION * (1 + SPOT_REDONE)
    lines.append(
        f"| prepare, bm25 | allowance, not measured | | 1 x m6i.8xlarge | {ALLOWANCE_CPU_H:.1f} "
        f"| {ALLOWANCE_CPU_H:.1f} | {cpu:,.0f} | {cpu_spot:,.0f} |"
    )
    lines.append(
        f"| head (on-demand throughout) | the whole run | | 1 x m6i.2xlarge | {total_hours:.1f} "
        f"| {total_hours:.1f} | {head:,.0f} | {head:,.0f} |"
    )
    on_demand += cpu + head
    spot += cpu_spot + head
    lines.append(f"| **total** | | | | **{total_hours:.1f}** | | **{on_demand:,.0f}** | **{spot:,.0f}** |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
