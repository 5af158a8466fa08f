"""Who may use a rendered cluster: Ray's token authentication on every endpoint, the dashboard
and Ray Client only where values.yaml asks, a NetworkPolicy that admits the cluster's own pods
and the operator, and IAM roles that reach only what the work touches, evaluated request by
request. A local Ray started as the rendered pods start it refuses a job without the token."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import subprocess
import urllib.error
import urllib.request

import pytest
import yaml

from tests.cluster.test_cluster import CLUSTER, EXAMPLE_VALUES, TEST_VALUES, cluster_module, docs_of
from tests.ray_cluster import RAY, ray_env, start_head, stop


def render(**change) -> dict[str, str]:
    return cluster_module("render").render(dict(copy.deepcopy(TEST_VALUES), **change))


def ray_pods(files: dict[str, str]) -> dict[str, dict]:
    """Every Ray pod template of the rendered RayCluster and RayJobs: {where: pod spec}, and
    each one's cluster spec under "<where>/cluster"."""
    found = {}
    for relative, text in files.items():
        for doc in yaml.safe_load_all(text) if relative.startswith("kuberay/") else []:
            spec = {"RayCluster": lambda d: d["spec"], "RayJob": lambda d: d["spec"]["rayClusterSpec"]}.get(doc["kind"])
            if spec is None:
                continue
            cluster = spec(doc)
            found[f"{relative}/cluster"] = cluster
            found[f"{relative}/head"] = cluster["headGroupSpec"]
            for group in cluster["workerGroupSpecs"]:
                found[f"{relative}/{group['groupName']}"] = group
    return found


def exposure(files: dict[str, str]) -> dict[str, set[str]]:
    """What each rendered cluster lets in: {file: {"client port", "dashboard on every interface",
    "load balancer", "no token"}} (a RayJob's dashboard binds every interface for its operator:
    left out here, its NetworkPolicy is what keeps it)."""
    out: dict[str, set[str]] = {}
    for where, group in ray_pods(files).items():
        relative = where.rsplit("/", 1)[0]
        seen = out.setdefault(relative, set())
        if where.endswith("/cluster"):
            if group.get("authOptions", {}).get("mode") != "token":
                seen.add("no token")
            continue
        for container in group["template"]["spec"]["containers"]:
            if any(port["containerPort"] == 10001 for port in container.get("ports", [])):
                seen.add("client port")
        host = group.get("rayStartParams", {}).get("dashboard-host")
        if where.endswith("/head") and "rayjob-" not in relative and host != "127.0.0.1":
            seen.add("dashboard on every interface")
        if "headService" in group:
            seen.add("load balancer")
    aws = yaml.safe_load(files["aws.yaml"])
    seen = out.setdefault("aws.yaml", set())
    if not any("--dashboard-host=127.0.0.1" in command for command in aws["head_start_ray_commands"]):
        seen.add("dashboard on every interface")
    if "--env RAY_AUTH_MODE=token" not in aws["docker"]["run_options"]:
        seen.add("no token")
    return out


@pytest.mark.parametrize("dashboard", ["port-forward", "internal-lb"])
@pytest.mark.parametrize("ray_client", [False, True])
def test_a_rendered_cluster_exposes_only_what_its_values_ask_for(dashboard, ray_client):
    """Mutations: set_access binding the head's dashboard on 0.0.0.0 whatever the values, or
    keeping Ray Client's port: the port-forward (and no-client) cases fail."""
    files = render(dashboard=dashboard, ray_client=ray_client)
    asked = {"client port"} if ray_client else set()
    lb = {"dashboard on every interface", "load balancer"} if dashboard == "internal-lb" else set()
    for relative, seen in exposure(files).items():
        wanted = set() if relative == "aws.yaml" else asked if "rayjob-" in relative else asked | lb
        assert seen == wanted, relative
    cluster = docs_of(files["kuberay/raycluster.yaml"])["RayCluster"]
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": TEST_VALUES["ray_token_secret"]}
    if dashboard == "internal-lb":
        service = cluster["spec"]["headGroupSpec"]["headService"]
        assert service["spec"]["loadBalancerSourceRanges"] == TEST_VALUES["client_cidrs"]
        assert service["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-scheme"] == "internal"


