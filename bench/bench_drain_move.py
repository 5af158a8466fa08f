"""What a spot reclaim costs a running search, with the shard servers moved off the drained
node (the default) against left to Ray's restart, side by side in one run.

A local Ray cluster on this machine: a head with no CPUs (the driver's), a node that will
be reclaimed, and a fresh node that joins once the servers are up. BM25 over Nave's 37,457 verses in
two shard servers, both on the doomed node, searches Nave's 17,926 train and dev queries
in blocks. After ``--notice_after_s`` the doomed node is drained with a preemption deadline
of ``--deadline_s`` (what the autoscaler, KubeRay or cluster/spot_notice.py tell Ray on a
spot reclaim), and at the deadline it is removed, as the cloud takes the instance. Printed
per way: the longest wait between two answered blocks after the notice, the search's wall
time, the servers moved, and whether the results equal those of the other way.

The way "restarted" turns the move off (``ShardActors._move_off_draining`` only lets
replaced servers go): the servers answer until their node is gone, and Ray restarts them on
the fresh node once it has noticed the loss, re-sending the blocks that were in flight.

Usage: python bench/bench_drain_move.py [--deadline_s 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
NAVE = REPO_ROOT / "data" / "nave"
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import record, smoke  # noqa: E402


def queries() -> list[str]:
    from pipeline.data.beir import read_queries

    return [
        text for split in ("train", "dev") for text in read_queries(str(NAVE / f"queries.{split}.jsonl.gz")).values()
    ]


def drain(address: str, node_id: str, deadline_s: float) -> None:
    """What the autoscaler, KubeRay or cluster/spot_notice.py tell Ray on a spot reclaim."""
    subprocess.run(
        [
            *(sys.executable, "-m", "ray.scripts.scripts", "drain-node"),
            *("--address", address, "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION"),
            *("--reason-message", "spot reclaim (bench)", "--deadline-remaining-seconds", str(int(deadline_s))),
        ],
        check=True,
        capture_output=True,
    )


@contextlib.contextmanager
def move_switched_off():
    from pipeline.retrieval.fanout import ShardActors

    moving = ShardActors._move_off_draining
    ShardActors._move_off_draining = lambda self, in_flight: self._let_go()
    try:
        yield
    finally:
        ShardActors._move_off_draining = moving


def one_way(way: str, texts: list[str], staging: str, args) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from pipeline.data.text_shards import stage_text
    from pipeline.retrieval.bm25 import build_index

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    doomed = cluster.add_node(num_cpus=2)
    reclaimed = threading.Event()
    try:
        text = stage_text(str(NAVE / "corpus.jsonl.gz"), staging, 20_000)
        built = time.perf_counter()
        index = build_index(text, docs_per_shard=20_000)
        build_s = time.perf_counter() - built
        cluster.add_node(num_cpus=2)  # up before the notice, as an autoscaler's would be by the deadline
        found, answered_at, notice_at = [], [], None
        started = time.perf_counter()
        with index, move_switched_off() if way == "restarted" else contextlib.nullcontext():
            for _, _, rows, _ in index.search_blocks(texts, args.k, block=args.block, threads=1):
                found.append(rows)
                answered_at.append(time.perf_counter())
                if notice_at is None and answered_at[-1] - started >= args.notice_after_s:
                    drain(cluster.address, doomed.node_id, args.deadline_s)
                    notice_at = time.perf_counter()
                    threading.Timer(args.deadline_s, lambda: (cluster.remove_node(doomed), reclaimed.set())).start()
            search_s = time.perf_counter() - started
            moves = list(index.moves)
        after = [t for t in answered_at if t >= notice_at]
        gaps = np.diff([notice_at, *after])
        return {
            "way": way,
            "build_s": round(build_s, 2),
            "search_s": round(search_s, 2),
            "blocks": len(found),
            "notice_at_s": round(notice_at - started, 2),
            "reclaimed_before_the_end": reclaimed.is_set(),
            "longest_wait_after_notice_s": round(float(gaps.max()), 2),
            "moves": moves,
            "rows": np.concatenate(found),
        }
    finally:
        reclaimed.wait(args.deadline_s + 5)
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deadline_s", type=float, default=10.0, help="the notice's deadline: the node goes then")
    parser.add_argument("--notice_after_s", type=float, default=3.0, help="seconds of search before the notice")
    parser.add_argument("--block", type=int, default=128, help="queries per block")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way, alternating")
    parser.add_argument("--json", default="")
    args = smoke.parse(parser, repeats=1, deadline_s=4.0, notice_after_s=1.0)
    texts = queries()
    results = []
    for _ in range(args.repeats):
        for way in ("moved", "restarted"):
            with tempfile.TemporaryDirectory() as staging:
                results.append(one_way(way, texts, staging, args))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
    same = all(np.array_equal(r["rows"], results[0]["rows"]) for r in results)
    ways = {way: [r for r in results if r["way"] == way] for way in ("moved", "restarted")}
    print(
        f"\n{len(texts)} queries in blocks of {args.block}; node drained {args.deadline_s:g} s ahead, then removed\n"
        f"{'way':<10} {'longest wait (s)':>17} {'search (s)':>11} {'moves':>6}\n"
        + "\n".join(
            f"{r['way']:<10} {r['longest_wait_after_notice_s']:17.2f} {r['search_s']:11.2f} {len(r['moves']):6d}"
            for r in results
        )
    )
    waits = {way: float(np.mean([r["longest_wait_after_notice_s"] for r in runs])) for way, runs in ways.items()}
    print(
        f"longest wait after the notice, mean of {args.repeats}: restarted {waits['restarted']:.2f} s, "
        f"moved {waits['moved']:.2f} s ({waits['restarted'] / max(waits['moved'], 1e-9):.1f}x); "
        f"every run's results equal: {same}"
    )
    if args.json:
        summary = [{k: v for k, v in r.items() if k != "rows"} for r in results]
        record.write(args.json, {"runs": summary, "results_equal": same})


if __name__ == "__main__":
    main()
