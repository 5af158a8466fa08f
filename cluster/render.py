"""Write the cluster kit with your values: bucket, image, region, zone, account, roles and
node types are set once, in cluster/values.yaml, and put wherever the kit needs them.

    python cluster/render.py [--values cluster/values.yaml] [--out cluster/rendered]

Writes, under --out:
    aws.yaml                           the Ray cluster launcher's config (`ray up`)
    kuberay/raycluster.yaml            a standing, autoscaling RayCluster
    kuberay/rayjob-<job>.yaml          one RayJob per entry of `jobs`, with its run config in a ConfigMap
    kuberay/karpenter.yaml             the EC2NodeClass and NodePools the pods land on
    kuberay/serviceaccount.yaml        the pods' S3 identity (IRSA)
    kuberay/networkpolicy.yaml         who may reach the pods: each other, the KubeRay operator, client_cidrs
    iam/s3-policy.json, iam/head-policy.json
    aws-ingress.json                   `ray up`'s security group rules: its own members, SSH from ssh_cidr
    configs/<job>.yaml                 the run configs, with your bucket

The files under cluster/ hold example values; they are read, changed where a value goes, and
written again (comments stay in the sources). A value that is missing or malformed is an
error naming its key, before anything is written.
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import json
import re
import sys
from pathlib import Path

import yaml

CLUSTER = Path(__file__).resolve().parent
REPO = CLUSTER.parent
EXAMPLE_BUCKET = "your-bucket"
EXAMPLE_ACCOUNT = "123456789012"
EXAMPLE_REGION = "us-west-2"
EXAMPLE_VALUES = {"ami": "ami-0123456789abcdef0", "security_group_id": "sg-0123456789abcdef0"}  # values.yaml's
IMAGE_DIR = "/home/ray/raydense"  # where cluster/Dockerfile puts the checkout
NODE_KEYS = {"instance_type", "vcpus", "memory_gib", "gpus", "scratch_gib"}
WORKER_TYPES = ("cpu", "gpu1", "gpu8")
AWS_TOKEN_PATH = "/home/ray/.ray/auth_token"  # in every `ray up` node's container
K8S_NAME = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# The GPU of each EC2 GPU family, as Ray names it (``accelerator_type``): the run configs'
# searchers are pinned to the gpu1 nodes' GPU and sized by its memory.
GPU_OF_FAMILY = {
    "g4dn": "T4",
    "g5": "A10G",
    "g6": "L4",
    "g6e": "L40S",
    "p3": "V100",
    "p4d": "A100-40G",
    "p4de": "A100-80G",
    "p5": "H100",
    "p5e": "H200",
    "p5en": "H200",
}
AUTH_OFF_WARNING = (
    "# WARNING: Ray's token authentication is OFF (values.yaml: ray_auth: false). Anyone who can\n"
    "# reach the head's dashboard, GCS or client port can run code on this cluster, with its roles.\n"
)


class ValuesError(ValueError):
    pass


def check_values(values: dict) -> dict:
    """The values, each checked, with a message naming the key of the first bad one."""

    def need(key: str, pattern: str, what: str) -> str:
        value = values.get(key)
        if not isinstance(value, str) or not re.fullmatch(pattern, value):
            raise ValuesError(f"values: {key} is {value!r}, not {what}")
        return value

    need("bucket", r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", "an S3 bucket name")
    region = need("region", r"[a-z]{2}(-gov)?-[a-z]+-\d", "an AWS region such as us-west-2")
    zone = need("zone", r"[a-z]{2}(-gov)?-[a-z]+-\d[a-z]", "an availability zone such as us-west-2a")
    if not zone.startswith(region):
        raise ValuesError(f"values: zone {zone} is not in region {region}")
    need("account_id", r"\d{12}", "a 12-digit AWS account id")
    need("image", r"\S+:\S+", "an image reference with a tag")
    for key in ("eks_cluster", "karpenter_node_role", "s3_role", "head_profile", "worker_profile"):
        need(key, r"[\w+=,.@-]+", "a name")
    need("ami", r"ami-[0-9a-f]{8,17}", "an AMI id")
    need("security_group_id", r"sg-[0-9a-f]+", "a security group id (every `ray up` node joins it)")
    if region != EXAMPLE_REGION:  # the example's ids exist in no account, and ids are per region
        for key in ("ami", "security_group_id"):
            if values[key] == EXAMPLE_VALUES[key]:
                raise ValuesError(f"values: {key} is still the example's {values[key]}: name the one of {region}")
    _check_access(values, need)
    _check_prefixes(values)
    types = values.get("node_types")
    if not isinstance(types, dict) or set(types) != {"head", *WORKER_TYPES}:
        raise ValuesError(f"values: node_types must name head, {', '.join(WORKER_TYPES)}")
    for name, spec in types.items():
        missing = NODE_KEYS - set(spec)
        if missing:
            raise ValuesError(f"values: node_types.{name} lacks {', '.join(sorted(missing))}")
        counts = (NODE_KEYS - {"instance_type"}) | ({"max_spot", "max_ondemand", "efa_interfaces"} & set(spec))
        for key in sorted(counts):
            if not isinstance(spec[key], int) or isinstance(spec[key], bool) or spec[key] < 0:
                raise ValuesError(f"values: node_types.{name}.{key} is {spec[key]!r}, not a whole number")
    if not 0 <= values.get("drain_margin_s", -1) < values.get("spot_notice_s", 0):
        raise ValuesError("values: drain_margin_s must be at least 0 and less than spot_notice_s")
    if values.get("efa"):
        need("subnet_id", r"subnet-[0-9a-f]+", "a subnet id (efa: true needs it)")
        if not types["gpu8"].get("efa_interfaces"):
            raise ValuesError("values: efa: true needs node_types.gpu8.efa_interfaces")
    for job, spec in (values.get("jobs") or {}).items():
        for key in ("script", "config"):
            if not (REPO / spec.get(key, "")).is_file():
                raise ValuesError(f"values: jobs.{job}.{key} {spec.get(key)!r} is not a file of the checkout")
    return values


def _networks(values: dict, key: str) -> list[str]:
    entries = values.get(key)
    entries = [entries] if isinstance(entries, str) else entries
    if not isinstance(entries, list):
        raise ValuesError(f"values: {key} is {entries!r}, not a list of CIDR blocks")
    for entry in entries:
        try:
            network = ipaddress.ip_network(str(entry))
        except ValueError:
            raise ValuesError(f"values: {key} holds {entry!r}, not a CIDR block such as 10.0.0.0/16") from None
        if network.prefixlen == 0:
            raise ValuesError(f"values: {key} holds {entry}, which is every address: name your own network")
    return [str(e) for e in entries]


def _check_access(values: dict, need) -> None:
    """Authentication, the dashboard's reach and the Secrets' names."""
    for key in ("ray_auth", "ray_client"):
        if not isinstance(values.get(key), bool):
            raise ValuesError(f"values: {key} is {values.get(key)!r}, not true or false")
    for key in ("ray_token_secret", "checkpoint_key_secret", "operator_namespace"):
        need(key, K8S_NAME, "a Kubernetes name")
    if values.get("dashboard") not in ("port-forward", "internal-lb"):
        raise ValuesError(f"values: dashboard is {values.get('dashboard')!r}, not port-forward or internal-lb")
    clients = _networks(values, "client_cidrs")
    if values["dashboard"] == "internal-lb" and not clients:
        raise ValuesError("values: dashboard: internal-lb needs client_cidrs, the networks that may reach it")
    _networks(values, "ssh_cidr")
    kms = values.get("kms_key_arn", "")
    if kms and not re.fullmatch(r"arn:aws[\w-]*:kms:[a-z0-9-]+:\d{12}:key/[\w-]+", str(kms)):
        raise ValuesError(f"values: kms_key_arn is {kms!r}, not empty (SSE-S3) or a KMS key ARN")


def _check_prefixes(values: dict) -> None:
    """Input and run prefixes of the bucket: each ends in /, none inside another, and every
    s3:// path of the jobs' configs under one of them (the roles grant nothing else)."""
    prefixes = {}
    for key in ("input_prefixes", "run_prefixes"):
        entries = values.get(key)
        if not isinstance(entries, list) or not entries:
            raise ValuesError(f"values: {key} is {entries!r}, not a list of prefixes such as [data/]")
        for entry in entries:
            if not isinstance(entry, str) or not re.fullmatch(r"[\w.=-]+(/[\w.=-]+)*/", entry):
                raise ValuesError(f"values: {key} holds {entry!r}, not a key prefix ending in / (data/)")
            prefixes[entry] = key
    for a in prefixes:
        for b in prefixes:
            if a != b and b.startswith(a):
                raise ValuesError(f"values: {b} ({prefixes[b]}) lies inside {a} ({prefixes[a]})")
    for job, spec in (values.get("jobs") or {}).items():
        config = REPO / spec.get("config", "")
        text = config.read_text() if config.is_file() else ""  # a missing one: check_values names it
        for path in re.findall(rf"s3://{EXAMPLE_BUCKET}/(\S+)", text):
            if not any(path.startswith(p) for p in prefixes):
                raise ValuesError(
                    f"values: jobs.{job}'s config names s3://<bucket>/{path}, under none of input_prefixes "
                    "and run_prefixes: the roles would refuse it"
                )


