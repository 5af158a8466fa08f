"""cluster/: the AWS autoscaler config, the KubeRay and Karpenter manifests, the values
renderer, the driver check, the spot watcher, the DeepSpeed templates, the run configs, the
sizing table and S3 settings from the environment.

Everything here is checked offline with the validators and schedulers of the installed
Ray, botocore and DeepSpeed, and with the KubeRay and Karpenter CRDs' own schemas
(tests/cluster/schemas/), so a config that those would reject on a real cluster fails here first.
A submitted job on a two-node cluster (and its credential scan) is in test_two_node.py.
"""

from __future__ import annotations

import copy
import glob
import gzip
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import yaml

from pipeline.core import storage

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
ZERO_TEMPLATES = (
    REPO / "pipeline" / "training" / "zero_templates"
)  # package data; the non-editable install is tested too
AWS_YAML = CLUSTER / "aws.yaml"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
KARPENTER = CLUSTER / "kuberay" / "karpenter.yaml"
SERVICE_ACCOUNT = CLUSTER / "kuberay" / "serviceaccount.yaml"
PRETRAIN_CONFIG = CLUSTER / "configs" / "pretrain-condenser-bert-base.yaml"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def docs(path: Path) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}


def image_tag() -> str:
    """The rayproject/ray tag that matches this environment, without CUDA: <ray>-py<major><minor>-cpu."""
    import ray

    return f"{ray.__version__}-py{sys.version_info.major}{sys.version_info.minor}-cpu"


