"""Shared fixtures: an S3 server on loopback (moto), and local Ray instances: one per
module that runs Ray Train, one shared by the tests that do not.

The S3 variables go into os.environ *before* Ray starts, because Ray's workers and
the Ray Train controller inherit the driver's environment.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid

import pytest

# Models fetched from storage go to a node-local cache: the tests' own, not the user's
# (set before Ray starts, so its workers share it as workers of one node do).
os.environ.setdefault("RAYDENSE_CACHE", tempfile.mkdtemp(prefix="raydense-cache-"))

# Fake credentials, for the loopback server only.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    yield endpoint
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_endpoint):
    import boto3

    name = f"raydense-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


# Which of the fixtures below the running local Ray belongs to: "shared", a module's name,
# or None. One process has one Ray at a time; a fixture that finds another's starts its own.
_ray_owner: dict[str, str | None] = {"owner": None}


def _ray_environment() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray Data's Parquet reader lists files with 32 footer-reading actors by default: on 2
    # cores, starting them costs more than the tests' few shards (the workers inherit this).
    os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "2")


# The tests' Rays start no dashboard. Ray Train's placement-group cleaner asks the state API
# whether its controller lives, at the dashboard it finds on the host: another test's or
# job's Ray, which knows no such actor, so the cleaner removed a live run's placement
# group and its workers died ("Destroying worker since its placement group was removed").
# Named an address where nothing answers, the cleaner's asks fail and it keeps watching.
NO_STATE_API = {"env_vars": {"RAY_API_SERVER_ADDRESS": "http://127.0.0.1:9"}}


def _local_ray(owner: str, **resources):
    import ray

    if _ray_owner["owner"] == owner and ray.is_initialized():
        return ray
    _ray_environment()
    # 4 logical CPUs on a 2-core machine: two 1-CPU trainers leave room for Ray Data's
    # read tasks, which otherwise starve and deadlock the run.
    # "local": a new instance even while another Ray runs on this machine (a test's own
    # cluster, or the other test process's); a bare init would join that one.
    if ray.is_initialized():
        # Another fixture's Ray, or a connection left by an earlier module (a test's own
        # cluster, a Ray a library call auto-started): this one must be a fresh local one.
        ray.shutdown()
    ray.init(
        address="local",
        **({"num_cpus": 4} | resources),
        include_dashboard=False,
        log_to_driver=True,
        runtime_env=NO_STATE_API,
    )
    _ray_owner["owner"] = owner
    return ray


def _shutdown_if_owner(owner: str) -> None:
    import ray

    if _ray_owner["owner"] == owner:
        ray.shutdown()
        _ray_owner["owner"] = None


@pytest.fixture(scope="module")
def ray_session(s3_endpoint, request):
    """A fresh local Ray per test module, for the modules that start Ray Train runs. One Ray
    for the whole session hung in CI: after ~8 minutes and many Ray Train runs, the driver's
    next remote-function export to the GCS never returned (not reproduced with any smaller
    set of modules)."""
    ray = _local_ray(request.module.__name__)
    yield ray
    _shutdown_if_owner(request.module.__name__)


@pytest.fixture(scope="module")
def fake_gpu_ray(request):
    """A module's own local Ray that declares 2 GPUs on this CPU machine (placement tests)."""
    ray = _local_ray(request.module.__name__, num_gpus=2)
    yield ray
    _shutdown_if_owner(request.module.__name__)


@pytest.fixture
def local_cluster():
    """A Ray cluster of nodes started by this process (Ray's ``cluster_utils``): a head with
    no CPUs, where the driver runs, and the nodes the test adds, drains or removes. They share
    this machine's disk."""
    import ray
    from ray.cluster_utils import Cluster

    _ray_environment()
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=True, runtime_env=NO_STATE_API)
    _ray_owner["owner"] = "local_cluster"
    yield cluster
    _shutdown_if_owner("local_cluster")
    cluster.shutdown()


@pytest.fixture(scope="module")
def shared_ray(s3_endpoint):
    """One local Ray for the tests that start only tasks, actors and Ray Data (no Ray Train
    run): starting a Ray per module cost 5-10 s each. It is kept from module to module and
    started again only after a module's own Ray (``ray_session``) replaced it. In one test
    process those tests run last (see ``pytest_collection_modifyitems``), so that happens
    only where one test file uses both fixtures; under xdist, whenever a process goes from a
    file with its own Ray to one with the shared Ray."""
    ray = _local_ray("shared")
    yield ray


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_ray():
    yield
    _shutdown_if_owner("shared")


# The test files that take minutes, as xdist names them. Their tests are also marked
# `runs_long` (for -m), which is what the ordering below reads; the scheduler below runs in
# xdist's controller, which collects no tests and so sees no markers.
RUNS_LONG = frozenset(
    {
        "tests/workflows/test_two_node.py",
        "tests/training/test_pretrain_ray.py",
        "tests/workflows/test_decoder_recipe.py",
        "tests/training/test_resume.py",
        "tests/retrieval/test_search_ray.py",
        "tests/workflows/test_busy_s3.py",
        "tests/workflows/test_recipe_driver.py",
    }
)


def pytest_collection_modifyitems(session, config, items):
    # In one process (-n 0), tests that take minutes start first and the shared Ray's tests
    # run last. Under xdist (--dist loadfile) this orders only the tests inside a file and
    # files with as many tests: the scheduler below hands out the files in RUNS_LONG first,
    # then the others by their number of tests.
    marked = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("runs_long")}
    if not marked <= RUNS_LONG:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(marked - RUNS_LONG)} to RUNS_LONG")
    items.sort(key=lambda item: ("shared_ray" in item.fixturenames, item.get_closest_marker("runs_long") is None))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config, log):
    """xdist's ``loadfile``, except that the long files go out first, each to a process of its
    own that goes on with other files afterwards. In xdist's order (files by their number of
    tests) the one-test two-node file went out late, and the other process then sat idle for
    the last ~140 s of the suite while it ran (2026-11-28 timeline: gw1 done at 653 s, the
    two-node test from 476 s to 796 s)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            for scope in RUNS_LONG & self.workqueue.keys():
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongFilesFirst(config, log)


def write_jsonl(path, docs) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    return str(path)


def synthetic_docs(n: int, seed: int = 0) -> list[dict]:
    """Small English-like documents with distinct ids (deterministic)."""
    import random

    rng = random.Random(seed)
    words = (
        "the lord said unto moses and aaron in the land of egypt saying this month shall be "
        "unto you the beginning of months it shall be the first month of the year to you "
        "speak ye unto all the congregation of israel tenth day lamb house fathers"
    ).split()
    return [{"_id": f"d{i}", "text": " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))} for i in range(n)]