def test_the_shipped_example_is_authenticated_and_loopback_only():
    files = cluster_module("render").render(copy.deepcopy(EXAMPLE_VALUES))
    assert all(seen == set() for seen in exposure(files).values()), exposure(files)
    aws = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    assert aws["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"
    assert "--env RAY_AUTH_TOKEN_PATH=/home/ray/.ray/auth_token" in aws["docker"]["run_options"]
    # Every `ray up` node joins the named group: Ray then creates none (its own opens SSH to all).
    for name, node in aws["available_node_types"].items():
        assert node["node_config"]["SecurityGroupIds"] == [EXAMPLE_VALUES["security_group_id"]], name
    rules = json.loads(files["aws-ingress.json"])
    ssh = [r for r in rules if r.get("FromPort") == 22]
    assert [r["CidrIp"] for rule in ssh for r in rule["IpRanges"]] == [EXAMPLE_VALUES["ssh_cidr"]]
    assert "0.0.0.0/0" not in files["aws-ingress.json"]
    karpenter = docs_of(files["kuberay/karpenter.yaml"])["EC2NodeClass"]
    assert karpenter["spec"]["metadataOptions"]["httpPutResponseHopLimit"] == 1  # pods cannot take the node's role
    # Every Ray container reads the checkpoint key from its Secret.
    for where, group in ray_pods(files).items():
        if not where.endswith("/cluster"):
            (container,) = group["template"]["spec"]["containers"]
            (key,) = [e for e in container["env"] if e["name"] == "RAYDENSE_CHECKPOINT_KEY"]
            assert key["valueFrom"]["secretKeyRef"] == {"name": EXAMPLE_VALUES["checkpoint_key_secret"], "key": "key"}


def test_turning_authentication_off_is_one_value_and_every_file_says_so():
    files = render(ray_auth=False)
    for relative in ("aws.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob-recipe.yaml"):
        assert files[relative].startswith("# WARNING: Ray's token authentication is OFF"), relative
        assert exposure(files)[relative] >= {"no token"}, relative
    aws = yaml.safe_load(files["aws.yaml"])
    assert "--env RAY_AUTH_MODE=disabled" in aws["docker"]["run_options"]
    assert "/home/ray/.ray/auth_token" not in aws["file_mounts"]
    assert not render()["kuberay/raycluster.yaml"].startswith("# WARNING")


def test_the_network_policy_admits_the_clusters_pods_the_operator_and_the_named_clients():
    for dashboard, clients in (("port-forward", []), ("internal-lb", ["10.20.0.0/16"])):
        (policy,) = yaml.safe_load_all(render(dashboard=dashboard, client_cidrs=clients)["kuberay/networkpolicy.yaml"])
        assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "raydense"}}
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        sources = []
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), "a rule without `from` admits every source"
            ports = sorted(p["port"] for p in rule.get("ports", []))
            for source in rule["from"]:
                sources.append((json.dumps(source, sort_keys=True), ports))
        own = json.dumps({"podSelector": {"matchLabels": {"app.kubernetes.io/name": "raydense"}}}, sort_keys=True)
        operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}}}
        expected = [(own, []), (json.dumps(operator, sort_keys=True), [8265])]
        expected += [(json.dumps({"ipBlock": {"cidr": c}}, sort_keys=True), [8265]) for c in clients]
        assert sources == expected
    # The RayJob's submitter carries the label the policy admits.
    job = docs_of(render()["kuberay/rayjob-recipe.yaml"])["RayJob"]
    assert job["spec"]["submitterPodTemplate"]["metadata"]["labels"] == {"app.kubernetes.io/name": "raydense"}


# -- IAM, request by request ---------------------------------------------------------------


def _listed(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _condition_holds(condition: dict, context: dict[str, str]) -> bool:
    for operator, tests in condition.items():
        for key, wanted in tests.items():
            if key not in context:
                return False
            if operator == "StringEquals" and context[key] not in _listed(wanted):
                return False
            if operator == "StringLike" and not any(fnmatch.fnmatchcase(context[key], w) for w in _listed(wanted)):
                return False
            if operator not in ("StringEquals", "StringLike"):
                raise NotImplementedError(f"condition operator {operator}")
    return True


def allowed(policy: dict, action: str, resource: str, **context: str) -> bool:
    """IAM's evaluation for one identity policy: an explicit Deny wins, else any Allow whose
    action, resource and conditions match, else the implicit deny."""
    verdict = False
    for statement in policy["Statement"]:
        if not any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in _listed(statement["Action"])):
            continue
        if not any(fnmatch.fnmatchcase(resource, r) for r in _listed(statement["Resource"])):
            continue
        if not _condition_holds(statement.get("Condition", {}), context):
            continue
        if statement["Effect"] == "Deny":
            return False
        verdict = True
    return verdict