def cluster_module(name: str):
    """A script of cluster/ (not a package), imported from its file."""
    spec = importlib.util.spec_from_file_location(name, CLUSTER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- AWS: Ray cluster launcher ------------------------------------------------------------


def test_aws_yaml_validates_against_rays_schema_and_config_checks():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(AWS_YAML)
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    # What `ray up` does before touching AWS: merge aws/defaults.yaml, then Ray's checks
    # (schema again, head type, sum of min_workers within max_workers, docker image).
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["docker"]["image"] == f"rayproject/ray:{image_tag()}"
    # pipeline/core/storage.py takes the region from the environment only.
    assert f"--env AWS_DEFAULT_REGION={config['provider']['region']}" in prepared["docker"]["run_options"]
    retry = storage.S3_SETTINGS["RAYDENSE_S3_RETRY_SECONDS"]
    assert f"--env RAYDENSE_S3_RETRY_SECONDS={retry}" in prepared["docker"]["run_options"]

    # The schema does catch mistakes: a misspelled node-type key is refused.
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu8-spot"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        jsonschema.validate(broken, schema)


def test_aws_node_configs_are_valid_ec2_run_instances_requests():
    """Ray passes node_config to EC2 RunInstances (plus counts, subnet and tags); botocore's
    own model of that call rejects unknown or mistyped fields and unknown instance types."""
    import botocore.session
    from botocore.validate import ParamValidator

    ec2 = botocore.session.get_session().get_service_model("ec2")
    run_instances = ec2.operation_model("RunInstances").input_shape
    instance_types = set(ec2.shape_for("InstanceType").enum)
    for name, node_type in load(AWS_YAML)["available_node_types"].items():
        request = dict(node_type["node_config"], MinCount=1, MaxCount=1, SubnetId="subnet-0")
        report = ParamValidator().validate(request, run_instances)
        assert not report.has_errors(), f"{name}: {report.generate_report()}"
        assert node_type["node_config"]["InstanceType"] in instance_types, name
        # S3 and EC2 through instance profiles, never keys in the config.
        assert set(node_type["node_config"]["IamInstanceProfile"]) == {"Name"}, name

    bad = dict(load(AWS_YAML)["available_node_types"]["gpu1-spot"]["node_config"], MinCount=1, MaxCount=1)
    bad["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOption": {}}
    assert ParamValidator().validate(bad, run_instances).has_errors()


def test_aws_node_types_scale_from_zero_with_on_demand_twins():
    config = load(AWS_YAML)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    assert "InstanceMarketOptions" not in head["node_config"], "a spot head loses every running job"
    workers = {n: t for n, t in types.items() if n != config["head_node_type"]}
    spot = {
        n for n, t in workers.items() if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    }
    assert {n for n in workers if n.endswith("-spot")} == spot and len(spot) == 3
    for name in spot:
        twin = workers[name.replace("-spot", "-ondemand")]
        s = workers[name]
        assert twin["node_config"]["InstanceType"] == s["node_config"]["InstanceType"]
        assert twin["resources"] == s["resources"]
        assert "InstanceMarketOptions" not in twin["node_config"]
        assert s["priority"] > twin["priority"]
    for name, t in workers.items():
        assert t["min_workers"] == 0 < t["max_workers"], name
    gpus = {t["node_config"]["InstanceType"]: t["resources"].get("GPU", 0) for t in workers.values()}
    assert gpus["p4d.24xlarge"] == 8 and gpus["g6.4xlarge"] == 1 and gpus["m6i.8xlarge"] == 0


def test_aws_head_runs_the_spot_fallback_scorer_from_the_mounted_checkout():
    config = load(AWS_YAML)
    start = " ".join(config["head_start_ray_commands"])
    assert "RAY_enable_autoscaler_v2=0" in start
    assert "RAY_AUTOSCALER_UTILIZATION_SCORER=spot_fallback.utilization_score" in start
    mount = next(remote for remote, local in config["file_mounts"].items() if local == ".")
    assert re.search(rf"PYTHONPATH={re.escape(mount)}/cluster\b", start)
    assert (CLUSTER / "spot_fallback.py").is_file()
    assert start.index("RAY_enable_autoscaler_v2=0") < start.index("ray start --head")
    # Dependencies with the gpu extra, every version as CI tested them.
    setup = " ".join(config["setup_commands"])
    assert f"{mount}[gpu]" in setup and f"-c {mount}/constraints.txt" in setup


@pytest.fixture
def v1_scheduler(monkeypatch):
    """Ray's v1 resource-demand scheduler as the head runs it: aws.yaml prepared by Ray,
    our scorer loaded through RAY_AUTOSCALER_UTILIZATION_SCORER, launch failures recorded
    by Ray's availability tracker."""
    from ray.autoscaler._private.node_provider_availability_tracker import (
        NodeProviderAvailabilityTracker,
    )
    from ray.autoscaler._private.resource_demand_scheduler import (
        ResourceDemandScheduler,
    )
    from ray.autoscaler._private.util import prepare_config
    from ray.autoscaler.node_launch_exception import NodeLaunchException

    config = prepare_config(load(AWS_YAML))
    monkeypatch.syspath_prepend(str(CLUSTER))
    monkeypatch.setenv("RAYDENSE_AUTOSCALING_CONFIG", str(AWS_YAML))

    def launch(demands, failed=(), seconds_ago=60, scorer="spot_fallback.utilization_score"):
        monkeypatch.setenv("RAY_AUTOSCALER_UTILIZATION_SCORER", scorer)
        scheduler = ResourceDemandScheduler(
            None,
            config["available_node_types"],
            config["max_workers"],
            config["head_node_type"],
            config["upscaling_speed"],
        )
        tracker = NodeProviderAvailabilityTracker()
        for node_type in failed:
            tracker.update_node_availability(
                node_type,
                int(time.time() - seconds_ago),
                NodeLaunchException("InsufficientInstanceCapacity", "There is no Spot capacity available", None),
            )
        to_launch, _ = scheduler.get_nodes_to_launch(
            [], {config["head_node_type"]: 1}, demands, {}, [], {}, False, tracker.summary()
        )
        return dict(to_launch)

    return launch


def test_aws_autoscaler_picks_spot_then_falls_back_to_on_demand(v1_scheduler):
    trainer = [{"GPU": 1, "CPU": 8}] * 8  # Ray Train, 8 workers of cpus_per_worker 8
    assert v1_scheduler(trainer) == {"gpu8-spot": 1}
    assert v1_scheduler(trainer * 2) == {"gpu8-spot": 2}
    assert v1_scheduler(trainer, failed=["gpu8-spot"]) == {"gpu8-ondemand": 1}
    # After the retry window spot is tried again.
    assert v1_scheduler(trainer, failed=["gpu8-spot"], seconds_ago=700) == {"gpu8-spot": 1}
    # Shape first: a 1-GPU encoder goes to the small GPU node, CPU work to the CPU node,
    # whatever failed elsewhere.
    assert v1_scheduler([{"GPU": 1, "CPU": 2}] * 2, failed=["gpu8-spot"]) == {"gpu1-spot": 2}
    assert v1_scheduler([{"CPU": 1}] * 8, failed=["gpu1-spot"]) == {"cpu-spot": 1}
    # Control: Ray's default scorer ignores the failure and asks for spot again.
    default = "ray.autoscaler._private.resource_demand_scheduler._default_utilization_scorer"
    assert v1_scheduler(trainer, failed=["gpu8-spot"], scorer=default) == {"gpu8-spot": 1}


# -- Kubernetes: KubeRay -----------------------------------------------------------------


def worker_groups(spec: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def containers(spec: dict) -> list[dict]:
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["containers"]]


def test_kuberay_raycluster_autoscales_gpu_groups():
    import ray

    rc = docs(RAYCLUSTER)["RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["version"] == "v2"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    images = {c["image"] for c in containers(spec)}
    assert len(images) == 1 and next(iter(images)).endswith(":" + image_tag().removesuffix("-cpu"))
    groups = worker_groups(spec)
    gpus = {}
    for name, group in groups.items():
        assert group["minReplicas"] == 0 < group["maxReplicas"], name
        pod = group["template"]["spec"]
        assert pod["serviceAccountName"] == "raydense", name
        (container,) = pod["containers"]
        res = container["resources"]
        assert res["requests"] == res["limits"], name  # Ray sizes the node from the limits
        # On SIGTERM (a reclaimed spot node drained) the pod's Ray node is marked preempted
        # with this deadline, inside EC2's 2 minutes and before Kubernetes kills the pod.
        drain_s = float({e["name"]: e.get("value") for e in container["env"]}["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        spot_notice = cluster_module("spot_notice")
        assert drain_s == spot_notice.NOTICE_S - spot_notice.DRAIN_MARGIN_S, name  # the watcher's arithmetic
        assert drain_s < pod["terminationGracePeriodSeconds"] <= spot_notice.NOTICE_S, name
        gpus[name] = int(res["limits"].get("nvidia.com/gpu", 0))
        if gpus[name]:
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert gpus == {
        "gpu8-spot": 8,
        "gpu8-ondemand": 8,
        "gpu1-spot": 1,
        "gpu1-ondemand": 1,
        "cpu-spot": 0,
        "cpu-ondemand": 0,
    }
    for name in ("gpu8", "gpu1", "cpu"):
        spot, ondemand = groups[f"{name}-spot"]["template"]["spec"], groups[f"{name}-ondemand"]["template"]["spec"]
        assert spot["nodeSelector"]["karpenter.sh/capacity-type"] == "spot"
        assert ondemand["nodeSelector"]["karpenter.sh/capacity-type"] == "on-demand"
        assert groups[f"{name}-spot"]["priority"] > groups[f"{name}-ondemand"]["priority"]
    env = {e["name"]: e["value"] for e in spec["autoscalerOptions"]["env"]}
    assert int(env["RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S"]) <= 900
    for c in containers(spec):  # pipeline/core/storage.py takes the region from the environment only
        assert {"name": "AWS_DEFAULT_REGION", "value": "us-west-2"} in c["env"], c["name"]


def test_kuberay_autoscaler_reads_the_cluster_and_falls_back_to_on_demand():
    """The RayCluster through Ray's own KubeRay converter (which validates the result) and
    Ray's v2 scheduler, as the autoscaler sidecar runs them."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig
    from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, SchedulingRequest
    from ray.autoscaler.v2.utils import ResourceRequestUtil

    cr = docs(RAYCLUSTER)["RayCluster"]
    cr["metadata"]["namespace"] = "default"
    derived = _derive_autoscaling_config_from_ray_cr(cr)
    types = derived["available_node_types"]
    assert types["gpu8-spot"]["resources"]["GPU"] == 8 and types["gpu1-ondemand"]["resources"]["GPU"] == 1
    assert types["headgroup"]["resources"]["CPU"] == 0
    config = AutoscalingConfig(derived, skip_content_hash=True)

    def launch(demands, unavailable=()):
        request = SchedulingRequest(
            disable_launch_config_check=True,
            node_type_configs=config.get_node_type_configs(),
            max_num_nodes=config.get_max_num_nodes(),
            resource_requests=ResourceRequestUtil.group_by_count([ResourceRequestUtil.make(d) for d in demands]),
            # What a spot pod stuck Pending past the allocation timeout leaves behind.
            recoverable_resource_availabilities={t: 0.0 for t in unavailable},
            cloud_resource_availabilities={t: 0.0 for t in unavailable},
        )
        reply = ResourceDemandScheduler(None).schedule(request)
        return {r.instance_type: r.count for r in reply.to_launch}

    trainer = [{"GPU": 1, "CPU": 8}] * 8
    assert launch(trainer) == {"gpu8-spot": 1}
    assert launch(trainer, unavailable=["gpu8-spot"]) == {"gpu8-ondemand": 1}
    assert launch([{"GPU": 1, "CPU": 2}]) == {"gpu1-spot": 1}
    assert launch([{"CPU": 1}] * 4) == {"cpu-spot": 1}


def test_kuberay_rayjobs_run_each_job_with_its_config_from_a_configmap(rendered, tmp_path):
    from pipeline.core.config import parse_config
    from pipeline.training.pretrain import PretrainConfig
    from pipeline.workflows.recipe import RecipeConfig

    files, values = rendered
    cluster = docs_of(files["kuberay/raycluster.yaml"])["RayCluster"]
    for name, config_class in (("recipe", RecipeConfig), ("pretrain", PretrainConfig)):
        job_docs = docs_of(files[f"kuberay/rayjob-{name}.yaml"])
        job, config_map = job_docs["RayJob"], job_docs["ConfigMap"]
        assert job["apiVersion"] == "ray.io/v1"
        assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["backoffLimit"] >= 1
        # The job's cluster is the standing cluster's, but for GCS fault tolerance (a retry is a
        # new cluster), the run config mounted on the head, and the dashboard's reach (the
        # operator's, on every interface; no load balancer: tests/cluster/test_access.py).
        spec = copy.deepcopy(job["spec"]["rayClusterSpec"])
        head = spec["headGroupSpec"]["template"]["spec"]
        entrypoint = job["spec"]["entrypoint"].split()
        assert entrypoint[:2] == ["python", f"/home/ray/raydense/{values['jobs'][name]['script']}"]
        config_path = entrypoint[entrypoint.index("--config") + 1]
        (mount,) = [m for m in head["containers"][0]["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == config_map["metadata"]["name"]
        head["containers"][0]["volumeMounts"].remove(mount)
        head["volumes"].remove(volume)
        expected = copy.deepcopy(cluster["spec"])
        assert expected.pop("gcsFaultToleranceOptions")["redisAddress"] == values["gcs_redis"]
        assert expected["headGroupSpec"].pop("headService")["spec"]["type"] == "LoadBalancer"
        assert spec["headGroupSpec"]["rayStartParams"].pop("dashboard-host") == "0.0.0.0"
        expected["headGroupSpec"]["rayStartParams"].pop("dashboard-host")
        assert spec == expected
        # The ConfigMap carries the run config with the user's bucket, and it parses.
        text = config_map["data"][config_path[len(mount["mountPath"]) + 1 :]]
        assert text == files[f"configs/{name}.yaml"]
        source = (REPO / values["jobs"][name]["config"]).read_text()
        # Searchers on the GPU of the gpu1 nodes (g6e: L40S), sized by its memory.
        assert text == source.replace("your-bucket", values["bucket"]).replace(
            "accelerator_type: L4", "accelerator_type: L40S"
        )
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(text)
        cfg = parse_config(config_class, ["--config", str(config_file)])
        uris = re.findall(r"s3://[^\s'\"]+", repr(cfg))
        assert uris and all(u.startswith(f"s3://{values['bucket']}/") for u in uris), uris  # pods share no disk


def test_kuberay_s3_access_comes_from_the_service_account():
    sa = docs(SERVICE_ACCOUNT)["ServiceAccount"]
    assert sa["metadata"]["name"] == "raydense"
    assert re.fullmatch(
        r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    )
    for path in (RAYCLUSTER,):
        for kind, doc in docs(path).items():
            if kind in ("RayCluster", "RayJob"):
                spec = doc["spec"].get("rayClusterSpec", doc["spec"])
                for c in containers(spec):
                    names = {e["name"] for e in c.get("env", [])}
                    assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}


def test_no_credentials_anywhere_in_cluster():
    key_id = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b")
    assignments = re.compile(r"(aws_secret_access_key|aws_session_token|secretAccessKey)\s*[:=]", re.I)
    files = [p for p in CLUSTER.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) >= 10
    for path in files:
        text = path.read_text()
        assert not key_id.search(text), path
        assert not assignments.search(text), path


# -- one place for what is yours: cluster/values.yaml and cluster/render.py ---------------

# Values unlike the examples in every field, so that a place render.py misses shows up as an
# example value left behind.
TEST_VALUES = {
    "bucket": "acme-retrieval",
    "region": "eu-central-1",
    "zone": "eu-central-1b",
    "account_id": "210987654321",
    "image": "registry.acme.example/ml/raydense:t1",
    "eks_cluster": "acme-ml",
    "karpenter_node_role": "KarpenterNodeRole-acme-ml",
    "s3_role": "acme-raydense-s3",
    "gcs_redis": "redis.acme.internal:6379",
    "ami": "ami-0fedcba9876543210",
    "head_profile": "acme-head",
    "worker_profile": "acme-worker",
    "subnet_id": "subnet-0abc1234",
    "security_group_id": "sg-0abc1234",
    "ssh_cidr": "198.51.100.7/32",
    "input_prefixes": ["data/", "models/"],
    "run_prefixes": ["raydense/"],
    "kms_key_arn": "arn:aws:kms:eu-central-1:210987654321:key/0a1b2c3d-4e5f-6789-abcd-ef0123456789",
    "ray_auth": True,
    "ray_token_secret": "acme-ray-token",
    "checkpoint_key_secret": "acme-checkpoint-key",
    "dashboard": "internal-lb",
    "client_cidrs": ["10.20.0.0/16"],
    "ray_client": False,
    "operator_namespace": "ray-system",
    "node_types": {
        "head": {"instance_type": "m7i.4xlarge", "vcpus": 16, "memory_gib": 64, "gpus": 0, "scratch_gib": 40},
        "cpu": {"instance_type": "c7i.16xlarge", "vcpus": 64, "memory_gib": 128, "gpus": 0, "scratch_gib": 300},
        "gpu1": {"instance_type": "g6e.4xlarge", "vcpus": 16, "memory_gib": 128, "gpus": 1, "scratch_gib": 400},
        "gpu8": {
            "instance_type": "p5.48xlarge",
            "vcpus": 192,
            "memory_gib": 2048,
            "gpus": 8,
            "scratch_gib": 1000,
            "max_spot": 2,
            "max_ondemand": 6,
            "efa_interfaces": 32,
        },
    },
    "efa": True,
    "spot_notice_s": 30,  # GKE's notice
    "drain_margin_s": 10,
    "jobs": {
        "recipe": {"script": "jobs/recipe.py", "config": "jobs/recipes/msmarco.yaml"},
        "pretrain": {"script": "jobs/pretrain.py", "config": "cluster/configs/pretrain-condenser-bert-base.yaml"},
    },
}
EXAMPLE_VALUES = yaml.safe_load((CLUSTER / "values.yaml").read_text())


def docs_of(text: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(text) if d}


@pytest.fixture(scope="module")
def rendered():
    return cluster_module("render").render(copy.deepcopy(TEST_VALUES)), TEST_VALUES


def crd_validator(name: str, api_version: str):
    """The CRD's openAPIV3Schema as a JSON-schema validator that, like `kubectl apply`'s
    strict field validation, refuses fields the schema does not declare."""
    import jsonschema

    crd = yaml.safe_load(gzip.decompress((Path(__file__).parent / "schemas" / f"{name}.yaml.gz").read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if f"{crd['spec']['group']}/{v['name']}" == api_version]
    schema = version["schema"]["openAPIV3Schema"]

    def strict(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: the API server checks it, not the CRD
    return jsonschema.Draft7Validator(schema)


CRDS = {
    "RayCluster": "ray.io_rayclusters",
    "RayJob": "ray.io_rayjobs",
    "NodePool": "karpenter.sh_nodepools",
    "EC2NodeClass": "karpenter.k8s.aws_ec2nodeclasses",
}


def test_the_shipped_files_are_the_example_values_rendered():
    """render.py with cluster/values.yaml changes nothing: the files under cluster/ are what a
    user's values are applied to, and each value has exactly the places render.py sets."""
    files = cluster_module("render").render(copy.deepcopy(EXAMPLE_VALUES))
    for relative in ("aws.yaml", "kuberay/raycluster.yaml", "kuberay/karpenter.yaml", "kuberay/networkpolicy.yaml"):
        shipped = [d for d in yaml.safe_load_all((CLUSTER / relative).read_text()) if d]
        assert list(yaml.safe_load_all(files[relative])) == shipped, relative
    for relative in ("iam/s3-policy.json", "iam/head-policy.json"):
        assert json.loads(files[relative]) == json.loads((CLUSTER / relative).read_text()), relative


def test_rendered_kit_carries_every_value_and_no_example(rendered):
    files, values = rendered
    examples = {
        "bucket": "your-bucket",
        "account": "123456789012",
        "region": "us-west-2",
        "image": "dkr.ecr",
        "gpu8 type": "p4d.24xlarge",
        "gpu1 type": "g6.4xlarge",
        "cpu type": "m6i.8xlarge",
        "head type": "m6i.2xlarge",
        "karpenter role": "KarpenterNodeRole-raydense",
        "discovery tag": "discovery: raydense",
        "s3 role": "role/raydense-s3",
        "worker profile": "raydense-worker",
        "head profile": "raydense-head",
        "ami": "ami-0123456789abcdef0",
        "security group": "sg-0123456789abcdef0",
        "ssh cidr": "203.0.113.0/24",
        "ray token secret": "raydense-ray-token",
        "checkpoint key secret": "raydense-checkpoint-key",
        "operator namespace": "kuberay-operator",
    }
    for relative, text in files.items():
        for what, example in examples.items():
            assert example not in text, f"{relative} still holds the example {what} ({example})"
    recipe = files["configs/recipe.yaml"]
    assert recipe.count(f"s3://{values['bucket']}/") == 8  # every input and output of msmarco.yaml
    assert (
        f"arn:aws:s3:::{values['bucket']}/raydense/*" in files["iam/s3-policy.json"]
    )  # what it allows: test_access.py
    head_policy = files["iam/head-policy.json"]
    assert f"arn:aws:iam::{values['account_id']}:role/{values['worker_profile']}" in head_policy
    account = docs_of(files["kuberay/serviceaccount.yaml"])["ServiceAccount"]
    role = f"arn:aws:iam::{values['account_id']}:role/{values['s3_role']}"
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == role


def test_rendered_kuberay_and_karpenter_manifests_validate_against_their_crds(rendered):
    import jsonschema

    files, _ = rendered
    checked = []
    for relative in ("kuberay/raycluster.yaml", "kuberay/rayjob-recipe.yaml", "kuberay/karpenter.yaml"):
        for doc in yaml.safe_load_all(files[relative]):
            if doc["kind"] in CRDS:
                crd_validator(CRDS[doc["kind"]], doc["apiVersion"]).validate(doc)
                checked.append(doc["kind"])
    assert sorted(checked) == ["EC2NodeClass", "NodePool", "NodePool", "RayCluster", "RayJob"]
    # The schemas do catch mistakes: a misspelled pod field, a misspelled Karpenter field.
    cluster = docs_of(files["kuberay/raycluster.yaml"])["RayCluster"]
    cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelectr"] = {}
    with pytest.raises(jsonschema.ValidationError, match="nodeSelectr"):
        crd_validator("ray.io_rayclusters", "ray.io/v1").validate(cluster)
    node_class = docs_of(files["kuberay/karpenter.yaml"])["EC2NodeClass"]
    node_class["spec"]["instanceStorePolicy"] = "RAID5"
    with pytest.raises(jsonschema.ValidationError, match="RAID5"):
        crd_validator("karpenter.k8s.aws_ec2nodeclasses", "karpenter.k8s.aws/v1").validate(node_class)


def test_rendered_pods_have_disk_a_driver_check_one_zone_and_do_not_disrupt(rendered):
    files, values = rendered
    spec = docs_of(files["kuberay/raycluster.yaml"])["RayCluster"]["spec"]
    groups = {"head": spec["headGroupSpec"]} | worker_groups(spec)
    for name, group in groups.items():
        kind = name.rsplit("-", 1)[0]
        node = values["node_types"][kind]
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == values["image"]
        # Local disk: requested, and where Ray's temp and spill files, the model cache and
        # temporary outputs go.
        asked = container["resources"]["requests"]
        assert asked["ephemeral-storage"] == f"{node['scratch_gib'] + 10}Gi", name
        (scratch,) = [v for v in pod["volumes"] if v["name"] == "scratch"]
        assert scratch["emptyDir"]["sizeLimit"] == f"{node['scratch_gib']}Gi"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp/ray"] == mounts["/mnt/scratch"] == "scratch"
        env = {e["name"]: e.get("value") for e in container["env"]}
        for variable in ("RAYDENSE_CACHE", "HF_HOME", "TMPDIR"):
            assert env[variable].startswith("/mnt/scratch/"), (name, variable)
        assert env["AWS_DEFAULT_REGION"] == values["region"]
        # The storage retry budget reaches every pod's processes, at the library's defaults.
        for variable in ("RAYDENSE_S3_RETRY_SECONDS", "RAYDENSE_S3_MAX_ATTEMPTS"):
            assert env[variable] == storage.S3_SETTINGS[variable], (name, variable)
        assert pod["nodeSelector"]["topology.kubernetes.io/zone"] == values["zone"]
        assert group["template"]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        # The drain keeps the margin of the notice; Kubernetes waits for it, inside the notice.
        drain = int(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        assert drain == values["spot_notice_s"] - values["drain_margin_s"]
        if name != "head":
            assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == node["instance_type"]
            assert drain < pod["terminationGracePeriodSeconds"] <= drain + 30
            assert group["maxReplicas"] == node.get(f"max_{name.rsplit('-', 1)[1]}", group["maxReplicas"])
        # GPU pods: the driver check first, on the same GPUs.
        if node["gpus"]:
            (check,) = pod["initContainers"]
            assert check["image"] == values["image"] and check["command"][-1].endswith("cluster/check_driver.py")
            assert check["resources"]["limits"]["nvidia.com/gpu"] == str(node["gpus"])
            assert asked["nvidia.com/gpu"] == str(node["gpus"])
        else:
            assert "initContainers" not in pod, name
        efa = kind == "gpu8"
        assert ("vpc.amazonaws.com/efa" in asked) == efa, name
        assert (env.get("FI_PROVIDER") == "efa") == efa, name
    for pool in yaml.safe_load_all(files["kuberay/karpenter.yaml"]):
        if pool["kind"] == "NodePool":
            requirements = {r["key"]: r["values"] for r in pool["spec"]["template"]["spec"]["requirements"]}
            assert requirements["topology.kubernetes.io/zone"] == [values["zone"]]
            assert pool["spec"]["template"]["spec"]["expireAfter"] == "Never"


def test_rendered_raycluster_through_rays_kuberay_converter(rendered):
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    files, _ = rendered
    cr = docs_of(files["kuberay/raycluster.yaml"])["RayCluster"]
    cr["metadata"]["namespace"] = "default"
    types = _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]
    assert types["gpu8-spot"]["resources"]["GPU"] == 8 and types["gpu8-spot"]["resources"]["CPU"] == 180
    assert types["gpu8-spot"]["max_workers"] == 2 and types["gpu8-ondemand"]["max_workers"] == 6
    assert types["cpu-spot"]["resources"]["CPU"] == 60


def test_rendered_aws_yaml_with_efa_is_valid_for_ray_and_ec2(rendered):
    import botocore.session
    import jsonschema
    import ray.autoscaler
    from botocore.validate import ParamValidator
    from ray.autoscaler._private.util import prepare_config, validate_config

    files, values = rendered
    config = yaml.safe_load(files["aws.yaml"])
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(copy.deepcopy(config)))
    assert config["provider"]["availability_zone"] == values["zone"]
    run_instances = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    for name, node_type in config["available_node_types"].items():
        request = dict(node_type["node_config"], MinCount=1, MaxCount=1)
        if "NetworkInterfaces" not in request:
            request["SubnetId"] = values["subnet_id"]
        report = ParamValidator().validate(request, run_instances)
        assert not report.has_errors(), f"{name}: {report.generate_report()}"
    gpu8 = config["available_node_types"]["gpu8-spot"]
    interfaces = gpu8["node_config"]["NetworkInterfaces"]
    assert len(interfaces) == 32 and {i["InterfaceType"] for i in interfaces} == {"efa"}
    assert gpu8["node_config"]["Placement"]["GroupName"] and gpu8["resources"] == {"CPU": 192, "GPU": 8}
    assert "--env FI_PROVIDER=efa" in config["docker"]["run_options"]
    watcher = next(c for c in config["worker_start_ray_commands"] if "spot_notice.py" in c)
    assert f"--margin_s={values['drain_margin_s']}" in watcher


@pytest.mark.parametrize(
    "change, message",
    [
        ({"zone": "us-east-1a"}, "zone us-east-1a is not in region eu-central-1"),
        ({"bucket": "Acme_Bucket"}, "bucket is 'Acme_Bucket', not an S3 bucket name"),
        ({"account_id": "2109"}, "account_id is '2109', not a 12-digit AWS account id"),
        ({"subnet_id": ""}, "subnet_id is '', not a subnet id (efa: true needs it)"),
        ({"drain_margin_s": 40}, "drain_margin_s must be at least 0 and less than spot_notice_s"),
        ({"jobs": {"recipe": {"script": "jobs/recipe.py", "config": "jobs/recipes/nope.yaml"}}}, "jobs.recipe.config"),
        ({"ssh_cidr": "0.0.0.0/0"}, "ssh_cidr holds 0.0.0.0/0, which is every address"),
        ({"client_cidrs": []}, "dashboard: internal-lb needs client_cidrs"),
        ({"client_cidrs": ["10.20.0.0/33"]}, "client_cidrs holds '10.20.0.0/33', not a CIDR block"),
        ({"ray_auth": "yes"}, "ray_auth is 'yes', not true or false"),
        ({"dashboard": "public"}, "dashboard is 'public', not port-forward or internal-lb"),
        ({"run_prefixes": ["data/runs/"]}, "data/runs/ (run_prefixes) lies inside data/ (input_prefixes)"),
        ({"run_prefixes": ["runs/"]}, "'s config names s3://<bucket>/raydense/"),
        ({"kms_key_arn": "alias/raydense"}, "kms_key_arn is 'alias/raydense', not empty (SSE-S3) or a KMS key ARN"),
        ({"security_group_id": ""}, "security_group_id is '', not a security group id"),
        (
            {
                "node_types": {
                    **TEST_VALUES["node_types"],
                    "gpu1": {**TEST_VALUES["node_types"]["gpu1"], "max_spot": -2},
                }
            },
            "node_types.gpu1.max_spot is -2, not a whole number",
        ),
        (
            {"ami": "ami-0123456789abcdef0"},
            "ami is still the example's ami-0123456789abcdef0: name the one of eu-central-1",
        ),
    ],
)
def test_render_refuses_a_bad_value_naming_its_key(tmp_path, capsys, change, message):
    render = cluster_module("render")
    values = dict(copy.deepcopy(TEST_VALUES), **change)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    assert render.main(["--values", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: values: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # nothing written


def test_render_says_in_one_line_what_is_wrong_with_the_file_or_the_output(tmp_path, capsys):
    """Malformed YAML, a file that is no mapping, and --out naming a file: one line each,
    nothing written (they were tracebacks)."""
    render = cluster_module("render")
    good = tmp_path / "values.yaml"
    good.write_text(yaml.safe_dump(TEST_VALUES))
    cases = {
        "bucket: [unclosed\nregion: x\n": "not valid YAML at line 2, column 7: expected ',' or ']'",
        "- just\n- a list\n": "not a mapping of values (it holds list)",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        assert render.main(["--values", str(bad), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {bad}: ") and message in err and "\n" not in err, err
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert render.main(["--values", str(good), "--out", str(a_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--out {a_file} is a file, not a folder to write the kit into") and "\n" not in err
    assert not (tmp_path / "out").exists()


# -- the driver check and the spot watcher's deadline ------------------------------------


def test_driver_check_names_a_driver_too_old_for_the_cuda_build(capsys, monkeypatch):
    check = cluster_module("check_driver")
    smi = "535.183.01\n535.183.01\n"
    proc = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:18 UTC 2025\nGCC version:  gcc 11\n"
    assert check.parse_driver(smi) == "535.183.01" and check.parse_driver(proc) == "580.65.06"
    old = check.driver_problem("535.183.01", "13.0", "torch 2.13.0")
    assert old == (
        "error: NVIDIA driver 535.183.01 is older than R580, which torch 2.13.0 (CUDA 13.0) needs: "
        "use a GPU node image with driver 580 or newer (cluster/guide/image.md, 'NVIDIA driver')"
    )
    assert check.driver_problem("580.65.06", "13.0") is None
    assert check.driver_problem("535.183.01", "12.9") is None  # R525 runs CUDA 12
    assert check.driver_problem("470.256.02", "12.1").startswith("error: NVIDIA driver 470.256.02 is older than R525")
    assert check.driver_problem(None, "13.0").startswith("error: no NVIDIA driver is visible")
    assert check.driver_problem(None, None) is None  # a CPU build

    monkeypatch.setattr(check, "torch_cuda", lambda: ("torch 2.13.0", "13.0"))
    monkeypatch.setattr(check, "installed_driver", lambda: None)
    assert check.main(["--driver", "550.127.05"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NVIDIA driver 550.127.05 is older than R580" in err
    assert check.main([]) == 1 and "no NVIDIA driver is visible" in capsys.readouterr().err
    assert check.main(["--if-gpu"]) == 0  # a CPU node of aws.yaml
    assert check.main(["--driver", "580.95.05"]) == 0


def test_spot_watcher_drains_a_margin_before_the_instance_goes():
    import datetime as dt

    spot_notice = cluster_module("spot_notice")
    goes_at = dt.datetime(2026, 11, 27, 10, 2, 0, tzinfo=dt.timezone.utc)
    seen = goes_at - dt.timedelta(seconds=spot_notice.NOTICE_S)
    assert spot_notice.drain_deadline(goes_at, seen) == goes_at - dt.timedelta(seconds=60)
    # Seen late (the watcher polls every 5 s, or restarted): at least LEAST_DRAIN_S from now...
    late = goes_at - dt.timedelta(seconds=65)
    assert spot_notice.drain_deadline(goes_at, late) == late + dt.timedelta(seconds=spot_notice.LEAST_DRAIN_S)
    # ...but never after the instance is gone.
    later = goes_at - dt.timedelta(seconds=4)
    assert spot_notice.drain_deadline(goes_at, later) == goes_at
    assert spot_notice.drain_deadline(goes_at, seen, margin_s=10) == goes_at - dt.timedelta(seconds=10)


# -- the image ---------------------------------------------------------------------------


def test_dockerfile_builds_on_the_matching_ray_image():
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    assert base == f"rayproject/ray:{image_tag()}"
    assert "optional-dependencies']['gpu']" in dockerfile
    assert "pip install --no-cache-dir -c constraints.txt -r" in dockerfile
    assert "pip install --no-cache-dir --no-deps -c constraints.txt -e ." in dockerfile
    ignored = (CLUSTER / "Dockerfile.dockerignore").read_text().split()
    assert {"runs", ".git", ".venv"} <= set(ignored)


def test_one_constraints_file_pins_what_ci_tested():
    """.ci/run, the image and aws.yaml install with constraints.txt; it pins every core
    dependency, and the pins are what this environment runs (CI installs with it)."""
    from importlib.metadata import version

    tomllib = pytest.importorskip("tomllib")
    pins = dict(
        line.split("==", 1)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    pins = {re.sub(r"[-_.]+", "-", name).lower(): v for name, v in pins.items()}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"] + project["optional-dependencies"]["cpu"]:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0]).lower()
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert version(name).split("+")[0] == pins[name], f"{name}: installed {version(name)}, pinned {pins[name]}"
    assert "-c constraints.txt" in (REPO / ".ci" / "run").read_text()


def test_default_and_test_installs_never_pull_cuda():
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(d.startswith("faiss-gpu") for d in extras["gpu"])
    for group in (project["dependencies"], extras["cpu"], extras["test"]):
        assert not any(re.match(r"(faiss-gpu|nvidia-|cupy)", d) for d in group), group
    assert any(d.startswith("jsonschema") for d in extras["test"])


# -- DeepSpeed ---------------------------------------------------------------------------


@pytest.fixture
def deepspeed_parse():
    """DeepSpeed's own config object (the one deepspeed.initialize builds), as if on rank 0
    of 8: its batch-size check then holds our fill of train_batch_size to the world size."""
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    def parse(cfg: dict, world_size: int = 8):
        with (
            mock.patch.object(dist, "get_rank", return_value=0),
            mock.patch.object(dist, "get_world_size", return_value=world_size),
        ):
            return DeepSpeedConfig(copy.deepcopy(cfg))

    return parse


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_deepspeed_templates_load_in_deepspeed(deepspeed_parse, stage, precision):
    from pipeline.training.deepspeed_config import deepspeed_config
    from pipeline.training.train_config import TrainConfig

    train = TrainConfig(zero_stage=stage, precision=precision, micro_batch_size=4, grad_accum=2, grad_clip=0.5)
    cfg = deepspeed_config(train, world_size=8)
    template = json.loads((ZERO_TEMPLATES / f"zero{stage}.json").read_text())
    assert cfg["zero_optimization"] == template["zero_optimization"]  # the file is what the trainer uses
    parsed = deepspeed_parse(cfg)
    assert parsed.zero_optimization_stage == stage
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    assert parsed.train_batch_size == 4 * 2 * 8 and parsed.gradient_clipping == 0.5


def test_every_deepspeed_file_parses_and_deepspeed_rejects_typos(deepspeed_parse):
    from pipeline.training.deepspeed_config import deepspeed_config
    from pipeline.training.train_config import TrainConfig

    files = sorted(glob.glob(str(ZERO_TEMPLATES / "*.json")))
    assert [Path(f).name for f in files] == ["zero0.json", "zero1.json", "zero2.json", "zero3.json"]
    for path in files:
        cfg = deepspeed_config(TrainConfig(deepspeed_config=path, precision="bf16", zero_stage=1), world_size=8)
        stage = json.loads(Path(path).read_text())["zero_optimization"]["stage"]
        assert deepspeed_parse(cfg).zero_optimization_stage == stage  # an explicit file keeps its stage
    cfg = deepspeed_config(TrainConfig(zero_stage=2, precision="bf16"), world_size=8)
    with pytest.raises(AssertionError, match="train_batch_size"):  # a batch filled for 8 workers is wrong for 4
        deepspeed_parse(cfg, world_size=4)
    cfg["zero_optimization"]["overlap_comms"] = True
    with pytest.raises(Exception, match="overlap_comms"):
        deepspeed_parse(cfg)


def test_cluster_run_config_selects_zero1_bf16(deepspeed_parse):
    from pipeline.core.config import parse_config
    from pipeline.training.deepspeed_config import deepspeed_config
    from pipeline.training.pretrain import PretrainConfig

    cfg = parse_config(PretrainConfig, ["--config", str(PRETRAIN_CONFIG), "--train.num_workers", "16"])
    parsed = deepspeed_parse(deepspeed_config(cfg.train, cfg.train.num_workers), world_size=16)
    assert parsed.zero_optimization_stage == 1 and parsed.bfloat16_config.enabled
    assert parsed.train_batch_size == cfg.train.micro_batch_size * 16


# -- sizing ------------------------------------------------------------------------------


def test_readme_sizing_table_is_the_planners_output(monkeypatch):
    monkeypatch.syspath_prepend(str(CLUSTER))
    import sizing

    readme = (CLUSTER / "guide" / "sizing.md").read_text()
    assert sizing.table() in readme, "regenerate it: python cluster/sizing.py"
    assert sizing.stages_table() in readme, "regenerate it: python cluster/sizing.py"
    # The one measured rate it scales must still be the benchmark's published figure.
    (report,) = (REPO / "bench" / "reports").glob("*-bench-search.md")
    bench = report.read_text()
    assert re.search(rf"\| 1 actor, 1 core, fp32 \| {sizing.MEASURED_PASSAGES_PER_S} passages/s", bench)
    from pipeline.retrieval.index_memory import plan_memory

    for n, _ in sizing.CORPORA:
        for factory in ("Flat", "SQfp16", f"IVF{sizing.ivf_nlist(n)},PQ64"):
            total, shards = sizing.shard_plan(factory, n)
            fewer = [n // (shards - 1)] if shards > 1 else []  # the largest shard of one split fewer
            assert all(row["bytes"] > sizing.SHARD_BUDGET for row in plan_memory(factory, sizing.DIM, fewer))
            assert total <= shards * sizing.SHARD_BUDGET
    flat, _ = sizing.shard_plan("Flat", 8_841_823)
    assert flat == 8_841_823 * (4 * 768 + 8)  # fp32 vector + int64 id, nothing else


def test_readme_cost_table_is_the_scripts_output_from_the_recipe():
    cost = cluster_module("cost")
    table = cost.table()
    assert table in (CLUSTER / "guide" / "cost.md").read_text(), "regenerate it: python cluster/cost.py"
    # The work is the recipe's: pre-training's steps x global batch, and every stage it enables.
    cfg = cost.recipe()
    pre = cfg.pretrain.job.train
    assert f"{pre.max_steps:,} steps x {pre.micro_batch_size * pre.num_workers:,} seq" in table
    stages = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert stages[:4] == ["pretrain", "round1", "round2", "reranker"] and "distill" in stages
    assert stages[-1] == "**total**"


# -- object storage from the environment -------------------------------------------------


def test_s3_settings_come_from_the_environment_and_keys_never_travel(monkeypatch):
    from pipeline.core import storage

    fake = {
        "AWS_ACCESS_KEY_ID": "AKIARAYDENSEFAKE0001",
        "AWS_SECRET_ACCESS_KEY": "raydense/fake+secret0001",
        "AWS_SESSION_TOKEN": "raydense-fake-session-token-0001",
    }
    for key, value in fake.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://minio.internal:9000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    loc = storage.resolve("s3://bucket/prefix")
    assert loc.describe() == "s3://bucket/prefix (endpoint https://minio.internal:9000)"
    # The filesystem object is what Ray pickles into every task that reads the corpus.
    blob = pickle.dumps(loc.fs)
    assert b"minio.internal:9000" in blob and b"eu-central-1" in blob
    for value in fake.values():
        assert value.encode() not in blob
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    assert b"127.0.0.1:9" in pickle.dumps(storage.resolve("s3://bucket/prefix").fs)


def test_deepspeed_templates_load_from_a_non_editable_install(tmp_path):
    """The templates are package data: an install into site-packages (not this checkout)
    finds them through importlib.resources."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    probe = (
        "import json, pipeline.training.deepspeed_config as d; "
        "from pipeline.training.train_config import TrainConfig; "
        "print(d.__file__); print(json.dumps(d.deepspeed_config(TrainConfig(zero_stage=2), 2)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
    ).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert json.loads(out[1])["zero_optimization"]["stage"] == 2


class FakeInstanceMetadata:
    """EC2's instance metadata service (IMDSv2) on loopback: a token for a PUT, and the spot
    interruption notice (404 until ``notice`` is set) for a GET that carries it (401 for
    any other token: set ``token`` to refuse the ones issued before)."""

    def __init__(self):
        import http.server
        import threading

        fake = self
        self.token, self.tokens_issued = "imds-token", 0
        self.notice: dict | None = None
        self.asks: list[str | None] = []  # the token each ask for the notice carried

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                ok = self.path == "/latest/api/token" and self.headers["X-aws-ec2-metadata-token-ttl-seconds"]
                fake.tokens_issued += bool(ok)
                self._reply(200, fake.token.encode()) if ok else self._reply(400)

            def do_GET(self):
                if self.path != "/latest/meta-data/spot/instance-action":
                    return self._reply(404)
                fake.asks.append(self.headers["X-aws-ec2-metadata-token"])
                if self.headers["X-aws-ec2-metadata-token"] != fake.token:
                    return self._reply(401)
                self._reply(200, json.dumps(fake.notice).encode()) if fake.notice else self._reply(404)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_spot_watcher_reuses_its_metadata_token_and_asks_again_when_refused():
    import datetime as dt

    spot_notice = cluster_module("spot_notice")
    imds = FakeInstanceMetadata()
    try:
        metadata = spot_notice.InstanceMetadata(imds.url)
        assert [metadata.interruption_time() for _ in range(3)] == [None, None, None]
        assert imds.tokens_issued == 1 and imds.asks == ["imds-token"] * 3
        imds.token = "rotated"  # the service restarted: the token it issued before is refused
        goes_at = dt.datetime(2026, 11, 27, 10, 0, 5, tzinfo=dt.timezone.utc)
        imds.notice = {"action": "terminate", "time": "2026-11-27T10:00:05Z"}
        assert metadata.interruption_time() == goes_at
        assert imds.tokens_issued == 2 and imds.asks[-2:] == ["imds-token", "rotated"]
        metadata.token_until = 0.0  # a minute before the token's life ends
        assert metadata.interruption_time() == goes_at and imds.tokens_issued == 3
        imds.token = "refused-again"
        metadata.token = "stale"  # refused twice in a row: an error, not a loop
        imds.server.RequestHandlerClass.do_PUT = lambda handler: handler._reply(200, b"also-refused")
        with pytest.raises(spot_notice.urllib.error.HTTPError, match="401"):
            metadata.interruption_time()
    finally:
        imds.server.shutdown()


def test_aws_workers_start_the_spot_notice_watcher_with_the_heads_address():
    config = load(AWS_YAML)
    mount = next(remote for remote, local in config["file_mounts"].items() if local == ".")
    start = config["worker_start_ray_commands"]
    assert any(f"{mount}/cluster/spot_notice.py --address=$RAY_HEAD_IP:6379" in c for c in start)
    assert start.index(next(c for c in start if "spot_notice.py" in c)) > start.index(
        next(c for c in start if "ray start" in c)
    )


@pytest.mark.ray
def test_a_spot_interruption_notice_drains_the_instances_ray_nodes_until_its_time(local_cluster, tmp_path):
    """cluster/spot_notice.py as a worker node runs it: while the metadata service has no
    notice, nothing is drained; once it has one, every Ray worker node of this instance
    (here the one worker node: the head shares the machine's IP) is drained for preemption,
    with the notice's time less the margin as the deadline, and the watcher exits."""
    import datetime as dt

    import ray
    from ray._private.state import state

    local_cluster.add_node(num_cpus=1)

    @ray.remote(num_cpus=1)
    class Work:  # keeps the node busy: an idle drained node ends itself at once
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    work = Work.remote()
    worker_node = ray.get(work.node.remote())
    imds = FakeInstanceMetadata()
    log = open(tmp_path / "spot_notice.log", "w")
    watcher = subprocess.Popen(
        [
            sys.executable,
            "cluster/spot_notice.py",
            "--address",
            local_cluster.address,
            "--imds",
            imds.url,
            "--poll_s",
            "0.1",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 60
        while len(imds.asks) < 3 and time.time() < deadline:
            time.sleep(0.1)
        assert watcher.poll() is None and len(imds.asks) >= 3, (tmp_path / "spot_notice.log").read_text()
        assert set(imds.asks) == {imds.token} and imds.tokens_issued == 1  # IMDSv2: one token, every ask with it
        assert state.get_draining_nodes() == {}
        goes_at = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(seconds=90)
        imds.notice = {"action": "terminate", "time": goes_at.strftime("%Y-%m-%dT%H:%M:%SZ")}
        assert watcher.wait(timeout=60) == 0, (tmp_path / "spot_notice.log").read_text()
    finally:
        watcher.kill()
        imds.server.shutdown()
    # Drained until the notice's time less the margin, so the work moves while the instance runs.
    deadline = goes_at - dt.timedelta(seconds=60)
    assert state.get_draining_nodes() == {worker_node: int(deadline.timestamp() * 1000)}