def with_bucket(text: str, values: dict) -> str:
    """A run config or policy with the user's bucket where the example's is."""
    return text.replace(EXAMPLE_BUCKET, values["bucket"]).replace(EXAMPLE_ACCOUNT, values["account_id"])


def run_config(path: Path, values: dict) -> str:
    """A job's run config for this cluster: the user's bucket, and its searchers on the GPU
    of the gpu1 nodes."""
    text = with_bucket(path.read_text(), values)
    if "accelerator_type:" not in text:
        return text
    instance = values["node_types"]["gpu1"]["instance_type"]
    gpu = GPU_OF_FAMILY.get(instance.split(".")[0])
    if gpu is None:
        raise ValuesError(
            f"values: node_types.gpu1.instance_type {instance}: its GPU is not one render.py knows "
            f"({', '.join(sorted(GPU_OF_FAMILY))}); add its family to GPU_OF_FAMILY"
        )
    return re.sub(r"(accelerator_type:\s*)[\w-]+", rf"\g<1>{gpu}", text)


def pod_resources(spec: dict) -> tuple[dict, dict]:
    """What a pod of this node type asks: 15/16 of the vCPUs, 7/8 of the memory, its GPUs and
    its scratch plus 10 GiB for the container's own writes; and the volume sizes."""
    asked = {"cpu": str(spec["vcpus"] - max(1, spec["vcpus"] // 16)), "memory": f"{spec['memory_gib'] * 7 // 8}Gi"}
    if spec["gpus"]:
        asked["nvidia.com/gpu"] = str(spec["gpus"])
    asked["ephemeral-storage"] = f"{spec['scratch_gib'] + 10}Gi"
    sizes = {"dshm": f"{spec['memory_gib'] * 3 // 10}Gi", "scratch": f"{spec['scratch_gib']}Gi"}
    return asked, sizes


def drain_s(values: dict) -> int:
    return values["spot_notice_s"] - values["drain_margin_s"]


def efa_env() -> list[dict]:
    # libfabric's EFA provider for NCCL (the aws-ofi-nccl plugin in the image), with GPUDirect RDMA.
    return [
        {"name": "FI_PROVIDER", "value": "efa"},
        {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"},
        {"name": "NCCL_NET_PLUGIN", "value": "ofi"},
    ]


def set_pod(pod: dict, spec: dict, values: dict, capacity: str | None, efa: bool) -> None:
    asked, sizes = pod_resources(spec)
    selector = pod.setdefault("nodeSelector", {})
    if capacity:  # workers; the head only asks for on-demand
        selector["node.kubernetes.io/instance-type"] = spec["instance_type"]
        pod["terminationGracePeriodSeconds"] = drain_s(values) + 30
    selector["topology.kubernetes.io/zone"] = values["zone"]
    for container in pod.get("initContainers", []):
        container["image"] = values["image"]
        for side in ("requests", "limits"):
            container["resources"][side]["nvidia.com/gpu"] = str(spec["gpus"])
    (container,) = pod["containers"]
    container["image"] = values["image"]
    env = {e["name"]: e for e in container["env"]}
    env["AWS_DEFAULT_REGION"]["value"] = values["region"]
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]["value"] = str(drain_s(values))
    env["RAYDENSE_CHECKPOINT_KEY"]["valueFrom"]["secretKeyRef"]["name"] = values["checkpoint_key_secret"]
    if efa:
        asked["vpc.amazonaws.com/efa"] = str(spec["efa_interfaces"])
        container["env"] = list(env.values()) + efa_env()
    container["resources"] = {"requests": dict(asked), "limits": dict(asked)}
    for volume in pod["volumes"]:
        if volume["name"] in sizes:
            volume["emptyDir"]["sizeLimit"] = sizes[volume["name"]]


def set_access(spec: dict, values: dict, job: bool) -> None:
    """Who may use a RayCluster's (or a RayJob's cluster's) Ray: token authentication, where
    the dashboard and job API listen, and whether Ray Client's port is exposed."""
    spec["authOptions"] = (
        {"mode": "token", "secretName": values["ray_token_secret"]} if values["ray_auth"] else {"mode": "disabled"}
    )
    head = spec["headGroupSpec"]
    lb = values["dashboard"] == "internal-lb" and not job
    # A RayJob's operator and submitter call the dashboard through the head's Service, so a
    # RayJob binds it on every interface (networkpolicy.yaml keeps it to them); a standing
    # cluster keeps it on the pod's loopback, unless an internal load balancer is asked for.
    head["rayStartParams"]["dashboard-host"] = "0.0.0.0" if job or lb else "127.0.0.1"
    head.pop("headService", None)
    if lb:
        head["headService"] = {
            "metadata": {
                "annotations": {
                    "service.beta.kubernetes.io/aws-load-balancer-type": "external",
                    "service.beta.kubernetes.io/aws-load-balancer-nlb-target-type": "ip",
                    "service.beta.kubernetes.io/aws-load-balancer-scheme": "internal",
                }
            },
            "spec": {"type": "LoadBalancer", "loadBalancerSourceRanges": _networks(values, "client_cidrs")},
        }
    (container,) = head["template"]["spec"]["containers"]
    ports = [port for port in container["ports"] if port["name"] != "client"]
    container["ports"] = ports + ([{"containerPort": 10001, "name": "client"}] if values["ray_client"] else [])


def raycluster(values: dict) -> dict:
    doc = yaml.safe_load((CLUSTER / "kuberay" / "raycluster.yaml").read_text())
    spec = doc["spec"]
    # The file's YAML anchors load as objects the pods share: each pod is edited on its own copy.
    head = spec["headGroupSpec"]
    head["template"] = copy.deepcopy(head["template"])
    set_pod(head["template"]["spec"], values["node_types"]["head"], values, None, False)
    for group in spec["workerGroupSpecs"]:
        group["template"] = copy.deepcopy(group["template"])
        kind, capacity = group["groupName"].rsplit("-", 1)
        node = values["node_types"][kind]
        group["maxReplicas"] = node.get(f"max_{capacity}", group["maxReplicas"])
        efa = bool(values.get("efa")) and kind == "gpu8"
        set_pod(group["template"]["spec"], node, values, capacity, efa)
    set_access(spec, values, job=False)
    if values.get("gcs_redis"):
        spec["gcsFaultToleranceOptions"] = {
            "redisAddress": values["gcs_redis"],
            "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "raydense-redis", "key": "password"}}},
        }
    return doc


def rayjob(name: str, job: dict, cluster: dict, values: dict) -> list[dict]:
    """A RayJob that brings up the RayCluster's spec (without GCS fault tolerance: a retry is
    a new cluster) and runs one job with its config from a ConfigMap mounted on the head."""
    spec = copy.deepcopy(cluster["spec"])
    spec.pop("gcsFaultToleranceOptions", None)
    set_access(spec, values, job=True)
    config_map = f"raydense-{name}-config"
    head = spec["headGroupSpec"]["template"]["spec"]
    head["volumes"].append({"name": "run-config", "configMap": {"name": config_map}})
    head["containers"][0]["volumeMounts"].append({"name": "run-config", "mountPath": "/etc/raydense", "readOnly": True})
    labels = {"app.kubernetes.io/name": "raydense"}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config_map, "labels": labels},
            "data": {f"{name}.yaml": run_config(REPO / job["config"], values)},
        },
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": f"raydense-{name}", "labels": labels},
            "spec": {
                "entrypoint": f"python {IMAGE_DIR}/{job['script']} --config /etc/raydense/{name}.yaml",
                # A retry is a new cluster running the same command with the same outputs: it
                # resumes from S3. Preempted workers are handled inside the run.
                "backoffLimit": 2,
                "shutdownAfterJobFinishes": True,
                "ttlSecondsAfterFinished": 600,
                "rayClusterSpec": spec,
                # The submitter pod (K8sJobMode: KubeRay fills in its command and the token)
                # carries the raydense label, so networkpolicy.yaml lets it reach the dashboard.
                "submitterPodTemplate": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "ray-job-submitter",
                                "image": values["image"],
                                "resources": {
                                    "requests": {"cpu": "500m", "memory": "1Gi"},
                                    "limits": {"cpu": "1", "memory": "1Gi"},
                                },
                            }
                        ],
                    },
                },
            },
        },
    ]