def test_the_data_role_reads_the_inputs_writes_only_the_runs_and_uses_the_buckets_key():
    """Mutation: the old policy (Get, Put and Delete on the whole bucket): deleting an input
    is allowed, and this fails."""
    files = render()
    policy = json.loads(files["iam/s3-policy.json"])
    bucket = f"arn:aws:s3:::{TEST_VALUES['bucket']}"
    assert allowed(policy, "s3:GetObject", f"{bucket}/data/msmarco/corpus.jsonl")
    assert allowed(policy, "s3:GetObject", f"{bucket}/models/bert-base/model.safetensors")
    for write in ("s3:PutObject", "s3:DeleteObject"):
        assert not allowed(policy, write, f"{bucket}/data/msmarco/corpus.jsonl"), write
        assert allowed(policy, write, f"{bucket}/raydense/recipe-msmarco/round1/export/model.safetensors"), write
        assert not allowed(policy, write, f"{bucket}/raydense-other/x"), write  # a prefix, not a name start
    assert not allowed(policy, "s3:GetObject", f"{bucket}/secrets/keys.json")
    assert not allowed(policy, "s3:GetObject", "arn:aws:s3:::another-bucket/raydense/x")
    assert allowed(policy, "s3:ListBucket", bucket)
    assert allowed(policy, "kms:GenerateDataKey", TEST_VALUES["kms_key_arn"])
    assert not allowed(policy, "kms:Decrypt", TEST_VALUES["kms_key_arn"].replace("0a1b", "ffff"))
    assert not allowed(policy, "s3:PutBucketPolicy", bucket)
    # Every path of the rendered run configs is readable; every output under the run prefixes, writable.
    for relative in ("configs/recipe.yaml", "configs/pretrain.yaml"):
        assert re.findall(rf"s3://{TEST_VALUES['bucket']}/", files[relative]), relative
        for uri in re.findall(rf"s3://({TEST_VALUES['bucket']}/[^\s'\")]+)", files[relative]):
            assert allowed(policy, "s3:GetObject", f"arn:aws:s3:::{uri.rstrip('/')}/x"), uri
    # Without a key named, no KMS grant at all (SSE-S3).
    assert not any(
        "kms" in json.dumps(s) for s in json.loads(render(kms_key_arn="")["iam/s3-policy.json"])["Statement"]
    )


def test_the_head_role_launches_and_ends_only_its_own_clusters_instances():
    """Mutation: the old head policy (EC2 actions on "*", no tag condition): terminating an
    untagged instance is allowed, and this fails."""
    files = render()
    policy = json.loads(files["iam/head-policy.json"])
    account, region = TEST_VALUES["account_id"], TEST_VALUES["region"]
    instance = f"arn:aws:ec2:{region}:{account}:instance/i-0123456789abcdef0"
    name = yaml.safe_load(files["aws.yaml"])["cluster_name"]
    assert allowed(policy, "ec2:TerminateInstances", instance, **{"ec2:ResourceTag/ray-cluster-name": name})
    assert not allowed(policy, "ec2:TerminateInstances", instance)  # untagged: another team's
    assert not allowed(policy, "ec2:TerminateInstances", instance, **{"ec2:ResourceTag/ray-cluster-name": "prod-db"})
    assert not allowed(
        policy,
        "ec2:TerminateInstances",
        instance.replace(account, "999999999999"),
        **{"ec2:ResourceTag/ray-cluster-name": name},
    )
    assert allowed(policy, "ec2:RunInstances", instance, **{"aws:RequestTag/ray-cluster-name": name})
    assert not allowed(policy, "ec2:RunInstances", instance)  # an instance launched untagged
    assert allowed(policy, "ec2:RunInstances", f"arn:aws:ec2:{region}::image/{TEST_VALUES['ami']}")
    assert allowed(policy, "ec2:CreateTags", instance, **{"ec2:CreateAction": "RunInstances"})
    assert not allowed(policy, "ec2:CreateTags", instance)
    assert allowed(policy, "iam:PassRole", f"arn:aws:iam::{account}:role/{TEST_VALUES['worker_profile']}")
    assert not allowed(policy, "iam:PassRole", f"arn:aws:iam::{account}:role/admin")


# -- a Ray started as the pods start it ----------------------------------------------------


@pytest.mark.ray
def test_a_token_mode_ray_refuses_a_job_without_the_token_and_runs_one_with_it():
    """The head as the rendered pods start it: RAY_AUTH_MODE=token with the Secret's token
    (KubeRay's authOptions sets both), the dashboard on loopback. Counted: only the job with
    the token reached the job API."""
    files = render(dashboard="port-forward")
    head_spec = docs_of(files["kuberay/raycluster.yaml"])["RayCluster"]["spec"]["headGroupSpec"]
    assert head_spec["rayStartParams"]["dashboard-host"] == "127.0.0.1"  # as start_head starts it
    token = "raydense-test-token-0123456789abcdef0123456789abcdef"
    head = start_head(1, ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token))
    try:
        job = ["job", "submit", "--address", head.job_address, "--", "python", "-c", "print('ran on the cluster')"]
        for env in (
            ray_env(),
            ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="a-neighbours-guess-0123456789abcdef0123"),
        ):
            refused = subprocess.run([RAY, *job], env=env, capture_output=True, text=True, timeout=120)
            assert refused.returncode != 0 and "authentication token" in refused.stderr + refused.stdout
        # The HTTP API itself, not only the CLI, refuses a request without the token.
        request = urllib.request.Request(
            f"{head.job_address}/api/jobs/", data=json.dumps({"entrypoint": "echo planted"}).encode(), method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(request, timeout=30)
        assert http.value.code in (401, 403)
        good = ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        ran = subprocess.run([RAY, *job], env=good, capture_output=True, text=True, timeout=180)
        assert ran.returncode == 0 and "ran on the cluster" in ran.stdout, ran.stdout + ran.stderr
        listed = subprocess.run(
            [RAY, "job", "list", "--address", head.job_address], env=good, capture_output=True, text=True, timeout=60
        )
        assert listed.stdout.count("submission_id=") == 1, listed.stdout
    finally:
        stop(head.process)
