"""What every job does around its work: connect to Ray, record its settings, report."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from dataclasses import dataclass, field

import ray
from ray._private import ray_constants

from pipeline.core import storage
from pipeline.core.config import dump_yaml
from pipeline.core.errors import ConfigError
from pipeline.core.progress import quiet_library_bars


@dataclass
class RayConfig:
    address: str = field(
        default="",
        metadata={"help": "Ray cluster to join; empty = RAY_ADDRESS if set (ray job submit sets it), else a local Ray"},
    )
    num_cpus: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "logical CPUs of a local Ray; 0 = max(4, cores), so Ray Data's readers never starve the trainers",
        },
    )
    single_node: bool = field(
        default=False,
        metadata={
            "help": "the cluster this job joins is one machine, so local paths are fine; otherwise a joined cluster may add nodes (autoscaling) and every output and model must be in object storage"
        },
    )


# Variables a local Ray must see before it starts, because its workers inherit them.
_PASSED_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_EC2_METADATA_DISABLED",
    *storage.S3_SETTINGS,
    "TORCH_EXTENSIONS_DIR",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    # the trackers' settings (pipeline/training/tracking.py). Their credentials (WANDB_API_KEY)
    # are never listed: a runtime environment's variables may be shown or logged by Ray, and
    # workers of a local Ray inherit them anyway; on a cluster they belong in the nodes' or
    # the job's environment.
    "WANDB_MODE",
    "WANDB_PROJECT",
    "WANDB_DIR",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
)


# Whether this process joined a Ray cluster it did not start, and may see it grow.
_joined = {"cluster": False}


def init_ray(cfg: RayConfig) -> None:
    quiet_library_bars()
    if ray.is_initialized():
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, log_to_driver=True)
        _joined["cluster"] = not cfg.single_node
        return
    num_cpus = cfg.num_cpus or max(4, os.cpu_count() or 1)
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    # Actors' "Loading weights" bars reach the driver as log lines, one per redraw.
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # Ray Train's placement-group cleaner asks the state API for its controller with no
    # address: where another Ray runs on the host, it finds several and prints a traceback
    # on every run. Its dashboard, on a port chosen here, is named to every worker.
    port = _free_port()
    env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    # "local": a Ray of the job's own, even where `ray start` left one running on this host
    # (ray.init() would join that one, then refuse num_cpus): joining is --ray.address's.
    ray.init(address="local", num_cpus=num_cpus, dashboard_port=port, runtime_env={"env_vars": env})


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cluster_nodes() -> int:
    """Alive nodes of the Ray cluster this process joined; 1 before Ray starts (a job then
    starts a local one)."""
    if not ray.is_initialized():
        return 1
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def placement_problem(bundle: dict[str, float], count: int) -> str:
    """Why ``count`` bundles of ``bundle`` (e.g. {"CPU": 4, "GPU": 1}) can never be placed on
    this cluster ("" when they can, or may once the autoscaler adds nodes). A cluster that
    autoscales is judged by its node types, a fixed one by its alive nodes: Ray itself would
    wait (and Ray Train retry) for ever for what no node can hold."""
    if not ray.is_initialized():
        return ""
    request = {k: v for k, v in bundle.items() if v > 0}
    node_types = _autoscaler_node_types()
    if node_types == {}:  # an autoscaler whose node types are not published: it decides
        return ""
    if node_types is not None:
        if any(all(offer.get(k, 0) >= v for k, v in request.items()) for offer in node_types.values()):
            return ""
        types = "; ".join(f"{name}: {_resources(offer)}" for name, offer in sorted(node_types.items()))
        return f"no node type of this autoscaling cluster holds {_resources(request)} (node types: {types})"
    offers = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    fits = sum(min(int(offer.get(k, 0) // v) for k, v in request.items()) if request else count for offer in offers)
    if fits >= count:
        return ""
    described = "; ".join(_resources(offer) for offer in offers) or "no alive node"
    return f"{count} x {_resources(request)} do not fit on this cluster's nodes ({described})"


def _autoscaler_node_types() -> dict[str, dict[str, float]] | None:
    """The node types of the autoscaler (their resources), or None on a fixed cluster; ``{}``
    when an autoscaler runs whose node types are not published (Ray's v1 autoscaler, the
    default of ``ray start --autoscaling-config`` and of KubeRay)."""
    try:
        config = ray._private.state.state.get_cluster_config()
    except Exception:  # noqa: BLE001 - an internal API; without it, judge by the alive nodes
        config = None
    if config is not None and config.node_group_configs:
        return {group.name: dict(group.resources) for group in config.node_group_configs if group.max_count != 0}
    return {} if _v1_autoscaler_runs() else None


def _v1_autoscaler_runs() -> bool:
    """Whether the v1 autoscaler's status names configured node types. Without an autoscaling
    config, Ray's monitor still reports, but with each node named after its id (``node_...``)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

        status = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS) if _internal_kv_initialized() else None
        mapping = json.loads(status)["autoscaler_report"]["node_type_mapping"] if status else {}
    except Exception:  # noqa: BLE001 - an internal report; without it, judge by the alive nodes
        return False
    return any(not str(name).startswith("node_") for name in (mapping or {}).values())


def _resources(resources: dict[str, float]) -> str:
    internal = ("node:", "accelerator_type:", "object_store_memory")
    shown = {k: v for k, v in sorted(resources.items()) if not k.startswith(internal)}
    return ", ".join(f"{k} {v / 2**30:.0f} GiB" if k == "memory" else f"{k} {v:g}" for k, v in shown.items())


def autoscales() -> bool:
    """Whether this cluster has an autoscaler that may add nodes."""
    return _autoscaler_node_types() is not None


def shared_nothing(nodes: int | None = None) -> str:
    """Why this job's nodes may share no disk ("" when they cannot): several are alive, or it
    joined a cluster that may add nodes later (autoscaling from only a head), unless the
    config says that cluster is one machine (``--ray.single_node``)."""
    nodes = cluster_nodes() if nodes is None else nodes
    if nodes > 1:
        return f"this Ray cluster has {nodes} nodes that share no disk"
    if _joined["cluster"]:
        return (
            "this job joined a Ray cluster, which may add nodes that share no disk (autoscaling); "
            "--ray.single_node true if it is one machine"
        )
    return ""


def check_outputs_shared(cfg, nodes: int | None = None) -> None:
    """On a cluster of several nodes, every ``output`` of a config (top level or one level
    down, e.g. ``train.output``, ``corpus.output``) must be object storage: a local folder
    written by one node is invisible to the others, and a later stage would read nothing."""
    why = shared_nothing(nodes)
    if not why:
        return
    sections = [("", cfg)] + [
        (f"{f.name}.", getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if dataclasses.is_dataclass(getattr(cfg, f.name))
    ]
    for prefix, section in sections:
        value = getattr(section, "output", "")
        if isinstance(value, str) and value and not storage.is_s3(value):
            raise ConfigError(
                f"--{prefix}output {value}: a local path, but {why}; use object storage (s3://bucket/prefix) "
                "so every node reads what another wrote"
            )


def write_run_files(cfg, output: str) -> None:
    """Save the resolved config (secrets redacted) next to the run's outputs."""

    storage.write_bytes(storage.join(output, "config.yaml"), dump_yaml(cfg).encode("utf-8"))


def print_summary(summary: dict) -> None:
    """The last line a job prints on stdout: one JSON object describing its outputs."""
    sys.stderr.flush()
    print(json.dumps(summary, default=str), flush=True)
