"""Capacity waits end: a pool whose actors no node can hold fails within its wait, naming
what never came, where Ray alone would wait for ever; a pool whose actors are placed but
slow to construct is not failed."""

from __future__ import annotations

import sys
import time

import pytest
from ray import cloudpickle

from pipeline.core.actor_pool import ActorConfig, run_actor_pool
from pipeline.core.capacity import CapacityWait
from pipeline.core.errors import CapacityError
from tests.pace import bound_s

pytestmark = pytest.mark.ray


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its actor class reaches the workers by value


class _Doubler:
    def __init__(self, build_s: float = 0.0):
        time.sleep(build_s)

    def double(self, x: int) -> int:
        return 2 * x


def test_a_pool_no_node_can_hold_fails_in_its_wait_naming_the_resources(shared_ray):
    """Mutation: ``ray.wait`` without a timeout in the pool (as before) waits for ever."""
    ray = shared_ray
    pool = ActorConfig(actors=2, cpus_per_actor=64, capacity_wait_s=2)
    remote = ray.remote(_Doubler).options(**pool.remote_options(), max_restarts=0)
    started = time.monotonic()
    with pytest.raises(CapacityError, match=r"2 test actors of num_cpus 64 each: 0 placed after \d+ s") as caught:
        run_actor_pool(
            lambda: remote.remote(),
            [1, 2, 3],
            lambda actor, x: actor.double.remote(x),
            pool.max_retries,
            pool.actors,
            capacity=CapacityWait.of(pool, "test actors"),
        )
    assert time.monotonic() - started < bound_s(30)
    assert "CPU 4" in str(caught.value) and caught.value.exit_code == 1


def test_actors_placed_but_slow_to_start_are_waited_for(shared_ray):
    """The wait is for placement, not for the constructor (a model loading for minutes)."""
    ray = shared_ray
    pool = ActorConfig(actors=1, cpus_per_actor=0.5, capacity_wait_s=1)
    remote = ray.remote(_Doubler).options(**pool.remote_options(), max_restarts=0)
    results = run_actor_pool(
        lambda: remote.remote(build_s=8),
        [1, 2],
        lambda actor, x: actor.double.remote(x),
        pool.max_retries,
        pool.actors,
        capacity=CapacityWait.of(pool, "slow actors"),
    )
    assert results == [2, 4]


def test_the_wait_counts_from_the_clusters_last_change(monkeypatch):
    """An autoscaler that adds a node is progress: the clock counts from the last change.
    Mutation: counting from the first look fails this at t=15."""
    import types

    import ray as ray_module

    from pipeline.core import capacity

    now = {"t": 0.0, "cluster": {"CPU": 2.0}}
    monkeypatch.setattr(ray_module, "cluster_resources", lambda: dict(now["cluster"]))
    monkeypatch.setattr(capacity, "actor_placed", lambda actor: False)
    monkeypatch.setattr(capacity, "time", types.SimpleNamespace(monotonic=lambda: now["t"]))
    wait = CapacityWait("workers", 1, {"num_gpus": 1}, wait_s=10, since=0.0)
    wait.check(["actor"])
    now.update(t=8.0, cluster={"CPU": 6.0})  # a node joined at t=8
    wait.check(["actor"])
    now["t"] = 15.0  # 15 s since the first look, 7 since the change: still waiting
    wait.check(["actor"])
    now["t"] = 18.5
    with pytest.raises(CapacityError, match="1 workers of num_gpus 1 each: 0 placed after 10 s"):
        wait.check(["actor"])


def _sleep_then(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x


def test_tasks_no_node_can_run_end_their_wait_and_long_tasks_do_not(shared_ray, monkeypatch):
    """Tasks asking for what no node has (Ray waits for ever) fail the wait once the cluster
    sat idle for RAYDENSE_TASK_CAPACITY_WAIT_S; tasks that run for longer than that on a
    busy cluster are waited for. Mutation: ``ray.wait`` without its timeout in
    ``wait_for_tasks`` (as before) never returns from the first."""
    from pipeline.core.capacity import TASK_WAIT_VAR
    from pipeline.core.progress import get_counted

    ray = shared_ray
    monkeypatch.setenv(TASK_WAIT_VAR, "2")
    never = ray.remote(_sleep_then).options(num_cpus=64)
    started = time.monotonic()
    with pytest.raises(CapacityError, match=r"2 prepare tasks of what they ask each: 0 placed after \d+ s") as caught:
        get_counted([never.remote(i, 0) for i in range(2)], "prepare", "documents")
    assert time.monotonic() - started < bound_s(30) and "RAYDENSE_TASK_CAPACITY_WAIT_S" in str(caught.value)
    slow = ray.remote(_sleep_then).options(num_cpus=1)
    assert get_counted([slow.remote(i, 8) for i in range(2)], "prepare", "documents") == [0, 1]