def networkpolicy(values: dict) -> dict:
    doc = yaml.safe_load((CLUSTER / "kuberay" / "networkpolicy.yaml").read_text())
    ingress = doc["spec"]["ingress"]
    operator = ingress[1]["from"][0]["namespaceSelector"]["matchLabels"]
    operator["kubernetes.io/metadata.name"] = values["operator_namespace"]
    del ingress[2:]
    if values["dashboard"] == "internal-lb":
        ports = [8265] + ([10001] if values["ray_client"] else [])
        ingress.append(
            {
                "from": [{"ipBlock": {"cidr": cidr}} for cidr in _networks(values, "client_cidrs")],
                "ports": [{"port": port, "protocol": "TCP"} for port in ports],
            }
        )
    return doc


def s3_policy(values: dict) -> dict:
    """The data role: the bucket's input prefixes read, its run prefixes read, written and
    deleted, and the KMS key (when named) used for both. Listing covers the bucket: S3
    answers a HEAD of a missing object with 404, not 403, only to a role that may list."""
    bucket = f"arn:aws:s3:::{values['bucket']}"
    statements = [
        {
            "Sid": "ListTheBucket",
            "Effect": "Allow",
            "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
            "Resource": bucket,
        },
        {
            "Sid": "ReadTheInputs",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{bucket}/{prefix}*" for prefix in values["input_prefixes"]],
        },
        {
            "Sid": "ReadWriteAndDeleteTheRuns",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
            "Resource": [f"{bucket}/{prefix}*" for prefix in values["run_prefixes"]],
        },
    ]
    if values.get("kms_key_arn"):
        statements.append(
            {
                "Sid": "EncryptAndDecryptWithTheBucketsKey",
                "Effect": "Allow",
                "Action": ["kms:GenerateDataKey", "kms:Decrypt"],
                "Resource": values["kms_key_arn"],
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def aws_ingress(values: dict) -> list[dict]:
    """The inbound rules of the security group every `ray up` node joins."""
    group = values["security_group_id"]
    return [
        {
            "IpProtocol": "-1",
            "UserIdGroupPairs": [{"GroupId": group, "Description": "Ray between the cluster's nodes"}],
        },
        {
            "IpProtocol": "tcp",
            "FromPort": 22,
            "ToPort": 22,
            "IpRanges": [{"CidrIp": cidr, "Description": "SSH for ray up"} for cidr in _networks(values, "ssh_cidr")],
        },
    ]


def karpenter(values: dict) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay" / "karpenter.yaml").read_text()) if d]
    types = values["node_types"]
    for doc in docs:
        if doc["kind"] == "EC2NodeClass":
            doc["spec"]["role"] = values["karpenter_node_role"]
            for terms in ("subnetSelectorTerms", "securityGroupSelectorTerms"):
                for term in doc["spec"][terms]:
                    term["tags"]["karpenter.sh/discovery"] = values["eks_cluster"]
        if doc["kind"] == "NodePool":
            gpu = doc["metadata"]["name"].endswith("-gpu")
            wanted = [types[t]["instance_type"] for t in (("gpu1", "gpu8") if gpu else ("head", "cpu"))]
            for requirement in doc["spec"]["template"]["spec"]["requirements"]:
                if requirement["key"] == "node.kubernetes.io/instance-type":
                    requirement["values"] = sorted(set(wanted))
                if requirement["key"] == "topology.kubernetes.io/zone":
                    requirement["values"] = [values["zone"]]
    return docs


def aws(values: dict) -> dict:
    doc = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    doc["provider"]["region"] = values["region"]
    doc["provider"]["availability_zone"] = values["zone"]
    doc["docker"]["run_options"] = [
        f"--env AWS_DEFAULT_REGION={values['region']}" if o.startswith("--env AWS_DEFAULT_REGION=") else o
        for o in doc["docker"]["run_options"]
    ]
    auth = [
        o for o in doc["docker"]["run_options"] if not o.startswith(("--env RAY_AUTH_MODE=", "--env RAY_AUTH_TOKEN"))
    ]
    if values["ray_auth"]:
        # Every node reads the token `ray up` copies from ~/.ray/auth_token (file_mounts).
        auth += ["--env RAY_AUTH_MODE=token", f"--env RAY_AUTH_TOKEN_PATH={AWS_TOKEN_PATH}"]
        doc["file_mounts"][AWS_TOKEN_PATH] = "~/.ray/auth_token"
    else:
        auth += ["--env RAY_AUTH_MODE=disabled"]
        doc["file_mounts"].pop(AWS_TOKEN_PATH, None)
    doc["docker"]["run_options"] = auth
    for name, node in doc["available_node_types"].items():
        node["node_config"] = copy.deepcopy(node["node_config"])
        kind = name.rsplit("-", 1)[0]
        spec = values["node_types"][kind]
        config = node["node_config"]
        config["ImageId"] = values["ami"]
        config["InstanceType"] = spec["instance_type"]
        config["IamInstanceProfile"] = {"Name": values["head_profile" if name == "head" else "worker_profile"]}
        config["SecurityGroupIds"] = [values["security_group_id"]]
        if name != "head":
            node["resources"] = {"CPU": spec["vcpus"], **({"GPU": spec["gpus"]} if spec["gpus"] else {})}
            node["max_workers"] = spec.get(f"max_{name.rsplit('-', 1)[1]}", node["max_workers"])
        if values.get("efa") and kind == "gpu8":
            config["NetworkInterfaces"] = [
                {
                    "NetworkCardIndex": card,
                    "DeviceIndex": 0 if card == 0 else 1,
                    "InterfaceType": "efa",
                    "SubnetId": values["subnet_id"],
                    "Groups": [values["security_group_id"]],
                    "DeleteOnTermination": True,
                }
                for card in range(spec["efa_interfaces"])
            ]
            config["Placement"] = {"GroupName": "raydense-gpu8"}
            del config["SecurityGroupIds"]  # EC2 takes an EFA node's groups on its interfaces only
    doc["worker_start_ray_commands"] = [
        re.sub(r"--margin_s=\d+", f"--margin_s={values['drain_margin_s']}", c) for c in doc["worker_start_ray_commands"]
    ]
    if values.get("efa"):
        doc["docker"]["run_options"] += [f"--env {e['name']}={e['value']}" for e in efa_env()]
    return doc


def render(values: dict) -> dict[str, str]:
    """Every file of the kit with these values: {relative path: text}."""
    check_values(values)
    dump = lambda docs: "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)  # noqa: E731
    cluster = raycluster(values)
    warning = "" if values["ray_auth"] else AUTH_OFF_WARNING
    files = {
        "aws.yaml": warning + dump([aws(values)]),
        "kuberay/raycluster.yaml": warning + dump([cluster]),
        "kuberay/karpenter.yaml": dump(karpenter(values)),
        "kuberay/networkpolicy.yaml": dump([networkpolicy(values)]),
        "aws-ingress.json": json.dumps(aws_ingress(values), indent=2) + "\n",
        "iam/s3-policy.json": json.dumps(s3_policy(values), indent=2) + "\n",
    }
    account = (CLUSTER / "kuberay" / "serviceaccount.yaml").read_text()
    files["kuberay/serviceaccount.yaml"] = with_bucket(account, values).replace(
        "role/raydense-s3", f"role/{values['s3_role']}"
    )
    text = with_bucket((CLUSTER / "iam" / "head-policy.json").read_text(), values)
    text = text.replace("/raydense-worker", f"/{values['worker_profile']}")
    files["iam/head-policy.json"] = json.dumps(json.loads(text), indent=2) + "\n"
    for name, job in (values.get("jobs") or {}).items():
        files[f"kuberay/rayjob-{name}.yaml"] = warning + dump(rayjob(name, job, cluster, values))
        files[f"configs/{name}.yaml"] = run_config(REPO / job["config"], values)
    return files


def read_values(path: Path) -> dict:
    """The values file as a mapping; malformed YAML is one line naming where."""
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValuesError(f"not valid YAML{where}: {problem}") from None
    if not isinstance(values, dict):
        raise ValuesError(f"not a mapping of values (it holds {type(values).__name__})")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=Path, default=CLUSTER / "values.yaml", help="your values")
    parser.add_argument("--out", type=Path, default=CLUSTER / "rendered", help="where the rendered files go")
    args = parser.parse_args(argv)
    try:
        files = render(read_values(args.values))
        if args.out.exists() and not args.out.is_dir():
            raise ValuesError(f"--out {args.out} is a file, not a folder to write the kit into")
    except (OSError, ValuesError) as err:
        print(f"error: {args.values}: {err}", file=sys.stderr)
        return 2
    for relative, text in files.items():
        path = args.out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"{len(files)} files in {args.out}: {', '.join(sorted(files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
